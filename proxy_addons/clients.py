"""Proxy clients: who may use a guard proxy, with which credentials and which allowlist.

A client authenticates with its own `NAME:TOKEN` pair as HTTP Basic proxy credentials
(`Proxy-Authorization: Basic base64(NAME:TOKEN)`). Each client carries its own compiled
allowlist (a `policy.RuleSet`) and, optionally, the id of the run it belongs to (written into
the decision log). One guard process can serve many clients.

`ClientRegistry` is the in-process API the daemon uses to add, update and remove clients while
the proxy runs. It is safe to call from any thread or from the proxy's event loop: every change
replaces an immutable snapshot under a lock, and the proxy reads the current snapshot without
locking (a dict read of an immutable mapping).

Tokens never leave this module in logs, reprs or exceptions.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hmac
import json
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from sfguard import policy
from sfguard.errors import SfguardError
from sfguard.policy.pace import BUDGET_RATES, BUDGET_TOTALS, Budget
from sfguard.policy.writes import WRITE_MODES
from sfguard.proxy_addons.pacing import StageBudget

#: A client name: what the decision log shows. No ':' (separator), no spaces or control chars.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: A token: printable, no ':' is needed (the first ':' separates name and token), 16..256 chars.
TOKEN_RE = re.compile(r"^[\x21-\x7e]{16,256}$")

#: Environment variable read by `sfguard proxy` for clients (same format as a clients file).
CLIENTS_ENV = "SFGUARD_PROXY_CLIENTS"


class ClientSpecError(SfguardError):
    """A client definition is invalid. The message never contains the token."""


@dataclass(frozen=True)
class Client:
    """One proxy client. `token` is secret: it is excluded from repr and never logged."""

    name: str
    token: str = field(repr=False)
    allow: policy.RuleSet | None = field(default=None, repr=False)
    allow_patterns: tuple[str, ...] = ()
    run: str | None = None
    #: a stage's shell credential: the stage's browser.writes. Hosts whose writes are gated or
    #: refused for the stage (by it or by the site policy's floor) are refused to this client
    #: (policy.writes.shell_verdict). None: a browser's client, judged by its write gate instead.
    writes: str | None = None
    #: the one listener port this client may use (a proxy shared by many runs gives each run
    #: its own listener); None: any listener of its proxy
    port: int | None = None
    #: a browser the guard has not yet put under its rules (its write gate, its extension's
    #: rules): every request of it is refused, whatever the host (`browser_not_ready`)
    held: bool = False
    #: whose pace this client's requests count on (proxy_addons/pacing.py): the profile of its
    #: browser (a stage's shell: its browser's), or its throw-away browser; None: its own name
    pace_key: str | None = None
    #: the budgets of the stages this client serves (every one counts each request)
    budgets: tuple[StageBudget, ...] = ()

    @property
    def who(self) -> str:
        return self.pace_key or f"client:{self.name}"

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ClientSpecError(
                f"client name {self.name[:40]!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
            )
        if not TOKEN_RE.match(self.token):
            raise ClientSpecError(
                f"token of client {self.name!r} is invalid: use 16-256 printable characters, no spaces"
            )


def new_token() -> str:
    """A fresh random token (32 url-safe characters, 192 bits)."""
    return secrets.token_urlsafe(24)


def parse_credential(text: str) -> tuple[str, str]:
    """Split `NAME:TOKEN`; raise ClientSpecError (without echoing the token) when malformed."""
    name, sep, token = text.partition(":")
    if not sep:
        raise ClientSpecError("a client must be given as NAME:TOKEN")
    Client(name=name, token=token)  # validates both parts
    return name, token


def parse_proxy_authorization(value: str | None) -> tuple[str, str] | None:
    """Decode a `Proxy-Authorization: Basic ...` value into (name, token), or None."""
    if not value:
        return None
    scheme, _, encoded = value.strip().partition(" ")
    if scheme.lower() != "basic" or not encoded or len(encoded) > 1024:
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    name, sep, token = decoded.partition(":")
    if not sep:
        return None
    return name, token


def load_clients_text(text: str, source: str, default_allow: Iterable[str] = ()) -> list[Client]:
    """Parse clients from JSON or from lines.

    JSON: a list of objects `{"name": ..., "token": ..., "allow": [patterns], "run": id,
    "writes": mode}` where `allow`, `run` and `writes` are optional (`allow` defaults to the command line's `--allow`).
    Lines: one `NAME:TOKEN` per line; blank lines and lines starting with '#' are ignored; each
    client gets the default allowlist.
    Raises ClientSpecError naming the source and entry, never the token.
    """
    default_allow = tuple(default_allow)
    stripped = text.strip()
    specs: list[tuple[str, str, tuple[str, ...], str | None, str | None]] = []
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ClientSpecError(f"{source}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        for i, item in enumerate(data):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                    or not isinstance(item.get("token"), str):
                raise ClientSpecError(f"{source}: entry {i} needs string fields 'name' and 'token'")
            allow = item.get("allow", list(default_allow))
            if not isinstance(allow, list) or not all(isinstance(p, str) for p in allow):
                raise ClientSpecError(f"{source}: entry {i}: 'allow' must be a list of patterns")
            run = item.get("run")
            if run is not None and not isinstance(run, str):
                raise ClientSpecError(f"{source}: entry {i}: 'run' must be a string")
            writes = item.get("writes")
            if writes is not None and writes not in WRITE_MODES:
                raise ClientSpecError(f"{source}: entry {i}: 'writes' is one of {', '.join(WRITE_MODES)}")
            unknown = set(item) - {"name", "token", "allow", "run", "writes"}
            if unknown:
                raise ClientSpecError(f"{source}: entry {i}: unknown field(s) {sorted(unknown)}")
            specs.append((item["name"], item["token"], tuple(allow), run, writes))
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                name, token = parse_credential(line)
            except ClientSpecError as exc:
                raise ClientSpecError(f"{source}:{lineno}: {exc}") from None
            specs.append((name, token, default_allow, None, None))
    clients = []
    for i, (name, token, allow, run, writes) in enumerate(specs):
        try:
            clients.append(make_client(name, token, allow, run=run, writes=writes))
        except ClientSpecError as exc:
            raise ClientSpecError(f"{source}: entry {i}: {exc}") from None
    return clients


def load_clients_file(path: str | os.PathLike[str]) -> str:
    """Read a clients file, refusing one that group or others may read (it holds tokens)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ClientSpecError(f"clients file {p}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ClientSpecError(f"clients file {p}: not a regular file")
    if st.st_mode & 0o077:
        raise ClientSpecError(
            f"clients file {p} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it"
        )
    return p.read_text(encoding="utf-8")


def parse_budgets(items: object) -> tuple[StageBudget, ...]:
    """Stage budgets as the daemon sends them: [{"label", "budget": {...}, "until"}]."""
    if items is None:
        return ()
    if not isinstance(items, list) or len(items) > 64:
        raise ClientSpecError("budgets must be a list")
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("label"), str) \
                or not isinstance(item.get("budget"), dict):
            raise ClientSpecError("a budget is {label, budget, until}")
        values = item["budget"]
        if set(values) - set(BUDGET_TOTALS + BUDGET_RATES) or not all(
                type(v) in (int, float) and v > 0 for v in values.values()):
            raise ClientSpecError("a budget names positive page_loads, requests, active_minutes, "
                                  "page_loads_per_minute or requests_per_minute")
        until = item.get("until")
        if until is not None and type(until) not in (int, float):
            raise ClientSpecError("a budget's until is a time in seconds")
        out.append(StageBudget(item["label"][:200], Budget(**values), until))
    return tuple(out)


def make_client(name: str, token: str, allow: Iterable[str], run: str | None = None,
                writes: str | None = None, port: int | None = None, held: bool = False,
                pace_key: str | None = None, budgets: Iterable[StageBudget] = ()) -> Client:
    """Build a Client, compiling its allowlist (raises ClientSpecError or policy.PolicyError)."""
    patterns = tuple(allow)
    Client(name=name, token=token)  # validate before compiling
    ruleset = policy.compile_patterns(patterns, source="--allow")
    if writes is not None and writes not in WRITE_MODES:
        raise ClientSpecError(f"client {name!r}: writes is one of {', '.join(WRITE_MODES)}")
    if port is not None and (type(port) is not int or not 0 < port <= 65535):
        raise ClientSpecError(f"client {name!r}: port must be a TCP port number")
    if type(held) is not bool:
        raise ClientSpecError(f"client {name!r}: held is true or false")
    if pace_key is not None and (not isinstance(pace_key, str) or not 0 < len(pace_key) <= 300):
        raise ClientSpecError(f"client {name!r}: pace_key is a text of 1-300 characters")
    return Client(name=name, token=token, allow=ruleset, allow_patterns=patterns, run=run,
                  writes=writes, port=port, held=held, pace_key=pace_key, budgets=tuple(budgets))


class ClientRegistry:
    """The clients of one guard proxy; thread- and asyncio-safe.

    Writers (`add`, `update_allow`, `remove`, `replace_all`) take a lock and publish a new
    immutable mapping; readers (`authenticate`, `get`, `names`) use the current mapping as is.
    A change affects new connections and new plain-HTTP requests; established tunnels stay up.
    """

    def __init__(self, clients: Iterable[Client] = (), *, loaded: bool = True) -> None:
        self._lock = threading.Lock()
        self._clients: Mapping[str, Client] = MappingProxyType({})
        self.replace_all(clients)
        #: False until the first client set arrives (a run proxy fed over stdin): until then no
        #: credential can be judged, and the proxy closes connections instead of answering 407.
        self.loaded = loaded

    # -- writers -------------------------------------------------------------------------
    def add(self, client: Client) -> None:
        """Add a client; raise ClientSpecError if the name is taken."""
        with self._lock:
            if client.name in self._clients:
                raise ClientSpecError(f"client {client.name!r} already exists")
            new = dict(self._clients)
            new[client.name] = client
            self._clients = MappingProxyType(new)

    def update_allow(self, name: str, patterns: Iterable[str]) -> Client:
        """Replace a client's allowlist (compiled first, so a bad pattern changes nothing)."""
        patterns = tuple(patterns)
        ruleset = policy.compile_patterns(patterns, source="--allow")
        with self._lock:
            old = self._clients.get(name)
            if old is None:
                raise KeyError(name)
            new_client = dataclasses.replace(old, allow=ruleset, allow_patterns=patterns)
            new = dict(self._clients)
            new[name] = new_client
            self._clients = MappingProxyType(new)
            return new_client

    def remove(self, name: str) -> bool:
        """Remove a client; True if it existed."""
        with self._lock:
            if name not in self._clients:
                return False
            new = dict(self._clients)
            del new[name]
            self._clients = MappingProxyType(new)
            return True

    def replace_all(self, clients: Iterable[Client]) -> None:
        """Replace every client at once (duplicate names are an error)."""
        new: dict[str, Client] = {}
        for c in clients:
            if c.name in new:
                raise ClientSpecError(f"client {c.name!r} is defined twice")
            new[c.name] = c
        with self._lock:
            self._clients = MappingProxyType(new)
            self.loaded = True

    # -- readers -------------------------------------------------------------------------
    def get(self, name: str) -> Client | None:
        return self._clients.get(name)

    def names(self) -> list[str]:
        return sorted(self._clients)

    def __len__(self) -> int:
        return len(self._clients)

    def authenticate(self, header_value: str | None, port: int | None = None) -> Client | None:
        """The client whose credentials are in this Proxy-Authorization value, or None; a
        client bound to a listener (`Client.port`) only on that listener's `port`.

        The token comparison is constant-time; an unknown name is compared against a dummy so
        that timing does not reveal which names exist.
        """
        creds = parse_proxy_authorization(header_value)
        if creds is None:
            return None
        name, token = creds
        client = self._clients.get(name)
        expected = client.token if client is not None else "\x00" * 32
        ok = hmac.compare_digest(token.encode("utf-8", "surrogateescape"),
                                 expected.encode("utf-8"))
        if not ok or client is None:
            return None
        return client if client.port is None or client.port == port else None
