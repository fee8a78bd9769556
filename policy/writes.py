"""Write gates: which requests change something on a site, and what happens to them.

A *write* is a request whose method is not GET or HEAD (a CORS preflight OPTIONS is a read), every
WebSocket upgrade, and any GET the site policy names as a write for that site. Everything else is
a read and passes. Each write gets one of three modes, from loosest to strictest:

  allow  sent as today;
  gate   held until a person approves or denies it (a timeout is a denial);
  deny   refused at once; the site never sees it.

The stage asks for a mode (`browser.writes`); the security reviewers set a floor per site in
sites.yaml (`writes`, read by policy/schema.py into `WriteRules`); the stricter of the two wins
(`effective`), so a pipeline never loosens the site policy. Every entry whose host pattern
matches applies: the strictest floor wins, and an exception (`reads`) of any of them counts. A
request pattern is `METHOD /path` (`*` within one segment, `**` across, the query not part of
it); a GET named a write also matches the path as a server would route it (`server_path`), in
any case with `ignore_case`; a `reads` exception matches the path only as sent. Pure: no I/O,
every verdict names its reason, and the rule and line that decided.

The section, with examples: docs/policy.md, "Writes: what a logged-in browser may change". Why
the patterns match as they do: docs/decisions/0009-write-gate-patterns.md.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass

from sfguard.policy.index import RuleSet
from sfguard.policy.patterns import PatternError

#: the write modes, loosest first
WRITE_MODES: tuple[str, ...] = ("allow", "gate", "deny")
#: methods that only read (OPTIONS only as a CORS preflight)
READ_METHODS = frozenset({"GET", "HEAD"})
#: the reason a stage's own shell may not reach a host whose writes are gated or refused
SHELL_REFUSAL = "writes_guarded_host"
_METHOD_RE = re.compile(r"^[A-Z]{1,20}$")
_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()+,;=:@%*/-]*$")
_PCT_RE = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")


def _unescape(match: re.Match[str]) -> str:
    ch = chr(int(match.group(1), 16))
    return ch if ch in _UNRESERVED else match.group(0).upper()


def server_path(path: str) -> str:
    """`path` as a typical server routes it: %-escapes of unreserved characters decoded
    (`/%6cogout`), `;params` dropped from every segment (`/logout;x`), dot segments resolved,
    empty segments (duplicate slashes) and a trailing slash dropped. `/` stays `/`."""
    segments: list[str] = []
    for segment in _PCT_RE.sub(_unescape, path).split("/"):
        segment = segment.split(";", 1)[0]
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def stricter(a: str, b: str) -> str:
    """The stricter of two write modes."""
    return a if WRITE_MODES.index(a) >= WRITE_MODES.index(b) else b


def check_mode(mode: str) -> str:
    if mode not in WRITE_MODES:
        raise ValueError(f"write mode is one of {', '.join(WRITE_MODES)}, not {mode!r}")
    return mode


@dataclass(frozen=True)
class WriteVerdict:
    """What happens to one request. `write` False means a read: it passes (`mode` allow)."""
    write: bool
    mode: str
    reason: str                 # read_method, cors_preflight, write_method, websocket_upgrade, ...
    rule: str | None = None     # the sites.yaml rule that decided, if one did
    line: int | None = None     # its line in sites.yaml
    explanation: str = ""

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _glob(path: str, ignore_case: bool) -> re.Pattern[str]:
    rx = "".join(".*" if tok == "**" else "[^/]*" if tok == "*" else re.escape(tok)
                 for tok in re.split(r"(\*\*|\*)", path) if tok)
    return re.compile(rx, re.IGNORECASE if ignore_case else 0)


@dataclass(frozen=True)
class RequestPattern:
    """`METHOD /path` of a `reads` or `writes` exception. A `writes` one (`loose`) matches the
    path as sent and as a server routes it (`server_path`), in any case with `ignore_case`."""
    method: str
    path: str
    line: int
    regex: re.Pattern[str]
    loose: bool = False
    ignore_case: bool = False
    routed: re.Pattern[str] | None = None

    @property
    def text(self) -> str:
        return f"{self.method} {self.path}" + (" (any case)" if self.ignore_case else "")

    def matches(self, method: str, path: str) -> bool:
        if method != self.method:
            return False
        if not self.loose:
            return self.regex.fullmatch(path) is not None
        forms = (path, server_path(path))
        return any(rx.fullmatch(p) is not None for rx in (self.regex, self.routed or self.regex) for p in forms)


def parse_request_pattern(text: object, kind: str, line: int = 0, *, ignore_case: bool = False) -> RequestPattern:
    """Parse `METHOD /path` for the `reads` or `writes` list of an entry. Raises PatternError
    (message and a hint saying what to write instead). `ignore_case` only for `writes`."""
    example = '"POST /search"' if kind == "reads" else '"GET /logout"'
    if not isinstance(text, str):
        raise PatternError("a request is text", f"quote it, e.g. {example}")
    parts = text.split()
    if len(parts) != 2:
        raise PatternError(f"a request is METHOD /path, not {text[:80]!r}", f"e.g. {example}")
    method, path = parts
    if not _METHOD_RE.match(method):
        raise PatternError(f"{method[:20]!r} is not an HTTP method", f"upper case, e.g. {example}")
    if kind == "reads" and method in READ_METHODS | {"OPTIONS"}:
        raise PatternError(f"{method} already only reads",
                           "list under reads the requests that read although their method writes, "
                           'e.g. "POST /search"')
    if kind == "writes" and method != "GET":
        raise PatternError(f"every {method} already is a write", 'list only GETs under writes, e.g. "GET /logout"')
    if not _PATH_RE.match(path) or "***" in path:
        raise PatternError(f"the path {path[:80]!r} is not usable",
                           "start it with /, no query (?), no spaces; * matches within a segment, "
                           "** across segments")
    if ignore_case and kind != "writes":
        raise PatternError("ignore_case is for the GETs listed under writes",
                           "a read exception matches its path exactly as sent")
    if kind != "writes":
        return RequestPattern(method, path, line, _glob(path, False))
    return RequestPattern(method, path, line, _glob(path, ignore_case), loose=True, ignore_case=ignore_case,
                          routed=_glob(server_path(path), ignore_case))


@dataclass(frozen=True)
class WriteEntry:
    """One entry of the `writes` section."""
    patterns: tuple[str, ...]
    hosts: RuleSet
    mode: str
    reason: str
    line: int
    reads: tuple[RequestPattern, ...] = ()
    writes: tuple[RequestPattern, ...] = ()
    label: str = "sites.yaml"

    def rule(self, where: int | None = None) -> str:
        return f"{self.label}:{where or self.line} writes {', '.join(self.patterns)}"

    def covers_all(self) -> bool:
        """True when a Fetch URL pattern cannot name its hosts (an address range, IPv6)."""
        return any("/" in p or p.startswith("[") or p.count(":") > 1 for p in self.patterns)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


class WriteRules:
    """The site policy's `writes` section: floors per site, and the exceptions (requests that
    only read although they POST; GETs that write). Empty: no floor, methods decide."""

    def __init__(self, entries: Iterable[WriteEntry] = ()) -> None:
        self.entries: tuple[WriteEntry, ...] = tuple(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def matching(self, host: str, port: int | None = None) -> list[WriteEntry]:
        is_ip = _is_ip(host)
        return [e for e in self.entries if e.hosts.match(host.strip("[]"), is_ip, port) is not None]

    def guarded(self) -> list[WriteEntry]:
        """The entries whose floor is stricter than allow (what the browser must watch)."""
        return [e for e in self.entries if e.mode != "allow"]

    def floor(self, host: str, port: int | None = None) -> WriteVerdict:
        """The strictest floor over the entries for `host` (allow with no rule when none)."""
        best: WriteEntry | None = None
        for e in self.matching(host, port):
            if best is None or WRITE_MODES.index(e.mode) > WRITE_MODES.index(best.mode):
                best = e
        if best is None or best.mode == "allow":
            return WriteVerdict(True, "allow", "write_method", explanation="no write floor for this site")
        return WriteVerdict(True, best.mode, "site_floor", best.rule(), best.line,
                            f"the site policy sets writes: {best.mode} here ({best.reason})")

    def judge(self, host: str, method: str, path: str, *, websocket: bool = False,
              preflight: bool = False, port: int | None = None) -> WriteVerdict:
        """The site's verdict for one request to `host` (normalised) with `method` and `path`."""
        m = method.upper()
        entries = self.matching(host, port) if self.entries else []
        floor = self.floor(host, port) if entries else WriteVerdict(True, "allow", "write_method")

        def as_write(reason: str, explanation: str, rule: str | None = None,
                     line: int | None = None) -> WriteVerdict:
            if floor.mode != "allow":      # the floor names its rule; the kind of write goes first
                return dataclasses.replace(floor, explanation=f"{explanation}; {floor.explanation}")
            return WriteVerdict(True, "allow", reason, rule, line, explanation)

        if websocket:
            return as_write("websocket_upgrade", "a WebSocket upgrade is a write")
        if m in READ_METHODS:
            for e in entries:
                for rp in e.writes:
                    if rp.matches(m, path):
                        why = f"the site policy names {rp.text} a write ({e.reason})"
                        if floor.mode != "allow":
                            why = f"{why}; {floor.explanation}"
                        return WriteVerdict(True, floor.mode, "site_write_get", e.rule(rp.line), rp.line, why)
            return WriteVerdict(False, "allow", "read_method", explanation=f"{m} only reads")
        if m == "OPTIONS" and preflight:
            return WriteVerdict(False, "allow", "cors_preflight", explanation="a CORS preflight only asks")
        for e in entries:
            for rp in e.reads:
                if rp.matches(m, path):
                    return WriteVerdict(False, "allow", "site_read", e.rule(rp.line), rp.line,
                                        f"the site policy names {rp.text} a read ({e.reason})")
        return as_write("write_method", f"{m} is a write")


def effective(stage_mode: str, site: WriteVerdict) -> WriteVerdict:
    """The verdict once the stage's mode is applied: the stricter of the stage's and the site's."""
    check_mode(stage_mode)
    if not site.write:
        return site
    mode = stricter(stage_mode, site.mode)
    if mode == site.mode:
        return site
    return dataclasses.replace(site, mode=mode, reason="stage_mode", rule=None, line=None,
                               explanation=f"{site.explanation}; the stage asks for writes: {stage_mode}")


def shell_verdict(rules: WriteRules, stage_mode: str, host: str, port: int | None) -> WriteVerdict | None:
    """A stage's own shell (its proxy credential) reaches a host only when every write there is
    allowed: the proxy sees a tunnel, not the methods inside it, so a host whose writes are gated
    or refused for the stage is refused to its shell. None: the shell may go there."""
    verdict = effective(stage_mode, rules.floor(host, port))
    if verdict.mode == "allow":
        return None
    return dataclasses.replace(
        verdict, write=True, reason=SHELL_REFUSAL,
        explanation=f"writes to this host are {'held for a person' if verdict.mode == 'gate' else 'refused'} "
                    f"for this stage ({verdict.explanation}); the stage's shell cannot reach it: "
                    "use the browser, where the write gate applies")
