"""CDP gate: a per-stage, token-guarded WebSocket relay in front of an anchor browser's CDP.

The anchor has no DevTools address at all: the guard holds its DevTools pipe
(`sfguard.supervisor.gate.cdp_pipe.CdpPipe`). The guard calls `gate.add_stage(stage_key, pipe, ...)` and
hands the stage the returned URL,
`ws://127.0.0.1:PORT/devtools/browser/<token>`, as `AGENT_BROWSER_CDP` (agent-browser 0.41.2
connects to a ws:// URL as given; an http:// URL would make it fetch /json/version at the root
and lose the token, so only the ws:// form is served). Per connection the gate:

  * refuses an unknown, revoked or malformed token with HTTP 403 before the upgrade, comparing in
    constant time, and refuses any request with an Origin header (web pages);
  * opens its own logical connection on the browser's pipe (its own ids, its own sessions,
    detached when the stage's WebSocket closes);
  * checks every command with `sfguard.supervisor.gate.cdp_policy.check_command` and answers a refused one
    itself with a CDP error; the command never reaches Chrome;
  * filters what Chrome sends back: target lists and target events show only the stage's own
    tabs and children, and network events lose Cookie/Set-Cookie headers and cookie lists.

Tab ownership is per stage: tabs given to `add_stage`, tabs created through the stage's token
(`Target.createTarget` replies) and popups of own pages. Target events are per connection: each
is told about the stage's tabs the guard gave it and the tabs it opened or attached itself, not
about tabs another connection of the stage opened (issue 37). `revoke()` ends the token and closes its
connections. Refusals go to `on_refusal(stage_key, method, reason)` and the `sfguard.cdp_gate`
logger (method names and a token fingerprint only; never params, tokens or the raw address).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from sfguard.errors import SfguardError
from sfguard.policy import join_host_port
from sfguard.supervisor.gate import cdp_policy as policy
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, PipeClosed
from sfguard.supervisor.gate.relay import CONNECT_TIMEOUT_S, Relay

log = logging.getLogger("sfguard.cdp_gate")

RefusalCallback = Callable[[str, str, str], None]
#: (stage key, the command as sent, its tab's target id, the browser's pipe, what the gate did:
#: None forwarded, else the refusal's reason or `write_held`); the run record (supervisor/record)
Observer = Callable[[str, dict, str | None, CdpPipe, str | None], None]
CLOSE_WAIT_S = 5.0
CLIENT_MAX_MSG = 64 * 1024 * 1024


class GateError(SfguardError):
    """Errors of the gate API (never contain the raw address or a token)."""


def fingerprint(token: str) -> str:
    """Short, non-reversible id of a token for logs."""
    return hashlib.sha256(token.encode()).hexdigest()[:8]


@dataclass(eq=False)
class _Stage:
    key: str
    token: str
    pipe: CdpPipe
    artifacts_dir: Path | None
    tab_quota: int
    targets: set[str] = field(default_factory=set)
    # the tabs the guard gave the stage (add_stage, create_stage_tab): announced to every
    # connection of the stage; a tab one connection opened is announced to that one only
    assigned: set[str] = field(default_factory=set)
    creating: int = 0   # Target.createTarget calls in flight on all its connections (the quota)
    # tabs that ended lately -> whether the guard had given them (relay.py: every connection
    # decides alike whether it is told, whichever saw the end first)
    destroyed: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    relays: set[Relay] = field(default_factory=set)
    methods: collections.Counter = field(default_factory=collections.Counter)

    @property
    def fp(self) -> str:
        return fingerprint(self.token)

    def forget(self, tid: str) -> None:
        """A tab of the browser ended: no longer the stage's. Keeps whether the guard had given
        it, so that every connection of the stage decides alike whether it is told."""
        if tid not in self.targets:
            return
        if tid not in self.destroyed:
            self.destroyed[tid] = tid in self.assigned
            while len(self.destroyed) > 256:
                self.destroyed.popitem(last=False)
        self.targets.discard(tid)
        self.assigned.discard(tid)


class CdpGate:
    """The gate server. One per guard daemon; serves every stage of every anchor.

    gate = CdpGate(on_refusal=cb); await gate.start()
    url = gate.add_stage("run1/stage2", anchor.pipe, own_target_ids={tab}, artifacts_dir=p, tab_quota=8)
    ... stage runs with AGENT_BROWSER_CDP=url ...
    await gate.close_stage_tabs("run1/stage2"); await gate.revoke("run1/stage2"); await gate.stop()
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 on_refusal: RefusalCallback | None = None, record_methods: bool = False) -> None:
        if host not in ("127.0.0.1", "::1"):
            raise GateError("the CDP gate listens on loopback only")
        self._host, self._port = host, port
        self._on_refusal = on_refusal
        self.record_methods = record_methods
        #: sees every command a stage sends, forwarded or refused (`Observer`)
        self.observer: Observer | None = None
        self._stages: dict[str, _Stage] = {}
        self._watched: set[int] = set()   # id() of the pipes whose ended tabs the gate hears of
        self._runner: web.AppRunner | None = None
        #: the page-load pace of HTTPS sites (supervisor/daemon/pacing.py PageLoads): asked before
        #: a stage's navigation commands and its commands to a tab over the pace (relay.py)
        self.pace: Any = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/devtools/browser/{token}", self._handle_ws)
        app.router.add_get("/devtools/browser/{token}/json/version", self._handle_version)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        self._port = int(self._runner.addresses[0][1])   # the port bound (0: the system's choice)

    async def stop(self) -> None:
        for key in list(self._stages):
            await self.revoke(key)
        if self._runner:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> CdpGate:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        return self._port

    # -- stages ---------------------------------------------------------------------------
    def add_stage(self, stage_key: str, pipe: CdpPipe, own_target_ids: set[str] | None = None,
                  artifacts_dir: Path | None = None, tab_quota: int = policy.DEFAULT_TAB_QUOTA) -> str:
        """Register a stage attempt; returns its gate URL (the stage's AGENT_BROWSER_CDP)."""
        if not stage_key or stage_key in self._stages:
            raise GateError(f"stage {stage_key!r} is empty or already registered")
        if self._runner is None:
            raise GateError("gate is not started")
        if not isinstance(tab_quota, int) or tab_quota < 1:
            raise GateError("tab_quota must be a positive integer")
        if not isinstance(pipe, CdpPipe) or pipe.closed.is_set():
            raise GateError("the stage's browser is not running")
        token = secrets.token_urlsafe(32)
        stage = _Stage(stage_key, token, pipe, Path(artifacts_dir) if artifacts_dir else None,
                       tab_quota, set(own_target_ids or ()), set(own_target_ids or ()))
        self._stages[stage_key] = stage
        if id(pipe) not in self._watched:
            self._watched.add(id(pipe))
            pipe.watch_tabs(functools.partial(self._tab_event, pipe))
        log.info("stage %s added (token %s, quota %d)", stage_key, stage.fp, tab_quota)
        return f"ws://{join_host_port(self._host, self._port)}/devtools/browser/{token}"

    def rekey(self, old_key: str, new_key: str, tab_quota: int | None = None) -> None:
        """Give a registration (token, tabs, open connections) to another key: a session the
        guard started ahead under a placeholder key becomes one stage's. The token does not
        change; `old_key` is unknown afterwards. `tab_quota` replaces the quota when given."""
        if not new_key or new_key in self._stages:
            raise GateError(f"stage {new_key!r} is empty or already registered")
        if tab_quota is not None and (not isinstance(tab_quota, int) or tab_quota < 1):
            raise GateError("tab_quota must be a positive integer")
        stage = self._stage(old_key)
        del self._stages[old_key]
        stage.key = new_key
        if tab_quota is not None:
            stage.tab_quota = tab_quota
            for relay in stage.relays:
                relay.ctx.tab_quota = tab_quota
        self._stages[new_key] = stage
        log.info("stage %s takes over %s (token %s)", new_key, old_key, stage.fp)

    def stage_targets(self, stage_key: str) -> set[str]:
        """The stage's tabs (target ids) right now."""
        return set(self._stage(stage_key).targets)

    def methods_seen(self, stage_key: str) -> collections.Counter:
        """Methods the stage sent (forwarded and refused); only with record_methods=True."""
        return collections.Counter(self._stage(stage_key).methods)

    async def close_stage_tabs(self, stage_key: str) -> list[str]:
        """Close every tab of the stage over the browser's pipe; returns the ids closed."""
        stage = self._stage(stage_key)
        closed = []
        targets = sorted(stage.targets)
        if targets:
            results = await self._raw_calls(stage.pipe,
                                            [("Target.closeTarget", {"targetId": t}) for t in targets])
            for tid, res in zip(targets, results, strict=True):
                stage.targets.discard(tid)
                stage.assigned.discard(tid)
                if "error" not in res:
                    closed.append(tid)
            # closeTarget answers before the tab is gone; wait (bounded) until it is
            deadline = asyncio.get_running_loop().time() + CLOSE_WAIT_S
            while closed and asyncio.get_running_loop().time() < deadline:
                (res,) = await self._raw_calls(stage.pipe, [("Target.getTargets", {})])
                live = {i.get("targetId") for i in (res.get("result") or {}).get("targetInfos", [])}
                if not live & set(closed):
                    break
                await asyncio.sleep(0.05)
        return closed

    async def create_stage_tab(self, stage_key: str, url: str = "about:blank", *,
                               visible: bool = False) -> str:
        """Pre-create a tab for the stage over the browser's pipe; it becomes the stage's. Each
        in a window of its own (a background tab is throttled); `visible` (a headed browser): a
        tab of the browser's window titled with profile and site, where the person at the
        screen looks (the guard brings it to the front when the stage gets it)."""
        stage = self._stage(stage_key)
        if not policy.url_allowed(url):
            raise GateError("only http(s) and about:blank URLs")
        (res,) = await self._raw_calls(stage.pipe, [("Target.createTarget",
                                                     {"url": url, "newWindow": not visible})])
        tid = res.get("result", {}).get("targetId")
        if not tid:
            raise GateError("the browser did not create the tab")
        stage.targets.add(tid)
        stage.assigned.add(tid)
        return tid

    async def revoke(self, stage_key: str, close_tabs: bool = False) -> None:
        """End the stage's token: new connections get 403, open ones are closed."""
        stage = self._stages.get(stage_key)
        if stage is None:
            return
        if close_tabs:
            try:
                await self.close_stage_tabs(stage_key)
            except GateError as exc:
                log.warning("stage %s: closing tabs failed: %s", stage_key, exc)
        del self._stages[stage_key]
        for relay in list(stage.relays):
            await relay.close()
        log.info("stage %s revoked (token %s)", stage_key, stage.fp)

    def stage_of_target(self, pipe: CdpPipe, target_id: object) -> str | None:
        """The key of the stage whose tab `target_id` of this browser is (the guard gave it, the
        stage opened it, or it is one of their popups); None when no stage's."""
        for key, st in self._stages.items():
            if st.pipe is pipe and target_id in st.targets:
                return key
        return None

    def _tab_event(self, pipe: CdpPipe, kind: str, target_id: str) -> None:
        for st in self._stages.values():
            if st.pipe is not pipe:
                continue
            if kind == "gone":
                st.forget(target_id)
            elif kind == "held":
                for relay in st.relays:
                    relay.navigation_held(target_id)

    def _stage(self, stage_key: str) -> _Stage:
        try:
            return self._stages[stage_key]
        except KeyError:
            raise GateError(f"unknown stage {stage_key!r}") from None

    def _find(self, token: str) -> _Stage | None:
        """Constant-time token lookup: compares against every live token, no early exit."""
        found = None
        given = token.encode()
        for stage in self._stages.values():
            if hmac.compare_digest(given, stage.token.encode()):
                found = stage
        return found

    async def _raw_calls(self, pipe: CdpPipe, calls: list[tuple[str, dict]]) -> list[dict]:
        """The guard's own commands on the browser's pipe; each answer or {"error": ...}."""
        out: list[dict] = []
        for method, params in calls:
            try:
                out.append({"result": await pipe.call(method, params, timeout=CONNECT_TIMEOUT_S)})
            except CdpCallError as exc:
                out.append({"error": {"message": str(exc)}})
            except (PipeClosed, TimeoutError) as exc:
                raise GateError(f"browser unavailable ({type(exc).__name__})") from None
        return out

    # -- HTTP/WebSocket handlers ----------------------------------------------------------
    def _admit(self, request: web.Request) -> _Stage:
        if request.headers.get("Origin") is not None:
            raise web.HTTPForbidden(text="sfguard: refused: browser origins may not connect\n")
        stage = self._find(request.match_info["token"])
        if stage is None:
            log.warning("refused connection: unknown or ended token")
            raise web.HTTPForbidden(text="sfguard: refused: unknown or ended token\n")
        return stage

    async def _handle_version(self, request: web.Request) -> web.Response:
        stage = self._admit(request)
        url = f"ws://{join_host_port(self._host, self._port)}/devtools/browser/{stage.token}"
        return web.json_response({"Browser": "sfguard-cdp-gate", "Protocol-Version": "1.3",
                                  "webSocketDebuggerUrl": url})

    async def _handle_ws(self, request: web.Request) -> web.StreamResponse:
        stage = self._admit(request)
        try:
            upstream = stage.pipe.client(f"stage {stage.key}")
        except PipeClosed:
            log.warning("stage %s: browser unavailable (pipe closed)", stage.key)
            raise web.HTTPBadGateway(text="sfguard: browser unavailable\n") from None
        client = web.WebSocketResponse(max_msg_size=CLIENT_MAX_MSG, compress=False, autoping=True)
        try:
            await client.prepare(request)
        except (ConnectionError, asyncio.CancelledError):
            await upstream.close()  # the client went away during the upgrade
            raise
        relay = Relay(self, stage, client, upstream)
        stage.relays.add(relay)
        try:
            await relay.run()
        finally:
            stage.relays.discard(relay)
            await relay.close()
        return client

    def refused(self, stage: _Stage, method: str, reason: str) -> None:
        """A command of `stage` the gate refused: logged, and told to the refusal callback."""
        name = policy.safe_method_name(method)
        log.warning("stage %s (token %s): refused %s: %s", stage.key, stage.fp, name, reason)
        if self._on_refusal:
            try:
                self._on_refusal(stage.key, name, reason)
            except OSError:  # its decision-log line; the command stays refused all the same
                log.exception("on_refusal callback failed")
