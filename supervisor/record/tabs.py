"""The guard's own view of a browser's stage tabs, for the run record (never the stage's word).

One `TabWatcher` per browser holds a session of its own on the browser's DevTools pipe
(supervisor/gate/cdp_pipe.py): the pipe's target discovery tells it of every tab, and it
attaches to each tab a stage owns (the gate knows: `owner`) with `Page.enable`, so that it sees
every navigation that commits (`Page.frameNavigated`, main frame) and every load that completes
(`Page.loadEventFired`), whatever the stage's client asked for. It takes the pictures
(`Page.captureScreenshot`, JPEG) and reads which field has the focus when a stage types (in an
isolated world, where a page's scripts cannot change what the guard reads). Tabs that no stage
owns (a live view's login tab, the login check's, the guard's start tab) are never attached or
pictured. Every call is bounded; a tab that cannot be read gives None.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, CdpSession, PipeClosed

log = logging.getLogger("sfguard.record")

CALL_S = 5.0
FIELD_S = 1.5
#: the widest picture kept (a wider viewport is scaled down: fewer pixels to encode and keep)
SHOT_WIDTH = 960
#: the focused element, read in the guard's isolated world (no page script runs there)
FOCUSED = ("(() => { let e = document.activeElement; while (e && e.shadowRoot && e.shadowRoot.activeElement)"
           " e = e.shadowRoot.activeElement; if (!e || e === document.body || e === document.documentElement)"
           " return null; const a = n => String(e.getAttribute(n) || '').slice(0, 80);"
           " return {tag: e.tagName.toLowerCase(), type: a('type').toLowerCase(), name: a('name'), id: String(e.id"
           " || '').slice(0, 80), autocomplete: a('autocomplete'), label: a('aria-label'), editable:"
           " e.isContentEditable === true}; })()")

#: (what happened: navigated | loaded, the tab's target id, details)
TabEvent = Callable[[str, str, dict[str, Any]], None]


class TabWatcher:
    """The record's session on one browser's pipe. `owner(target_id)` is True for a stage's tab."""

    def __init__(self, pipe: CdpPipe, owner: Callable[[str], bool], on_event: TabEvent, name: str = "run record"):
        self.pipe, self.owner, self.on_event, self.name = pipe, owner, on_event, name
        self.cdp: CdpSession | None = None
        self.attached: dict[str, str] = {}       # target id -> session id
        self.by_session: dict[str, str] = {}     # session id -> target id
        self._attaching: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.cdp = await self.pipe.session(self.name)
        self._task = asyncio.get_running_loop().create_task(self._events())
        await self.cdp.call("Target.setDiscoverTargets", {"discover": True}, timeout=CALL_S)

    async def close(self) -> None:
        for task in list(self._attaching.values()):
            task.cancel()
        if self.cdp is not None:
            await self.cdp.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def ensure(self, target: str) -> None:
        """Attach to a stage's tab (once; in the background)."""
        if (target in self.attached or target in self._attaching or self.cdp is None
                or (self.pipe.targets.get(target) or {}).get("type") != "page"):
            return
        task = asyncio.get_running_loop().create_task(self._attach(target))
        self._attaching[target] = task
        task.add_done_callback(lambda _t: self._attaching.pop(target, None))

    async def _attach(self, target: str) -> str | None:
        assert self.cdp is not None
        try:
            got = await self.cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True}, timeout=CALL_S)
        except (CdpCallError, PipeClosed, TimeoutError) as exc:
            log.debug("record: attaching to a tab failed: %s", type(exc).__name__)
            return None
        sid = got.get("sessionId")
        if not isinstance(sid, str):
            return None
        self.attached[target], self.by_session[sid] = sid, target
        # a tab whose navigation the write gate holds answers after the commit: bounded
        with contextlib.suppress(CdpCallError, PipeClosed, TimeoutError):
            await self.cdp.call("Page.enable", session=sid, timeout=CALL_S)
        return sid

    async def _session(self, target: str) -> str | None:
        sid = self.attached.get(target)
        if sid is None and self.cdp is not None and target in self.pipe.targets:
            sid = await self._attach(target)
        return sid

    def _forget(self, target: Any = None, session: Any = None) -> None:
        if session is not None:
            target = self.by_session.pop(session, target)
        sid = self.attached.pop(target, None) if isinstance(target, str) else None
        if sid is not None:
            self.by_session.pop(sid, None)

    async def _events(self) -> None:
        assert self.cdp is not None
        try:
            while True:
                ev = await self.cdp.events.get()
                if not ev:
                    return        # the session (the browser) ended
                with swallowed(log, "the run record's view of a tab event"):
                    self._event(ev)
        except asyncio.CancelledError:
            pass

    def _event(self, ev: dict[str, Any]) -> None:
        method, params, sid = ev.get("method"), ev.get("params") or {}, ev.get("sessionId")
        if method in ("Target.targetCreated", "Target.targetInfoChanged"):
            info = params.get("targetInfo") or {}
            tid = info.get("targetId")
            if isinstance(tid, str) and info.get("type") == "page" and tid not in self.attached and self.owner(tid):
                self.ensure(tid)
        elif method == "Target.targetDestroyed":
            self._forget(params.get("targetId"))
        elif method == "Target.detachedFromTarget":
            self._forget(session=params.get("sessionId"))
        elif sid in self.by_session:
            tid = self.by_session[sid]
            if method == "Page.frameNavigated":
                frame = params.get("frame") or {}
                if not frame.get("parentId"):
                    failed = frame.get("unreachableUrl")
                    self.on_event("navigated", tid, {"url": failed or frame.get("url"), "failed": bool(failed)})
            elif method == "Page.navigatedWithinDocument" and params.get("frameId") == tid:
                self.on_event("navigated", tid, {"url": params.get("url"), "same_document": True})
            elif method == "Page.loadEventFired":
                self.on_event("loaded", tid, {"url": (self.pipe.targets.get(tid) or {}).get("url")})

    async def capture(self, target: str, quality: int = 50) -> bytes | None:
        """A JPEG of the tab's viewport as it is now, at most SHOT_WIDTH pixels wide, or None."""
        try:
            async with asyncio.timeout(CALL_S):
                sid = await self._session(target)
                if sid is None or self.cdp is None:
                    return None
                params: dict[str, Any] = {"format": "jpeg", "quality": quality, "optimizeForSpeed": True}
                with contextlib.suppress(CdpCallError):
                    view = (await self.cdp.call("Page.getLayoutMetrics", session=sid, timeout=CALL_S)).get(
                        "cssVisualViewport") or {}
                    w, h = float(view.get("clientWidth") or 0), float(view.get("clientHeight") or 0)
                    if w > SHOT_WIDTH and h > 0:
                        params["clip"] = {"x": float(view.get("pageX") or 0), "y": float(view.get("pageY") or 0),
                                          "width": w, "height": h, "scale": SHOT_WIDTH / w}
                shot = await self.cdp.call("Page.captureScreenshot", params, session=sid, timeout=CALL_S)
        except (CdpCallError, PipeClosed, TimeoutError) as exc:
            log.debug("record: no picture of a tab: %s", type(exc).__name__)
            return None
        try:
            return base64.b64decode(shot.get("data") or "", validate=True) or None
        except ValueError:
            return None

    async def focused(self, target: str) -> dict[str, Any] | None:
        """What the focused element of a tab is (tag, type, name, id, autocomplete, label), read
        in an isolated world; None when it cannot be read in time (counts as a secret field)."""
        try:
            async with asyncio.timeout(FIELD_S):
                sid = await self._session(target)
                if sid is None or self.cdp is None:
                    return None
                world = await self.cdp.call("Page.createIsolatedWorld", {
                    "frameId": target, "worldName": "sfguard-record"}, session=sid, timeout=FIELD_S)
                res = await self.cdp.call("Runtime.evaluate", {
                    "expression": FOCUSED, "contextId": world.get("executionContextId"),
                    "returnByValue": True}, session=sid, timeout=FIELD_S)
        except (CdpCallError, PipeClosed, TimeoutError):
            return None
        value = (res.get("result") or {}).get("value")
        return value if isinstance(value, dict) else None
