"""Catching a guarded browser's writes in the guard's own DevTools pipe.

The guard holds every browser's DevTools pipe (supervisor/gate/cdp_pipe.py); neither the page nor
the stage can speak on it. Where a stage of that browser has a host whose effective write mode is
`gate` or `deny`, browser-level `Fetch.enable` intercepts the requests to those hosts (patterns
limited to them, so reads elsewhere never pause). Each paused request is judged by the site
policy's write rules and the stage's mode (`policy.writes.effective`, the only place a mode is
decided):

  read                  continued at once;
  write, allow          continued at once (logged);
  write, deny           answered by the guard: 403 with a short text/html body; the site never
                        sees it;
  write, gate           not answered until the approver decides: approved -> continued with
                        nothing changed (original bytes, exactly once), denied or timed out ->
                        the 403.

Browser-level interception sees what every renderer sends through the browser's network
service, so a renderer the page took over cannot skip it. Which stage a request belongs to is not
known at browser level for workers and service workers: the strictest mode of the stages that
use the browser applies (fail closed). Nothing here logs a body, a query value or a credential.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from email import policy as email_policy
from email.parser import BytesParser
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from sfguard.policy.errors import MalformedHost
from sfguard.policy.hosts import normalize_host_ex
from sfguard.policy.index import RuleSet, compile_patterns
from sfguard.policy.patterns import PatternError
from sfguard.policy.writes import WriteRules, WriteVerdict, effective, stricter
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, PipeClosed
from sfguard.supervisor.writes.held import HeldWrite, WriteApprover, WriteOutcome

log = logging.getLogger("sfguard.writes")

#: default seconds a held write waits for a person (a timeout is a denial)
DEFAULT_TIMEOUT = 600.0
#: how long capturing the tab of a held write may take, and how many tabs it looks through
CAPTURE_SECONDS = 5.0
MAX_CAPTURE_TABS = 16
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
    #: the stage's write mode per allowed host pattern (the strictest over the browser's stages)
    modes: dict[str, str] = field(default_factory=dict)
    #: writes released in earlier attempts of a replay-unsafe stage: every write is held
    earlier: tuple[dict[str, object], ...] = ()
    #: `replay_safe: false`: every write is watched (allowed ones recorded for a retry)
    replay_unsafe: bool = False


@dataclass
class StageWrites:
    """One stage's part of a shared browser's write gate: its modes, its attempt, what its
    earlier attempts sent. A request from a tab of that stage is judged by these alone."""
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
#: styles are most of its requests), except on the paths of GETs the site policy names writes. A
#: renderer that lies about a request's type to send another method as one of these meets the
#: extension's GET_ONLY_RULE (websockets.py) instead.
GET_ONLY_TYPES = ("Image", "Script", "Stylesheet", "Font", "Media")
#: the other types a Fetch pattern takes: paused. Measured on Chromium 156: a pattern takes 12 of
#: the protocol's 19 resource types (TextTrack, Prefetch, WebSocket, Manifest, SignedExchange,
#: Preflight and FedCM are refused: no request is matched as one of them), so these with
#: GET_ONLY_TYPES cover every request; tests/browser_host/test_write_gates.py checks that against
#: the browser itself, so a type a later Chromium adds fails there, not silently.
WRITE_TYPES = ("Document", "XHR", "Fetch", "EventSource", "Ping", "CSPViolationReport", "Other")


def url_patterns(host_pattern: str, path: str = "/*",
                 schemes: tuple[str, ...] = ("http", "https", "ws", "wss")) -> list[dict[str, str]]:
    """Fetch urlPatterns covering a host pattern (`example.com`, `*.example.com`, `h:8080`, or
    `*` for every host) and a path glob (Fetch's `*` matches anything, `/` and `?` too)."""
    if host_pattern == "*":
        return [{"urlPattern": f"{scheme}://*{path}"} for scheme in schemes]
    host, _, port = host_pattern.rpartition(":") if host_pattern.count(":") == 1 else (host_pattern, "", "")
    hosts = [host]
    if host.startswith("*."):
        hosts = [host[2:], host]
    out = []
    for h in hosts:
        for scheme in schemes:
            out.append({"urlPattern": f"{scheme}://{h}:{port}{path}" if port else f"{scheme}://{h}{path}"})
            if not port:
                out.append({"urlPattern": f"{scheme}://{h}:*{path}"})
    return out


def typed(patterns: list[dict[str, str]], types: tuple[str, ...] = WRITE_TYPES) -> list[dict[str, str]]:
    """Each pattern once per resource type (a Fetch pattern names one type, or every type)."""
    return [{**p, "resourceType": t} for p in patterns for t in types]


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
        #: each stage's own modes (a shared browser); `owner` tells whose tab sent a request
        #: (frame id -> stage id). A request no stage owns (a worker, a frame of no known tab)
        #: is judged by the strictest modes of them all (`ctx`): fail closed.
        self.stages: dict[str, StageWrites] = {}
        self.owner: Callable[[Any], str | None] | None = None
        self.set_modes(ctx.modes)

    @property
    def rules(self) -> WriteRules:
        return self._rules() if callable(self._rules) else self._rules

    def set_modes(self, modes: dict[str, str]) -> None:
        self.ctx.modes = dict(modes)
        self._merged = StageWrites(None, None, dict(modes))

    def who(self, frame_id: object) -> StageWrites:
        """The stage whose tab sent the request, or everyone's strictest (`ctx`)."""
        stage_id = self.owner(frame_id) if self.owner is not None else None
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
        """Fetch patterns: the hosts whose mode is gate or deny, by the stage or by a floor of
        the site policy (every host for a retry of a replay-unsafe stage that wrote before, or
        for a floor over an address range, which a URL pattern cannot name); on those, requests
        of every type that can carry a write (WRITE_TYPES), and of every type on the paths of
        GETs the site policy names writes (an `<img src=/logout>` is one)."""
        hosts: list[str] = []
        if self.ctx.earlier or self.ctx.replay_unsafe:
            hosts = ["*"]
        else:
            hosts = [p for p, mode in self.ctx.modes.items() if mode != "allow"]
            for entry in self.rules.guarded():
                hosts += ["*"] if entry.covers_all() else list(entry.patterns)
        if not hosts:
            return []
        if "*" in hosts:
            hosts = ["*"]
        out: list[dict[str, str]] = []
        for h in dict.fromkeys(hosts):
            out += typed(url_patterns(h))
        for entry in self.rules.entries:
            for rp in entry.writes:
                glob = rp.path.replace("**", "*") + "*"
                for h in (["*"] if entry.covers_all() or "*" in hosts else entry.patterns):
                    out += url_patterns(h, glob, ("http", "https"))
        return list({(p["urlPattern"], p.get("resourceType")): p for p in out}.values())

    def stage_mode(self, host: str, is_ip: bool, port: int | None) -> str:
        return self._merged.mode(host, is_ip, port)

    # -- one paused request ------------------------------------------------------------------
    def paused(self, params: dict) -> None:
        """Called by the pipe (synchronously, in its reader) for each Fetch.requestPaused."""
        rid = params.get("requestId")
        req = params.get("request") or {}
        method = str(req.get("method") or "GET").upper()
        url = str(req.get("url") or "")
        try:
            parts = urlsplit(url)
            host, is_ip = normalize_host_ex(parts.hostname or "")
            port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
        except (MalformedHost, ValueError):
            self._refuse(rid, "malformed_url", method, "?", "", None, self.who(None))
            return
        websocket = parts.scheme in ("ws", "wss")
        preflight = method == "OPTIONS" and "access-control-request-method" in {
            k.lower() for k in (req.get("headers") or {})}
        site = self.rules.judge(host, method, parts.path or "/", websocket=websocket,
                                preflight=preflight, port=port)
        who = self.who(params.get("frameId"))
        verdict = effective(who.mode(host, is_ip, port), site)
        if not verdict.write:
            self.pipe._fire("Fetch.continueRequest", {"requestId": rid})
            return
        if who.earlier:
            verdict = WriteVerdict(True, "gate", "replay_unsafe_retry",
                                   explanation="an earlier attempt of this replay-unsafe stage wrote")
        path = parts.path or "/"
        if verdict.mode == "allow":
            self.pipe._fire("Fetch.continueRequest", {"requestId": rid})
            self._released(who, method, url)
            self._log("allowed", method, host, path, verdict, who)
        elif verdict.mode == "deny":
            self._refuse(rid, verdict.reason, method, host, path, verdict, who)
        else:
            task = asyncio.get_running_loop().create_task(
                self._hold(rid, params, method, url, host, path, verdict, who))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _released(self, who: StageWrites, method: str, url: str) -> None:
        import time  # noqa: PLC0415
        who.released.append({"method": method, "url": url, "at": time.time()})

    def _refuse(self, rid: Any, why: str, method: str, host: str, path: str,
                verdict: WriteVerdict | None, who: StageWrites, decision: str = "refused") -> None:
        body = REFUSED_BODY.format(why=why).encode()
        self.pipe._fire("Fetch.fulfillRequest", {
            "requestId": rid, "responseCode": 403,
            "responseHeaders": [{"name": "Content-Type", "value": "text/html; charset=utf-8"},
                                {"name": "X-Sfguard-Decision", "value": f"deny; reason={why}"},
                                {"name": "Cache-Control", "value": "no-store"}],
            "body": base64.b64encode(body).decode()})
        self._log(decision, method, host, path, verdict, who)

    async def _hold(self, rid: Any, params: dict, method: str, url: str, host: str, path: str,
                    verdict: WriteVerdict, who: StageWrites) -> None:
        shot, tab_url = await self.capture(params.get("frameId"))
        held = dataclasses.replace(self.held_write(params, method, url, host, path, verdict, who),
                                   screenshot=shot, tab_url=tab_url)
        self._log("held", method, host, path, verdict, who)
        try:
            outcome = await asyncio.wait_for(self.approver.decide(held, self.timeout), self.timeout + 5)
        except TimeoutError:
            outcome = WriteOutcome(False, "timeout", "no decision in time")
        except asyncio.CancelledError:
            outcome = WriteOutcome(False, "guard", "the stage ended")
            with swallowed(log, "refusing a held write of an ended stage"):
                self._refuse(rid, "write_denied", method, host, path, verdict, who, "denied")
            raise
        except Exception:  # fail closed: an approver that breaks denies
            log.exception("the write approver failed; the write is denied")
            outcome = WriteOutcome(False, "guard", "approver failed")
        with swallowed(log, "releasing or refusing a held write"):
            if outcome.approved:
                self.pipe._fire("Fetch.continueRequest", {"requestId": rid})
                self._released(who, method, url)
                self._log("approved", method, host, path, verdict, who, outcome)
            else:
                why = "write_timeout" if outcome.by == "timeout" else "write_denied"
                self._refuse(rid, why, method, host, path, verdict, who,
                             "timeout" if outcome.by == "timeout" else "denied")

    async def capture(self, frame_id: object) -> tuple[bytes | None, str | None]:
        """The tab a held write came from, as the person will judge it: a PNG and its address.
        The tab is the page target whose main frame sent the write (form, fetch, popup), else
        the page holding that frame (an iframe), else the only page. Bounded: a tab that cannot
        be captured in CAPTURE_SECONDS gives (None, address or None); the write still waits."""
        cdp = None
        try:
            async with asyncio.timeout(CAPTURE_SECONDS):
                cdp = await self.pipe.session("write gate capture")
                pages = [t for t in (await cdp.call("Target.getTargets")).get("targetInfos", [])
                         if t.get("type") == "page"]
                order = sorted(pages, key=lambda t: t.get("targetId") != frame_id)
                for info in order[:MAX_CAPTURE_TABS]:
                    sid = (await cdp.call("Target.attachToTarget",
                                          {"targetId": info["targetId"], "flatten": True}))["sessionId"]
                    try:
                        if info.get("targetId") != frame_id and len(pages) > 1:
                            tree = await cdp.call("Page.getFrameTree", session=sid)
                            if not _has_frame(tree.get("frameTree") or {}, frame_id):
                                continue
                        shot = await cdp.call("Page.captureScreenshot", {"format": "png"}, session=sid)
                        return base64.b64decode(shot.get("data") or ""), str(info.get("url") or "") or None
                    finally:
                        with contextlib.suppress(PipeClosed, CdpCallError, TimeoutError):
                            await cdp.call("Target.detachFromTarget", {"sessionId": sid}, timeout=2)
        except Exception as exc:  # noqa: BLE001 - a held write never fails for want of a picture
            log.info("no screenshot of the tab of a held write: %s", type(exc).__name__)
        finally:
            if cdp is not None:
                with contextlib.suppress(PipeClosed, OSError):
                    await cdp.close()
        return None, None

    def held_write(self, params: dict, method: str, url: str, host: str, path: str,
                   verdict: WriteVerdict, who: StageWrites | None = None) -> HeldWrite:
        who = who or self.who(None)
        req = params.get("request") or {}
        body = _body(req)
        headers = {str(k).lower(): str(v) for k, v in (req.get("headers") or {}).items()}
        ctype = headers.get("content-type")
        form = None
        kind = ctype.split(";")[0].strip().lower() if ctype else ""
        if kind == "application/x-www-form-urlencoded":
            form = tuple(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        elif kind == "multipart/form-data" and ctype is not None:
            form = _multipart(body, ctype)
        fp = hashlib.sha256(method.encode() + b"\0" + url.encode() + b"\0" + body).hexdigest()
        return HeldWrite(self.ctx.run_id, who.stage_id, who.attempt, self.ctx.profile,
                         method, url, host, path, form, len(body), ctype, None, fp,
                         why=verdict.reason if verdict.reason == "replay_unsafe_retry" else "gate",
                         earlier=who.earlier)

    def _log(self, decision: str, method: str, host: str, path: str,
             verdict: WriteVerdict | None, who: StageWrites, outcome: WriteOutcome | None = None) -> None:
        if self.record is None:
            return
        rec: dict[str, object] = {"run": self.ctx.run_id, "stage": who.stage_id,
                                  "attempt": who.attempt, "method": method, "host": host,
                                  "path": path, "decision": f"write_{decision}",
                                  "reason": verdict.reason if verdict else "malformed_url"}
        if outcome is not None:
            rec["by"] = outcome.by
        with swallowed(log, "the decision-log line of a write", (OSError,)):
            self.record(decision, rec)

    async def close(self) -> None:
        """Stage or run end: pending writes are denied (their tasks cancelled)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _multipart(body: bytes, ctype: str) -> tuple[tuple[str, str], ...] | None:
    """The fields of a multipart/form-data body: text values as they are, a file as
    `(file NAME, N bytes)`. None when the body does not parse."""
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
            out.append((name, f"(file {filename}, {len(data)} bytes)"))
        else:
            out.append((name, data.decode(part.get_content_charset() or "utf-8", "replace")))
    return tuple(out)


def _has_frame(tree: dict, frame_id: object) -> bool:
    if (tree.get("frame") or {}).get("id") == frame_id:
        return True
    return any(_has_frame(child, frame_id) for child in tree.get("childFrames") or [])


def _body(req: dict) -> bytes:
    entries = req.get("postDataEntries")
    if isinstance(entries, list) and entries:
        return b"".join(base64.b64decode(e.get("bytes") or "") for e in entries if isinstance(e, dict))
    data = req.get("postData")
    return data.encode() if isinstance(data, str) else b""
