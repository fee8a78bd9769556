"""A read-only view of a stage's tab for a console session (issue 48, console controls).

The guard attaches a session of its own to the tab on the browser's pipe and streams it
(`Page.startScreencast`, JPEG): frames go to the viewers, nothing comes back. Unlike a login
handoff's live view (supervisor/console/liveview.py) there is no input path at all: no mouse,
key, text, navigation or size message is ever sent to the tab, whatever a viewer sends, and
the tab's own size is left as the stage set it. The view ends when the tab goes, the browser
goes or `close()` is called. Frames are never kept (the run record takes its own pictures).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from typing import Any

from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, CdpSession, PipeClosed
from sfguard.supervisor.record.summary import address

log = logging.getLogger("sfguard.record")

SCREENCAST = {"format": "jpeg", "quality": 60, "maxWidth": 1600, "maxHeight": 1000, "everyNthFrame": 1}
CALL_S = 10.0


class WatchView:
    """One stage tab, shown to viewers: `add_viewer()` gives a queue of ("frame", bytes) and
    ("state", dict) items, None at the end."""

    def __init__(self, pipe: CdpPipe, target: str, name: str):
        self.pipe, self.target, self.name = pipe, target, name
        self.cdp: CdpSession | None = None
        self.session: str | None = None
        self.viewers: set[asyncio.Queue] = set()
        self.closed = asyncio.Event()
        self.last_frame: bytes | None = None
        self.frames = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        async with asyncio.timeout(CALL_S):
            self.cdp = await self.pipe.session(self.name)
            got = await self.cdp.call("Target.attachToTarget", {"targetId": self.target, "flatten": True})
            self.session = got["sessionId"]
            self._task = asyncio.get_running_loop().create_task(self._events())
            with contextlib.suppress(CdpCallError):
                await self.cdp.call("Page.enable", session=self.session)
            with contextlib.suppress(CdpCallError):     # the tab as it is now, before any new paint
                shot = await self.cdp.call("Page.captureScreenshot", {"format": "jpeg", "quality": 60},
                                           session=self.session)
                self._frame(base64.b64decode(shot.get("data") or ""))
            await self.cdp.call("Page.startScreencast", SCREENCAST, session=self.session)

    async def close(self) -> None:
        if self.cdp is not None:
            with swallowed(log, "stopping a watch view's screencast"):
                await self.cdp.call("Page.stopScreencast", session=self.session, timeout=3)
            await self.cdp.close()      # detaches: the tab is left as it was
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._finish()

    def _finish(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            for q in list(self.viewers):
                _offer(q, None)

    def add_viewer(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=8)
        self.viewers.add(q)
        _offer(q, ("state", self.state()))
        if self.last_frame is not None:
            _offer(q, ("frame", self.last_frame))
        return q

    def remove_viewer(self, q: asyncio.Queue) -> None:
        self.viewers.discard(q)

    def state(self) -> dict[str, Any]:
        info = self.pipe.targets.get(self.target) or {}
        return {"t": "state", "url": address(info.get("url")), "frames": self.frames, "read_only": True}

    def _frame(self, data: bytes) -> None:
        if not data:
            return
        self.frames += 1
        self.last_frame = data
        for q in list(self.viewers):
            _offer(q, ("frame", data))

    async def _events(self) -> None:
        assert self.cdp is not None
        try:
            while True:
                ev = await self.cdp.events.get()
                method, params = ev.get("method"), ev.get("params") or {}
                if not ev or (method == "Target.detachedFromTarget" and params.get("sessionId") == self.session):
                    break
                if ev.get("sessionId") != self.session:
                    continue
                if method == "Page.screencastFrame":
                    with swallowed(log, "acknowledging a watch frame", (PipeClosed, OSError)):
                        await self.cdp.client.send({"id": 0, "method": "Page.screencastFrameAck",
                                                    "params": {"sessionId": params.get("sessionId")},
                                                    "sessionId": self.session})
                    with contextlib.suppress(ValueError):
                        self._frame(base64.b64decode(params.get("data") or "", validate=True))
                elif method == "Page.frameNavigated" and not (params.get("frame") or {}).get("parentId"):
                    for q in list(self.viewers):
                        _offer(q, ("state", self.state()))
                elif method == "Page.loadEventFired":
                    with swallowed(log, "restarting a watch view's screencast"):
                        await self.cdp.call("Page.stopScreencast", session=self.session, timeout=5)
                        await self.cdp.call("Page.startScreencast", SCREENCAST, session=self.session, timeout=5)
        except (PipeClosed, asyncio.CancelledError):
            pass
        finally:
            self._finish()


def _offer(q: asyncio.Queue, item: Any) -> None:
    """Put the newest item; a slow viewer loses old frames, never the end."""
    while True:
        try:
            q.put_nowait(item)
            return
        except asyncio.QueueFull:
            with contextlib.suppress(asyncio.QueueEmpty):
                q.get_nowait()
