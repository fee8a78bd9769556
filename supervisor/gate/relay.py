"""One stage connection through the CDP gate (supervisor/gate/cdp_gate.py): the relay between
the stage's WebSocket and the browser's pipe. Each call is checked against the stage's method
policy (supervisor/gate/cdp_policy.py) before it reaches the browser; replies and target events
go back only for what this stage, and for target events this connection, may see."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import re
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from sfguard.supervisor.gate import cdp_policy as policy
from sfguard.supervisor.gate.cdp_pipe import PipeClient

if TYPE_CHECKING:
    from sfguard.supervisor.gate.cdp_gate import CdpGate, _Stage

log = logging.getLogger("sfguard.cdp_gate")

CONNECT_TIMEOUT_S = 10.0
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
#: commands to a tab whose navigation the write gate holds that the browser answers itself
#: (the rest wait in Chromium until the navigation commits: the gate answers them at once)
WHILE_HELD = frozenset({"Page.captureScreenshot"})
#: navigation commands whose answer Chromium keeps until the navigation commits: when the write
#: gate holds that navigation, the gate answers them itself (`navigation_held`)
_NAVIGATIONS = frozenset({"Page.navigate", "Page.reload", "Page.navigateToHistoryEntry"})


class Relay:
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
        self.answered: set[tuple[Any, Any]] = set()   # navigations the gate answered (held writes)
        self._tasks: set[asyncio.Task] = set()
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
            for ended in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(ended, Exception):   # the connection ends (fail closed); say by what
                    log.info("stage %s conn %d: ended by %s", self.stage.key, self.n, type(ended).__name__)
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
            if self.gate.record_methods and isinstance(method, str):
                self.stage.methods[policy.safe_method_name(method)] += 1
            self.ctx.pending_creates = self.stage.creating   # the quota is the stage's
            reason = policy.check_command(data, self.ctx)
            if reason is None:
                key = (data.get("sessionId"), data["id"])
                if key in self.pending:
                    reason = "a command with this id is still in flight"
            if reason is not None:
                self.gate.refused(self.stage, method or "", reason)
                self._observe(data, reason)
                if isinstance(data, dict) and "id" in data:
                    await self._out(json.dumps(policy.refusal_message(
                        data.get("id"), method or "<malformed>", reason, data.get("sessionId"))))
                continue
            waiting = self._held(data)
            if waiting is None and self.gate.pace is not None:
                paced = await self._paced(data, method)
                self._observe(data, None if paced is None else "pace")
                waiting = paced
            else:
                self._observe(data, None if waiting is None else "write_held")
            if waiting is not None:   # at once, not after Chromium's hold ends (or 30 s of nothing)
                await self._out(json.dumps({"id": data["id"], **({"sessionId": data["sessionId"]}
                                                                  if data.get("sessionId") else {}),
                                            "error": {"code": -32000, "message": waiting}}))
                continue
            if method in _INSPECTED_REPLIES or (method in _NAVIGATIONS and data.get("sessionId")):
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

    def _observe(self, data: Any, outcome: str | None) -> None:
        """Tell the gate's observer (the run record) of a command: the tab it is for, and what
        the gate did with it (None: forwarded; else the refusal's reason, or `write_held`)."""
        observer = self.gate.observer
        if observer is None or not isinstance(data, dict):
            return
        sid = data.get("sessionId")
        target = self.ctx.own_sessions.get(sid) if isinstance(sid, str) else \
            (data.get("params") or {}).get("targetId") if isinstance(data.get("params"), dict) else None
        try:
            observer(self.stage.key, data, target if isinstance(target, str) else None, self.upstream.pipe, outcome)
        except RuntimeError:   # the run record's loop closed (the guard stops): the command goes on
            log.exception("the gate's observer failed")

    def _held(self, data: dict) -> str | None:
        """The write gate's answer for a command to a tab whose navigation it holds (or for
        closing that tab), else None. Chromium would keep such a command until the navigation
        commits, and the stage's client gives up on the tab after 30 s ("page_wedged"); the
        browser's own picture of the tab is still taken (`WHILE_HELD`)."""
        writes = self.upstream.pipe.writes
        if writes is None or not writes.held_tabs:
            return None
        sid = data.get("sessionId")
        if sid is not None:
            if data.get("method") in WHILE_HELD:
                return None
            target = self.ctx.own_sessions.get(sid)
        elif data.get("method") == "Target.closeTarget":
            target = (data.get("params") or {}).get("targetId")
        else:
            return None
        answer = writes.held_navigation(target)
        return answer if isinstance(answer, str) else None

    async def _paced(self, data: dict, method: Any) -> str | None:
        """The page-load pace (supervisor/daemon/pacing.py PageLoads): a navigation command, or
        any command to a tab over the pace, may wait (bounded) or be answered with the 429 text."""
        pace = self.gate.pace
        sid = data.get("sessionId")
        tab = self.ctx.own_sessions.get(sid) if sid is not None else None
        if method not in pace.NAVIGATIONS and (tab is None or tab not in pace.marked):
            return None
        info = self.upstream.pipe.targets.get(tab) if tab else None
        answer = await pace.command(self.stage.key, method, data.get("params") or {}, tab,
                                    str((info or {}).get("url") or ""), self.upstream.pipe)
        return answer if isinstance(answer, str) else None

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

    def navigation_held(self, target_id: str) -> None:
        """The write gate holds tab `target_id`'s navigation: this connection's navigation
        commands to it in flight are answered now with the held write's text, as later commands
        are (`_held`); Chromium's own answer, once the write is decided, is dropped."""
        writes = self.upstream.pipe.writes
        answer = writes.held_navigation(target_id) if writes is not None else None
        if not isinstance(answer, str):
            return
        for key, method in list(self.pending.items()):
            if method in _NAVIGATIONS and key not in self.answered \
                    and self.ctx.own_sessions.get(key[0]) == target_id:
                self.answered.add(key)
                task = asyncio.get_running_loop().create_task(self._send(
                    {"id": key[1], "sessionId": key[0], "error": {"code": -32000, "message": answer}}))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _reply(self, data: dict) -> None:
        key = (data.get("sessionId"), data.get("id"))
        method = self.pending.pop(key, None)
        if method is None:
            await self._send(data)
            return
        self.pending_ids[key[1]] -= 1
        if self.pending_ids[key[1]] <= 0:
            del self.pending_ids[key[1]]
        if key in self.answered:   # the gate answered it when its write was held
            self.answered.discard(key)
            return
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
            gone = self.stage.destroyed
            if tid in gone:     # another connection of the stage saw this end first
                visible = gone[tid] or tid in self.mine or tid in self.ctx.own_sessions.values()
            else:
                visible = self._announced(tid)
            if name == "Target.targetDestroyed":
                if isinstance(tid, str):
                    self.stage.forget(tid)   # the gate has heard it from the pipe already, as a rule
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
