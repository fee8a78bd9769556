"""The guard's webhook configuration: `<home>/notify.yaml`, read once at `sfguard start`.

    version: 1
    webhooks:
      - url: https://chat-relay.example/sfguard     # https (http only to a loopback address)
        events: [write_held, write_timed_out, handoff_waiting, audit_chain_broken, run_failed]
        secret_file: /etc/sfguard/relay.secret      # optional; default <home>/notify.secret
        retry_for_s: 600                            # retry a failed delivery this long
        timeout_s: 10                               # one attempt's bound

`load_notify(home)` returns None when the file does not exist, the checked `NotifyConfig`
otherwise, or raises `NotifyConfigError` naming file:line:col, the field and a hint (the same
reader and wording as the site policy's). The file and every secret file must be the guard
user's own and private (0600): a webhook URL is often a credential itself, and the secret signs
every delivery. Without `secret_file`, the guard makes `<home>/notify.secret` (0600, random)
on its first start with webhooks. Secrets are registered with the log filter: never logged.
"""
from __future__ import annotations

import difflib
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sfguard.policy.errors import PolicyError, PolicyIssue
from sfguard.policy.yamlpos import loc_path, validate_at
from sfguard.policy.yamltree import Composer, at_root, child, unpack
from sfguard.supervisor import redaction
from sfguard.supervisor.home import HomeError, atomic_write

NOTIFY_FILE = "notify.yaml"
SECRET_FILE = "notify.secret"
MAX_FILE_BYTES = 64 * 1024
MIN_SECRET = 16

#: every event the guard sends, and when
EVENTS: dict[str, str] = {
    "write_held": "a write waits for a person's approval",
    "write_approved": "a person approved a held write (it was sent)",
    "write_denied": "a person denied a held write",
    "write_timed_out": "nobody decided a held write in time (denied)",
    "write_cancelled": "a held write's stage or run ended before a decision (denied)",
    "handoff_waiting": "a login handoff (live view or local window) waits for a person",
    "handoff_ended": "a login handoff ended (done, cancelled, expired, or its stage or run ended)",
    "policy_invalid": "an edit left the site policy file invalid (the last good policy stays in force)",
    "audit_chain_broken": "the audit chain no longer verifies",
    "run_failed": "a run ended as failed",
}


class NotifyConfigError(HomeError):
    """notify.yaml or a secret file cannot be used; the message names where and why (a home
    that cannot be used as it is: `sfguard start` exits 2 with it)."""

    def __init__(self, detail: str):
        super().__init__(f"the webhook configuration is invalid:\n{detail}")


class _Webhook(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str
    events: list[str] | None = Field(default=None, min_length=1)
    secret_file: str | None = None
    retry_for_s: int = Field(default=600, ge=10, le=86400)
    timeout_s: int = Field(default=10, ge=1, le=60)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        problem = url_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("events")
    @classmethod
    def _events(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name not in EVENTS:
                close = difflib.get_close_matches(name, list(EVENTS), n=1)
                raise ValueError(f"unknown event {name!r}" + (f"; did you mean {close[0]!r}?" if close
                                 else f"; events: {', '.join(EVENTS)}"))
        return value


class _NotifyFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: Literal[1]
    webhooks: list[_Webhook] = Field(min_length=1)


@dataclass(frozen=True)
class Webhook:
    url: str
    events: frozenset[str]
    secret: bytes = b""
    retry_for_s: float = 600.0
    timeout_s: float = 10.0

    @property
    def shown(self) -> str:
        return shown_url(self.url)

    def __repr__(self) -> str:    # never the URL's path (often a token) or the secret
        return f"Webhook({self.shown}, {len(self.events)} events)"


@dataclass(frozen=True)
class NotifyConfig:
    source: Path
    webhooks: tuple[Webhook, ...]


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a webhook (None when it can)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return "not a valid URL"
    if parts.scheme not in ("http", "https") or not host:
        return "must be an https:// URL with a host"
    if parts.username is not None or parts.password is not None:
        return "must not carry a user or password (the signature authenticates the guard)"
    if parts.scheme == "http" and not _loopback(host):
        return "must be https:// (plain http:// only to a loopback address, e.g. a local relay)"
    return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shown_url(url: str) -> str:
    """A webhook URL as logs and status show it: scheme, host and port; never the path or
    query (chat incoming-webhook URLs carry their token there)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}/..."


def load_notify(home: Path) -> NotifyConfig | None:
    """The home's notify.yaml, checked (None when there is none)."""
    path = home / NOTIFY_FILE
    if not path.exists() and not path.is_symlink():
        return None
    text = _read_private(path, "notify.yaml holds webhook URLs, which are often credentials")
    try:
        root = Composer(str(path)).compose(text.decode("utf-8-sig"))
    except PolicyError as exc:
        raise NotifyConfigError(str(exc)) from None
    except UnicodeDecodeError:
        raise NotifyConfigError(f"{path}: the file is not UTF-8 text") from None
    if root is None:
        raise NotifyConfigError(f"{path}:1:1: (file): the file is empty (hint: start with version: 1 "
                                "and a webhooks list, see docs/operator-guide.md)")
    model, errors = validate_at(_NotifyFile, root, at_root(root), child)
    if model is None:
        raise NotifyConfigError("\n".join(_issue(err, at, path) for err, at, _ in errors))
    hooks = []
    for hook in model.webhooks:
        secret_path = Path(hook.secret_file).expanduser() if hook.secret_file else home / SECRET_FILE
        secret = _secret(secret_path, made_by_guard=hook.secret_file is None)
        hooks.append(Webhook(hook.url, frozenset(hook.events or EVENTS), secret,
                             float(hook.retry_for_s), float(hook.timeout_s)))
    return NotifyConfig(path, tuple(hooks))


def _issue(err: dict[str, Any], at: tuple[Any, int], path: Path) -> str:
    loc = tuple(err["loc"])
    line, col = unpack(at[1])
    msg, hint = err["msg"].removeprefix("Value error, "), None
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        allowed = list(_NotifyFile.model_fields) if len(loc) == 1 else list(_Webhook.model_fields)
        close = difflib.get_close_matches(key, allowed, n=1)
        msg = f"unknown key '{key}'"
        hint = f"did you mean '{close[0]}'?" if close else f"allowed keys here: {', '.join(allowed)}"
    elif err["type"] == "missing":
        msg = f"'{loc[-1]}' is required"
    elif err["type"] in ("greater_than_equal", "less_than_equal", "literal_error", "int_type",
                         "string_type", "list_type"):
        msg = f"{msg}, got {err.get('input')!r}"
    return str(PolicyIssue(str(path), line, col, loc_path(loc) or "(file)", msg, hint))


def _read_private(path: Path, why: str) -> bytes:
    """A file of this user that nobody else may read or write (refused otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise NotifyConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise NotifyConfigError(f"{path}: not a plain file of this user")
        if st.st_mode & 0o077:
            raise NotifyConfigError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read or "
                                    f"write it; {why} (hint: chmod 600 {path})")
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise NotifyConfigError(f"{path}: over {MAX_FILE_BYTES // 1024} KiB")
    return data


def _secret(path: Path, *, made_by_guard: bool) -> bytes:
    """The shared secret in `path`; the home's default one is made when missing."""
    if made_by_guard and not path.exists() and not path.is_symlink():
        atomic_write(path, secrets.token_hex(32).encode() + b"\n", 0o600)
    value = _read_private(path, "it holds the webhook secret").strip()
    if len(value) < MIN_SECRET:
        raise NotifyConfigError(f"{path}: the secret is shorter than {MIN_SECRET} characters "
                                "(hint: openssl rand -hex 32 > FILE)")
    try:
        redaction.register_secret(value.decode())
    except (UnicodeDecodeError, ValueError):
        raise NotifyConfigError(f"{path}: the secret must be text (hint: openssl rand -hex 32)") from None
    return value
