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
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from sfguard.policy import join_host_port
from sfguard.supervisor.gate import cdp_policy as policy
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, PipeClient, PipeClosed

log = logging.getLogger("sfguard.cdp_gate")

RefusalCallback = Callable[[str, str, str], None]
CONNECT_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 5.0
CLIENT_MAX_MSG = 64 * 1024 * 1024
_REPLY_ID_RE = re.compile(rb'^\{"id":(\d+)[,}]')
_EVENT_RE = re.compile(rb'^\{"method":"([A-Za-z0-9.]+)"')
_TARGET_EVENTS = frozenset({
    "Target.targetCreated", "Target.targetInfoChanged", "Target.targetDestroyed",
    "Target.targetCrashed", "Target.attachedToTarget", "Target.detachedFromTarget",
    "Target.receivedMessageFromTarget",
})
_conn_numbers = itertools.count(1)
_INSPECTED_REPLIES = frozenset({"Target.createTarget", "Target.getTargets",
                                "Target.getTargetInfo", "Target.attachToTarget"})


class GateError(Exception):
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
    relays: set[_Relay] = field(default_factory=set)
    methods: collections.Counter = field(default_factory=collections.Counter)

    @property
    def fp(self) -> str:
        return fingerprint(self.token)


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
        self._record = record_methods
        self._stages: dict[str, _Stage] = {}
        self._runner: web.AppRunner | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/devtools/browser/{token}", self._handle_ws)
        app.router.add_get("/devtools/browser/{token}/json/version", self._handle_version)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        self._port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

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

    async def create_stage_tab(self, stage_key: str, url: str = "about:blank") -> str:
        """Pre-create a tab for the stage over the browser's pipe; it becomes the stage's."""
        stage = self._stage(stage_key)
        if not policy.url_allowed(url):
            raise GateError("only http(s) and about:blank URLs")
        (res,) = await self._raw_calls(stage.pipe, [("Target.createTarget", {"url": url, "newWindow": True})])
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
        relay = _Relay(self, stage, client, upstream)
        stage.relays.add(relay)
        try:
            await relay.run()
        finally:
            stage.relays.discard(relay)
            await relay.close()
        return client

    def _refused(self, stage: _Stage, method: str, reason: str) -> None:
        name = policy.safe_method_name(method)
        log.warning("stage %s (token %s): refused %s: %s", stage.key, stage.fp, name, reason)
        if self._on_refusal:
            try:
                self._on_refusal(stage.key, name, reason)
            except Exception:  # a broken callback must not open the gate
                log.exception("on_refusal callback failed")


class _Relay:
    """One stage client connection and its own logical connection on the browser's pipe."""

    def __init__(self, gate: CdpGate, stage: _Stage, client: web.WebSocketResponse,
                 upstream: PipeClient) -> None:
        self.gate, self.stage, self.client, self.upstream = gate, stage, client, upstream
        self.n = next(_conn_numbers)   # names the connection in debug lines
        self.ctx = policy.PolicyContext(own_targets=stage.targets, artifacts_dir=stage.artifacts_dir,
                                        tab_quota=stage.tab_quota)
        # (sessionId, id) -> method, for replies the gate must look at
        self.pending: dict[tuple[Any, Any], str] = {}   # (sessionId, id) as the stage sent them
        self.pending_ids: collections.Counter = collections.Counter()
        self.held: list[tuple[str, dict]] = []  # target events of unknown targets during createTarget
        # Stage tabs this connection opened, attached itself or whose opener it was told about.
        # Target events (discovery) announce only these and the guard's tabs of the stage: a
        # client such as agent-browser attaches to and sets up every page it is told about,
        # before its next command (`close` included), so another connection's tabs would cost
        # it a dozen round trips each (issue 37). Ownership stays per stage: attach, close and
        # getTargets cover every tab of the stage.
        self.mine: set[str] = set()
        self.creating = 0                  # this connection's createTarget calls in flight
        self.no_creates = asyncio.Event()
        self.no_creates.set()

    async def close(self) -> None:
        log.debug("stage %s conn %d: closed", self.stage.key, self.n)
        await asyncio.gather(self.client.close(), self.upstream.close(), return_exceptions=True)

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(self._client_to_upstream()),
                 asyncio.ensure_future(self._upstream_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.stage.creating -= self.creating   # unanswered (browser gone, or timed out)
            self.creating = 0

    # client -> Chrome
    async def _client_to_upstream(self) -> None:
        async for msg in self.client:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            try:
                data = json.loads(msg.data)
            except ValueError:
                data = None
            method = data.get("method") if isinstance(data, dict) else None
            if self.gate._record and isinstance(method, str):
                self.stage.methods[policy.safe_method_name(method)] += 1
            self.ctx.pending_creates = self.stage.creating   # the quota is the stage's
            reason = policy.check_command(data, self.ctx)
            if reason is None:
                key = (data.get("sessionId"), data["id"])
                if key in self.pending:
                    reason = "a command with this id is still in flight"
            if reason is not None:
                self.gate._refused(self.stage, method or "", reason)
                if isinstance(data, dict) and "id" in data:
                    await self._out(json.dumps(policy.refusal_message(
                        data.get("id"), method or "<malformed>", reason, data.get("sessionId"))))
                continue
            if method in _INSPECTED_REPLIES:
                self.pending[key] = method
                self.pending_ids[data["id"]] += 1
                if method == "Target.createTarget":
                    self.creating += 1
                    self.stage.creating += 1
                    self.no_creates.clear()
            if method == "Target.createTarget" and data.get("sessionId") is None:
                # Each stage tab in its own window: a tab behind another one in a headless
                # window is hidden and not painted, and commands that need a frame hang
                # (docs/cdp-gate.md, "Background tabs").
                data.setdefault("params", {})["newWindow"] = True
            if log.isEnabledFor(logging.DEBUG):  # method names and ids only (docs/cdp-gate.md)
                log.debug("stage %s conn %d: -> %s id=%d%s", self.stage.key, self.n, method,
                          data["id"], " (session)" if data.get("sessionId") else "")
            # Re-serialised: Chrome sees exactly what the policy saw (no duplicate-key tricks).
            await self.upstream.send(data)
        # The client is gone. Tabs it asked for are still being made: wait (bounded) for the
        # answers, so that they become the stage's (quota, closed at stage end) instead of
        # being left behind by whoever closes the connection right after createTarget.
        if self.creating:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.no_creates.wait(), CONNECT_TIMEOUT_S)
        await self.upstream.close()

    # Chrome -> client
    async def _upstream_to_client(self) -> None:
        while (text := await self.upstream.recv()) is not None:
            head = text[:80].encode()
            m = _REPLY_ID_RE.match(head)
            if log.isEnabledFor(logging.DEBUG):
                ev = None if m else _EVENT_RE.match(head)
                log.debug("stage %s conn %d: <- %s", self.stage.key, self.n,
                          f"reply id={m.group(1).decode()}" if m else
                          ev.group(1).decode() if ev else "other message")
            if m:  # a reply: look inside only if the gate is waiting for it
                if int(m.group(1)) in self.pending_ids:
                    await self._reply(json.loads(text))
                else:
                    await self._out(text)
                continue
            m = _EVENT_RE.match(head)
            name = m.group(1).decode() if m else None
            if name is not None and name not in _TARGET_EVENTS \
                    and name not in policy.NETWORK_EVENTS_TO_REDACT:
                await self._out(text)
                continue
            try:
                data = json.loads(text)
            except ValueError:
                continue  # not CDP: drop
            if "id" in data:
                if (data.get("sessionId"), data.get("id")) in self.pending:
                    await self._reply(data)
                else:
                    await self._out(json.dumps(data))
            else:
                await self._event(data)
        await self.client.close()

    async def _send(self, data: dict) -> None:
        await self._out(json.dumps(data))

    async def _out(self, text: str) -> None:
        """To the client; nothing once it is gone (the relay may still be finishing its
        bookkeeping, see the end of `_client_to_upstream`)."""
        if self.client.closed:
            return
        try:
            await self.client.send_str(text)
        except ConnectionError:
            pass

    async def _reply(self, data: dict) -> None:
        key = (data.get("sessionId"), data.get("id"))
        method = self.pending.pop(key, None)
        if method is None:
            await self._send(data)
            return
        self.pending_ids[key[1]] -= 1
        if self.pending_ids[key[1]] <= 0:
            del self.pending_ids[key[1]]
        result = data.get("result")
        if method == "Target.createTarget":
            self.creating -= 1
            self.stage.creating -= 1
            if self.creating == 0:
                self.no_creates.set()
            tid = result.get("targetId") if isinstance(result, dict) else None
            if isinstance(tid, str) and tid:
                self.stage.targets.add(tid)
                self.mine.add(tid)
            await self._release_held()
        elif method == "Target.getTargets" and isinstance(result, dict):
            result["targetInfos"] = policy.filter_target_infos(
                result.get("targetInfos", []), self.stage.targets, self.ctx.own_sessions)
        elif method == "Target.getTargetInfo" and isinstance(result, dict):
            info = result.get("targetInfo", {})
            if info.get("type") != "browser" and not policy.target_visible(
                    info, self.stage.targets, self.ctx.own_sessions):
                data = policy.refusal_message(key[1], method, "not a target of this stage", key[0])
        elif method == "Target.attachToTarget" and isinstance(result, dict):
            sid = result.get("sessionId")
            # the attachedToTarget event normally came first; make sure the session is known
            if isinstance(sid, str):
                self.ctx.own_sessions.setdefault(sid, "")
        await self._send(data)

    async def _release_held(self) -> None:
        """After a createTarget reply: pass held events that turned out to be ours, drop the rest."""
        if self.creating > 0:
            return
        held, self.held = self.held, []
        for name, data in held:
            if self._event_visible(name, data):
                await self._send(data)

    def _announced(self, tid: Any) -> bool:
        """Whether target events about `tid` go to this connection: a stage tab the guard gave
        the stage or this connection's own (see `mine`), or a child it attached."""
        if tid in self.ctx.own_sessions.values():
            return True
        return tid in self.stage.targets and (tid in self.stage.assigned or tid in self.mine)

    def _event_visible(self, name: str, data: dict) -> bool:
        params = data.get("params") or {}
        targets = self.stage.targets
        if name in ("Target.targetCreated", "Target.targetInfoChanged"):
            info = params.get("targetInfo") or {}
            tid = info.get("targetId")
            if isinstance(tid, str) and tid and policy.is_own_popup(info, targets):
                targets.add(tid)                      # the stage's, whoever is told
                if self._announced(info.get("openerId")):
                    self.mine.add(tid)
            return self._announced(tid)
        if name in ("Target.targetDestroyed", "Target.targetCrashed"):
            tid = params.get("targetId")
            visible = self._announced(tid)
            if name == "Target.targetDestroyed":
                targets.discard(tid)
                self.stage.assigned.discard(tid)
                self.mine.discard(tid)
            return visible
        return False

    async def _event(self, data: dict) -> None:
        name = data.get("method")
        params = data.get("params") or {}
        parent = data.get("sessionId")
        if parent is not None and parent not in self.ctx.own_sessions:
            return  # Chrome only sends events of this connection's sessions; fail closed anyway
        if name in policy.NETWORK_EVENTS_TO_REDACT:
            data["params"] = policy.redact_network(params)
            await self._send(data)
            return
        if name == "Target.attachedToTarget":
            info = params.get("targetInfo") or {}
            sid, tid = params.get("sessionId"), info.get("targetId")
            if not (isinstance(sid, str) and isinstance(tid, str)):
                return
            if parent is not None or tid in self.stage.targets:
                # child of an own session (auto-attach) or an own tab attached by this connection
                self.ctx.own_sessions[sid] = tid
                if parent is None:
                    self.mine.add(tid)        # a tab it chose to use: tell it what happens to it
                await self._send(data)
            return
        if name == "Target.detachedFromTarget":
            if self.ctx.own_sessions.pop(str(params.get("sessionId")), None) is not None:
                await self._send(data)
            return
        if name == "Target.receivedMessageFromTarget":
            return  # non-flat sessions are refused
        if name in _TARGET_EVENTS:
            if self._event_visible(name, data):
                await self._send(data)
            elif self.creating > 0 and name in ("Target.targetCreated", "Target.targetInfoChanged"):
                self.held.append((name, data))
            return
        await self._send(data)
