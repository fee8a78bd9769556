"""Catching a guarded browser's writes in the guard's own DevTools pipe.

The guard holds every browser's DevTools pipe (supervisor/gate/cdp_pipe.py); neither the page nor
the stage can speak on it. Where any stage of that browser, or a floor of the site policy, puts a
host in `gate` or `deny`, browser-level `Fetch.enable` pauses the requests to that host that can
carry a write (`patterns`: any spelling of the host, since the pattern is the host's canonical
name anywhere in the address). Each paused request is judged by the site policy's write rules
and the strictest mode any stage of the browser has for its host (`policy.writes.effective`):
a write follows its host, not the tab that sends it.

  read                  continued at once;
  write, allow          continued at once (logged);
  write, deny           answered by the guard: 403 with a short text/html body; the site never
                        sees it, on every attempt;
  write, gate           held until the approver decides: approved -> continued with nothing
                        changed (original bytes, exactly once: one approval per request),
                        denied or timed out -> the 403.

The tab that sent a write (supervisor/writes/tabs.py) names its stage: the labels of its log
lines and approval, and a replay-unsafe retry's history (a retry of a stage that wrote holds
what it would have allowed; it never loosens a deny). Nothing here logs a body, a query value
or a credential. Why the patterns look as they do: docs/decisions/0009-write-gate-patterns.md.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email import policy as email_policy
from email.parser import BytesParser
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from sfguard.policy.errors import MalformedHost
from sfguard.policy.hosts import normalize_host_ex
from sfguard.policy.index import RuleSet, compile_patterns
from sfguard.policy.patterns import PatternError, parse_pattern
from sfguard.policy.writes import WriteRules, WriteVerdict, effective, stricter
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.writes import tabs
from sfguard.supervisor.writes.held import HeldWrite, WriteApprover, WriteOutcome, hidden_query, new_approval_id
from sfguard.supervisor.writes.masking import shown_body, shown_headers

log = logging.getLogger("sfguard.writes")

#: default seconds a held write waits for a person (a timeout is a denial)
DEFAULT_TIMEOUT = 600.0
REFUSED_BODY = ("<!doctype html><meta charset=utf-8><title>sfguard: write refused</title>"
                "<p>sfguard: this write was refused by the guard's write gate ({why}). "
                "It was not sent to the site. Do not try again another way.</p>")


class DenyAll:
    """The approver until the approvals store is wired: every held write is denied at once."""

    async def decide(self, held: HeldWrite, timeout: float) -> WriteOutcome:
        return WriteOutcome(False, "guard", "no approver")


@dataclass
class WriteContext:
    """Who the writes of one browser belong to, for the held-write record and the logs."""
    run_id: str
    profile: str
    stage_id: str | None = None
    attempt: int | None = None
    #: the write mode per allowed host pattern: the strictest over the browser's stages
    modes: dict[str, str] = field(default_factory=dict)
    #: writes released in earlier attempts of a replay-unsafe stage: every write is held
    earlier: tuple[dict[str, object], ...] = ()
    #: `replay_safe: false`: every write is watched (allowed ones recorded for a retry)
    replay_unsafe: bool = False


@dataclass
class StageWrites:
    """One stage's part of a shared browser's write gate: its attempt, what its earlier attempts
    sent, what this attempt sent. Its modes are kept for the record; a write is judged by the
    strictest mode of every stage for its host (`WriteInterceptor.host_mode`)."""
    stage_id: str | None
    attempt: int | None
    modes: dict[str, str]
    replay_unsafe: bool = False
    earlier: tuple[dict[str, object], ...] = ()
    released: list[dict[str, object]] = field(default_factory=list)
    compiled: list[tuple[RuleSet, str]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.compiled = []
        for pattern, mode in self.modes.items():
            with contextlib.suppress(PatternError, ValueError):
                self.compiled.append((compile_patterns([pattern], "writes"), mode))

    def mode(self, host: str, is_ip: bool, port: int | None) -> str:
        mode = "allow"
        for rs, m in self.compiled:
            if rs.match(host, is_ip, port) is not None:
                mode = stricter(mode, m)
        return mode


#: Fetch pattern types Chromium only ever fetches with GET (no web API sends any other method as
#: one): a gated host's requests of these types are not paused (a page's images, scripts and
#: styles are most of its requests), except on hosts whose GETs the site policy names writes. A
#: renderer that lies about a request's type to send another method as one of these meets the
#: extension's GET_ONLY_RULE (websockets.py) instead.
GET_ONLY_TYPES = ("Image", "Script", "Stylesheet", "Font", "Media")
#: the other types a Fetch pattern takes: paused. Measured on Chromium 156: a pattern takes 12 of
#: the protocol's 19 resource types (TextTrack, Prefetch, WebSocket, Manifest, SignedExchange,
#: Preflight and FedCM are refused: no request is matched as one of them), so these with
#: GET_ONLY_TYPES cover every request; tests/browser_host/test_write_gates.py checks that against
#: the browser itself, so a type a later Chromium adds fails there, not silently.
WRITE_TYPES = ("Document", "XHR", "Fetch", "EventSource", "Ping", "CSPViolationReport", "Other")


def host_key(pattern: str) -> str:
    """What a Fetch pattern looks for in an address to catch `pattern`'s hosts whatever their
    spelling: the canonical name (`*.Shop.Test.:8080` -> `shop.test`, which an address with user
    info, a trailing dot or any port still contains), or `*` where an address cannot be named
    by a part of it (IPv6, address ranges)."""
    try:
        parsed = parse_pattern(pattern, allow_list=False)
    except PatternError:
        return "*"
    if parsed.kind in ("cidr",) or ":" in parsed.key:
        return "*"
    return parsed.key


def url_patterns(key: str, types: tuple[str, ...] | None = WRITE_TYPES) -> list[dict[str, str]]:
    """Fetch patterns for a host key (`host_key`): its name anywhere in the address (`*` wildcards
    match anything, so more is paused than needed, never less), once per resource type (a
    pattern names one type, or, with `types` None, every type)."""
    pattern = {"urlPattern": "*" if key == "*" else f"*{key}*"}
    return [pattern] if types is None else [{**pattern, "resourceType": t} for t in types]


def shown_path(url: str) -> str:
    """For the decision log: the path, with `?...` where a query was (its values never)."""
    parts = urlsplit(url)
    return (parts.path or "/") + ("?..." if parts.query else "")


class WriteInterceptor:
    """The write gate of one browser's pipe. `pipe.writes = WriteInterceptor(pipe, ctx, ...)`;
    the pipe hands every paused request to `paused`."""

    def __init__(self, pipe: Any, ctx: WriteContext, *,
                 rules: WriteRules | Callable[[], WriteRules] | None = None,
                 approver: WriteApprover | None = None, timeout: float = DEFAULT_TIMEOUT,
                 record: Callable[[str, dict[str, object]], None] | None = None) -> None:
        self.pipe, self.ctx = pipe, ctx
        #: the site policy's writes section; a callable gives the live one (hot reload)
        self._rules = rules if rules is not None else WriteRules()
        self.approver: WriteApprover = approver or DenyAll()
        self.timeout = timeout
        self.record = record
        self.released: list[dict[str, object]] = []   # writes sent (allowed or approved)
        self._tasks: set[asyncio.Task] = set()
        #: each stage's part (a shared browser); `owner` tells whose tab a target is (target
        #: id -> stage id). A write no stage's tab sent (a worker's) is labelled with the stage
        #: that attached last, and a retry's history is every stage's (`ctx`): fail closed.
        self.stages: dict[str, StageWrites] = {}
        self.owner: Callable[[Any], str | None] | None = None
        #: tabs whose own navigation is held (target id -> what waits): Chromium holds every
        #: DevTools message to a navigating frame until it commits, so the CDP gate answers the
        #: stage's commands to such a tab itself (`held_navigation`) instead of letting them hang
        self.held_tabs: dict[str, dict[str, str]] = {}
        self._holding = 0                  # requests paused until a person decides
        self.set_modes(ctx.modes)

    @property
    def rules(self) -> WriteRules:
        return self._rules() if callable(self._rules) else self._rules

    def set_modes(self, modes: dict[str, str]) -> None:
        self.ctx.modes = dict(modes)
        self._merged = StageWrites(None, None, dict(modes))

    def host_mode(self, host: str, is_ip: bool, port: int | None) -> str:
        """The strictest mode any stage of this browser has for the host (before floors)."""
        return self._merged.mode(host, is_ip, port)

    stage_mode = host_mode

    def who(self, tab: dict | None) -> StageWrites:
        """The stage whose tab (or the tab that opened it) sent a request, else everyone's (`ctx`)."""
        for target in (tab or {}).get("targetId"), (tab or {}).get("openerId"):
            stage_id = self.owner(target) if self.owner is not None and target else None
            mine = self.stages.get(stage_id) if stage_id is not None else None
            if mine is not None:
                return mine
        merged = self._merged
        merged.stage_id, merged.attempt = self.ctx.stage_id, self.ctx.attempt
        merged.replay_unsafe, merged.earlier, merged.released = (self.ctx.replay_unsafe, self.ctx.earlier,
                                                                 self.released)
        return merged

    def guarded(self) -> bool:
        return (bool(self.ctx.earlier) or self.ctx.replay_unsafe or bool(self.rules.guarded())
                or any(m != "allow" for m in self.ctx.modes.values()))

    def patterns(self) -> list[dict[str, str]]:
        """Fetch patterns: requests of every type that can carry a write (WRITE_TYPES) to the
        hosts whose mode is gate or deny, by a stage or by a floor of the site policy (every host
        while a stage is replay-unsafe, or for a floor no name covers); and requests of every
        type to the hosts whose GETs the site policy names writes (an `<img src=/logout>` is
        one, in any spelling of its path: docs/policy.md)."""
        keys = {host_key(p) for p, mode in self.ctx.modes.items() if mode != "allow"}
        for entry in self.rules.guarded():
            keys |= {host_key(p) for p in entry.patterns}
        if self.ctx.earlier or self.ctx.replay_unsafe or "*" in keys:
            keys = {"*"}
        out: list[dict[str, str]] = []
        for key in sorted(keys):
            out += url_patterns(key)
        get_keys = {host_key(p) for entry in self.rules.entries if entry.writes for p in entry.patterns}
        for key in sorted({"*"} if "*" in get_keys else get_keys):
            out += url_patterns(key, None)
        return list({(p["urlPattern"], p.get("resourceType")): p for p in out}.values())

    # -- one paused request ------------------------------------------------------------------
    def paused(self, params: dict) -> None:
        """Called by the pipe (synchronously, in its reader) for each Fetch.requestPaused: a read
        is continued at once; a write is judged by its host and handed to a task that finds the
        tab (and so the stage) it came from."""
        rid = params.get("requestId")
        req = params.get("request") or {}
        method = str(req.get("method") or "GET").upper()
        url = str(req.get("url") or "")
        try:
            parts = urlsplit(url)
            host, is_ip = normalize_host_ex(parts.hostname or "")
            port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
        except (MalformedHost, ValueError):
            self._refuse(rid, "malformed_url", method, "?", None, "", None, self.who(None))
            return
        websocket = parts.scheme in ("ws", "wss")
        preflight = method == "OPTIONS" and "access-control-request-method" in {
            k.lower() for k in (req.get("headers") or {})}
        site = self.rules.judge(host, method, parts.path or "/", websocket=websocket,
                                preflight=preflight, port=port)
        if not site.write:
            self.pipe.continue_request(rid)
            return
        verdict = effective(self.host_mode(host, is_ip, port), site)
        self._spawn(self._write(rid, params, method, url, host, port, verdict))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, rid: Any, params: dict, method: str, url: str, host: str, port: int,
                     verdict: WriteVerdict) -> None:
        path = shown_path(url)
        tab = await tabs.sender_tab(self.pipe, params.get("frameId"))
        who = self.who(tab)
        if who.earlier and verdict.mode == "allow":     # a retry never loosens; it may tighten
            verdict = WriteVerdict(True, "gate", "replay_unsafe_retry",
                                   explanation="an earlier attempt of this replay-unsafe stage wrote")
        if verdict.mode == "allow":
            self.pipe.continue_request(rid)
            self._released(who, method, url)
            self.record_decision("allowed", method, host, port, path, verdict, who)
        elif verdict.mode == "deny":
            self._refuse(rid, verdict.reason, method, host, port, path, verdict, who)
        else:
            await self._hold(rid, params, method, url, host, port, path, verdict, who, tab)

    def _released(self, who: StageWrites, method: str, url: str) -> None:
        who.released.append({"method": method, "url": url, "at": time.time()})

    def _refuse(self, rid: Any, why: str, method: str, host: str, port: int | None, path: str,
                verdict: WriteVerdict | None, who: StageWrites, decision: str = "refused",
                approval: str | None = None) -> None:
        body = REFUSED_BODY.format(why=why).encode()
        self.pipe.fulfill_request(rid, 403, [
            {"name": "Content-Type", "value": "text/html; charset=utf-8"},
            {"name": "X-Sfguard-Decision", "value": f"deny; reason={why}"},
            {"name": "Cache-Control", "value": "no-store"}], body)
        self.record_decision(decision, method, host, port, path, verdict, who, approval=approval)

    def holding(self) -> bool:
        """True while a request waits for a person (the pipe must not turn interception off:
        Fetch.disable would let it go)."""
        return self._holding > 0

    def held_navigation(self, target_id: object) -> str | None:
        """What a stage is told when it sends a command to a tab whose navigation is held (the
        CDP gate answers with it at once), or None when nothing of that tab waits."""
        held = self.held_tabs.get(target_id) if isinstance(target_id, str) else None
        if held is None:
            return None
        return (f"write_held: approval {held['approval']} waits for a person ({held['request']}); this tab "
                f"keeps the page it was on ({held['page']}) and goes on once the write is decided. "
                "Take a screenshot and report it; do not send the write another way, and do not close "
                "or navigate this tab (docs/SKILL.md)")

    async def _hold(self, rid: Any, params: dict, method: str, url: str, host: str, port: int, path: str,
                    verdict: WriteVerdict, who: StageWrites, tab: dict | None) -> None:
        approval = new_approval_id()
        target = str(tab.get("targetId")) if tab is not None else None
        navigating = params.get("resourceType") == "Document" and target is not None \
            and target == params.get("frameId")
        if navigating and target is not None and tab is not None:
            # the tab's own page is on its way out: the gate answers commands to it (see held_tabs)
            self.held_tabs[target] = {"approval": approval, "request": f"{method} {hidden_query(url)}",
                                      "page": hidden_query(str(tab.get("url") or ""))}
            self.pipe.tell_tab_watchers("held", target)   # a navigation command in flight: answered now
        self._holding += 1
        try:
            await self._hold_until_decided(rid, params, method, url, host, port, path, verdict, who, tab,
                                           approval, navigating)
        finally:
            self._holding -= 1
            if target is not None:
                self.held_tabs.pop(target, None)
            if not self._holding:
                self.pipe.apply_write_patterns()    # interception kept on for it may end now

    async def _hold_until_decided(self, rid: Any, params: dict, method: str, url: str, host: str, port: int,
                                  path: str, verdict: WriteVerdict, who: StageWrites, tab: dict | None,
                                  approval: str, navigating: bool) -> None:
        # a navigating tab cannot be read (its messages wait for the commit): its picture only
        shot, tab_url, secret_inputs = await tabs.capture(self.pipe, tabs.shown_tab(self.pipe, tab, url),
                                                          read_inputs=not navigating)
        held = self.held_write(params, method, url, host, path, verdict, who, port=port, screenshot=shot,
                               tab_url=tab_url, password_fields=secret_inputs, approval_id=approval)
        self.record_decision("held", method, host, port, path, verdict, who, approval=approval)
        try:
            outcome = await asyncio.wait_for(self.approver.decide(held, self.timeout), self.timeout + 5)
        except TimeoutError:
            outcome = WriteOutcome(False, "timeout", "no decision in time")
        except asyncio.CancelledError:
            with swallowed(log, "refusing a held write of an ended stage"):
                self._refuse(rid, "write_denied", method, host, port, path, verdict, who, "denied", approval)
            raise
        except Exception:  # fail closed: an approver that breaks denies
            log.exception("the write approver failed; the write is denied")
            outcome = WriteOutcome(False, "guard", "approver failed")
        with swallowed(log, "releasing or refusing a held write"):
            if outcome.approved:
                self.pipe.continue_request(rid)
                self._released(who, method, url)
                self.record_decision("approved", method, host, port, path, verdict, who, outcome, approval)
            else:
                timed_out = outcome.by == "timeout"
                self._refuse(rid, "write_timeout" if timed_out else "write_denied", method, host, port, path,
                             verdict, who, "timeout" if timed_out else "denied", approval)

    def held_write(self, params: dict, method: str, url: str, host: str, path: str,
                   verdict: WriteVerdict, who: StageWrites | None = None, **extra: Any) -> HeldWrite:
        """What the person is shown of one paused request (`extra`: port, screenshot, tab_url,
        password_fields)."""
        who = who or self.who(None)
        req = params.get("request") or {}
        body = _body(req)
        headers = {str(k): str(v) for k, v in (req.get("headers") or {}).items()}
        ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), None)
        form = None
        kind = ctype.split(";")[0].strip().lower() if ctype else ""
        if kind == "application/x-www-form-urlencoded":
            form = tuple(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        elif kind == "multipart/form-data" and ctype is not None:
            form = _multipart(body, ctype)
        meaning = shown_headers(headers)
        fp = hashlib.sha256(b"\0".join([method.encode(), url.encode(),
                                        repr(sorted(headers.items())).encode(), body])).hexdigest()
        return HeldWrite(self.ctx.run_id, who.stage_id, who.attempt, self.ctx.profile,
                         method, url, host, path.split("?")[0], form, len(body), ctype, extra.get("tab_url"), fp,
                         why=verdict.reason, screenshot=extra.get("screenshot"), earlier=who.earlier,
                         port=extra.get("port"), rule=verdict.rule, headers=tuple((k, v) for k, v in meaning),
                         body_text=shown_body(body, ctype) if form is None else None,
                         password_fields=tuple(extra.get("password_fields") or ()),
                         approval_id=extra.get("approval_id"))

    def record_decision(self, decision: str, method: str, host: str, port: int | None, path: str,
             verdict: WriteVerdict | None, who: StageWrites, outcome: WriteOutcome | None = None,
             approval: str | None = None) -> None:
        """One decision-log line of a write (`write_<decision>`), labelled with `who`."""
        if self.record is None:
            return
        rec: dict[str, object] = {"run": self.ctx.run_id, "stage": who.stage_id,
                                  "attempt": who.attempt, "method": method, "host": host, "port": port,
                                  "path": path, "decision": f"write_{decision}",
                                  "reason": verdict.reason if verdict else "malformed_url",
                                  "rule": verdict.rule if verdict else None}
        if outcome is not None:
            rec["by"] = outcome.by
        if approval is not None:
            rec["approval"] = approval
        with swallowed(log, "the decision-log line of a write", (OSError,)):
            self.record(decision, rec)

    async def close(self) -> None:
        """Stage or run end: pending writes are denied (their tasks cancelled)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _multipart(body: bytes, ctype: str) -> tuple[tuple[str, str], ...] | None:
    """The fields of a multipart/form-data body: text values as they are, a file as
    `(file NAME, TYPE, N bytes)`. None when the body does not parse."""
    msg = BytesParser(policy=email_policy.HTTP).parsebytes(
        b"Content-Type: " + ctype.encode("latin-1", "replace") + b"\r\n\r\n" + body)
    if not msg.is_multipart():
        return None
    out: list[tuple[str, str]] = []
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        filename = part.get_filename()
        if filename is not None:
            out.append((name, f"(file {filename}, {part.get_content_type()}, {len(data)} bytes)"))
        else:
            out.append((name, data.decode(part.get_content_charset() or "utf-8", "replace")))
    return tuple(out)


def _body(req: dict) -> bytes:
    entries = req.get("postDataEntries")
    if isinstance(entries, list) and entries:
        return b"".join(base64.b64decode(e.get("bytes") or "") for e in entries if isinstance(e, dict))
    data = req.get("postData")
    return data.encode() if isinstance(data, str) else b""
