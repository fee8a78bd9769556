"""A live view of one login tab: screencast frames out, the person's input in (issue 16).

The guard holds the anchor's DevTools pipe. A `LiveView` opens one new tab in that browser
(the *login tab*), attaches to it with a pipe client of its own, and:

  * streams it: `Page.startScreencast` (JPEG); each `Page.screencastFrame` is acknowledged and
    handed to the viewers as bytes, with only the frame size as metadata;
  * forwards input to that tab only: `Input.dispatchMouseEvent` (move, press, release, wheel),
    `Input.dispatchKeyEvent` (a fixed set of named keys), `Input.insertText` (typed or pasted
    text), `Emulation.setDeviceMetricsOverride` (the viewer's size) and `Page.navigate` (the
    page's address box: an http(s) address only). Every message is validated; anything else
    is dropped;
  * refuses navigation outside the stage's `allow_domains`, however it starts (a link, a
    redirect, a script, the address box): document requests of the tab pause (`Fetch.enable`
    on the tab's session) and go on only when the site policy allows their host for these
    patterns; the run's proxy still enforces the same rules underneath;
  * reports the tab's current address as scheme://host/path (no query: login flows put codes
    there).

The pipe client sees only its own session: no other tab, no cookie call. Nothing here logs
frames, typed text or addresses with queries.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, TypeAlias
from urllib.parse import urlsplit

from sfguard.errors import SfguardError
from sfguard.policy import join_host_port
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, CdpSession, PipeClosed

log = logging.getLogger("sfguard.console.liveview")

VIEW_W, VIEW_H = 1280, 720
MIN_W, MIN_H, MAX_W, MAX_H = 320, 240, 1920, 1200
MAX_TEXT = 2000
MAX_URL = 2048
MOUSE_TYPES = {"mousePressed", "mouseReleased", "mouseMoved"}
BUTTONS = {"none", "left", "middle", "right"}
#: named keys the viewer may send as key events (printable text goes through insertText)
KEYS = {
    "Enter": 13, "Tab": 9, "Backspace": 8, "Delete": 46, "Escape": 27, "ArrowLeft": 37,
    "ArrowUp": 38, "ArrowRight": 39, "ArrowDown": 40, "Home": 36, "End": 35, "PageUp": 33,
    "PageDown": 34, " ": 32,
}
KEY_TEXT = {"Enter": "\r", " ": " "}


def display_url(url: str) -> str:
    """scheme://host[:port]/path of an address; no user info, query or fragment."""
    try:
        p = urlsplit(url)
    except ValueError:
        return ""
    if p.scheme not in ("http", "https"):
        return url.split(":", 1)[0] + ":" if ":" in url else ""
    host = p.hostname or ""
    hostport = join_host_port(f"[{host}]" if ":" in host else host, p.port or None)
    return f"{p.scheme}://{hostport}{p.path or '/'}"


#: what opening or watching a tab over the pipe can raise: the browser's error answer, the pipe
#: gone, no answer in time, an answer without the field asked for, the pipe's own I/O
TAB_ERRORS = (CdpCallError, PipeClosed, TimeoutError, KeyError, OSError)
#: one viewer's queue: ("frame", bytes) and ("state", dict) items, None at the end
ViewerQueue: TypeAlias = asyncio.Queue[tuple[str, Any] | None]

SCREENCAST = {"format": "jpeg", "quality": 70, "maxWidth": MAX_W, "maxHeight": MAX_H, "everyNthFrame": 1}


class LiveView:
    """One login tab in an anchor browser, shown to viewers.

    `allowed(url) -> bool` decides navigation; `on_end(outcome)` is called once when the view
    ends for any reason (tab closed, browser gone, `close()`)."""

    def __init__(self, pipe: CdpPipe, allowed: Callable[[str], bool], *, name: str):
        self.pipe = pipe
        self.allowed = allowed
        self.name = name
        self.cdp: CdpSession | None = None
        self.target: str | None = None
        self.session: str | None = None
        self.url = ""
        self.size = (VIEW_W, VIEW_H)
        self.frames = 0
        self.last_frame: bytes | None = None
        self.last_meta: dict[str, Any] = {}
        self.refused: list[str] = []
        self.viewers: set[ViewerQueue] = set()
        self.closed = asyncio.Event()
        self.outcome = "ended"
        self._task: asyncio.Task[None] | None = None
        self._restart: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, url: str, timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            self.cdp = await self.pipe.session(self.name)
            created = await self._cdp().call("Target.createTarget", {"url": "about:blank"})
            self.target = created["targetId"]
            attached = await self._cdp().call("Target.attachToTarget",
                                           {"targetId": self.target, "flatten": True})
            self.session = attached["sessionId"]
            s = self.session
            await self._cdp().call("Page.enable", session=s)
            await self._cdp().call("Runtime.runIfWaitingForDebugger", session=s)
            await self._cdp().call("Fetch.enable", {"patterns": [
                {"urlPattern": "*", "resourceType": "Document", "requestStage": "Request"}]}, session=s)
            await self._cdp().call("Emulation.setDeviceMetricsOverride", {
                "width": VIEW_W, "height": VIEW_H, "deviceScaleFactor": 1, "mobile": False}, session=s)
            self._task = asyncio.get_running_loop().create_task(self._events())
            await self._cdp().call("Page.startScreencast", SCREENCAST, session=s)
            await self._cdp().call("Page.navigate", {"url": url}, session=s)

    async def close(self) -> None:
        """Stop streaming and close the login tab (idempotent)."""
        if self.cdp is not None:
            with swallowed(log, "stopping the screencast"):
                await self._cdp().call("Page.stopScreencast", session=self.session, timeout=3)
            if self.target:
                with swallowed(log, "closing the live view's tab"):
                    await self._cdp().call("Target.closeTarget", {"targetId": self.target}, timeout=5)
            await self.cdp.close()
        if self._restart is not None:
            self._restart.cancel()
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

    # -- viewers ---------------------------------------------------------------------------
    def add_viewer(self) -> ViewerQueue:
        """A queue of ("frame", bytes) / ("state", dict) items; None at the end. A slow viewer
        loses old frames, never the newest."""
        q: ViewerQueue = asyncio.Queue(maxsize=8)
        self.viewers.add(q)
        _offer(q, ("state", self.state()))
        if self.last_frame is not None:
            _offer(q, ("frame", self.last_frame))
        return q

    def remove_viewer(self, q: ViewerQueue) -> None:
        self.viewers.discard(q)

    @staticmethod
    def end_viewer(q: ViewerQueue) -> None:
        """Tell one viewer its view is over (its session ended), newest item first."""
        _offer(q, None)

    def state(self) -> dict[str, Any]:
        return {"t": "state", "url": display_url(self.url), "w": self.size[0], "h": self.size[1],
                "refused": self.refused[-3:], "frames": self.frames}

    def _broadcast(self, item: tuple[str, Any]) -> None:
        for q in list(self.viewers):
            _offer(q, item)

    # -- events from the tab -------------------------------------------------------------------
    async def _events(self) -> None:
        assert self.cdp is not None
        try:
            while True:
                ev = await self.cdp.events.get()
                method, params = ev.get("method"), ev.get("params") or {}
                if method == "Target.detachedFromTarget" and params.get("sessionId") == self.session:
                    log.info("live view %s: the login tab went away", self.name)
                    break
                if ev.get("sessionId") != self.session:
                    continue
                if method == "Page.screencastFrame":
                    await self._frame(params)
                elif method == "Page.frameNavigated" and not (params.get("frame") or {}).get("parentId"):
                    self.url = str((params.get("frame") or {}).get("url") or "")
                    self._broadcast(("state", self.state()))
                elif method == "Page.loadEventFired":
                    self._restart_stream()
                elif method == "Fetch.requestPaused":
                    await self._navigation(params)
                elif method == "Inspector.detached":
                    log.info("live view %s: the login tab detached (%s)", self.name, params.get("reason"))
                    break
        except (PipeClosed, asyncio.CancelledError):
            pass
        except Exception:   # the reader task's top: whatever the tab sent, the view ends, said in the log
            log.exception("live view %s: reading the tab's events failed; the view ends", self.name)
        finally:
            self._finish()

    def _restart_stream(self) -> None:
        """A page has loaded: the screencast is started again, which sends the page as it is
        now. A page done painting sends no more frames, and under load the stream was seen to
        send none after a navigation (a person would look at the previous page)."""
        if self._restart is not None and not self._restart.done():
            return

        async def restart() -> None:
            with swallowed(log, "restarting the live view's screencast"):
                await self._cdp().call("Page.stopScreencast", session=self.session, timeout=5)
                await self._cdp().call("Page.startScreencast", SCREENCAST, session=self.session, timeout=5)
        self._restart = asyncio.get_running_loop().create_task(restart())

    def _cdp(self) -> CdpSession:
        if self.cdp is None:
            raise RuntimeError("the live view's CDP session is not open")
        return self.cdp

    async def _frame(self, params: dict[str, Any]) -> None:
        # the ack goes first (not awaited): the next frame may be produced meanwhile
        with swallowed(log, "acknowledging a frame"):
            await self._cdp().client.send({"id": 0, "method": "Page.screencastFrameAck",
                                        "params": {"sessionId": params.get("sessionId")},
                                        "sessionId": self.session})
        try:
            data = base64.b64decode(params.get("data") or "", validate=True)
        except ValueError:
            return
        meta = params.get("metadata") or {}
        self.frames += 1
        self.last_frame = data
        size = (int(meta.get("deviceWidth") or self.size[0]), int(meta.get("deviceHeight") or self.size[1]))
        if size != self.size:
            self.size = size
            self._broadcast(("state", self.state()))
        self._broadcast(("frame", data))

    async def _navigation(self, params: dict[str, Any]) -> None:
        request = params.get("request") or {}
        url = str(request.get("url") or "")
        rid = params.get("requestId")
        ok = url.startswith(("about:", "data:")) or self._allowed(url)
        with swallowed(log, "answering a paused request of the live view's tab"):
            if ok:
                await self._cdp().call("Fetch.continueRequest", {"requestId": rid},
                                    session=self.session, timeout=5)
            else:
                self.refused.append(display_url(url))
                log.info("live view %s: navigation refused (outside allow_domains)", self.name)
                await self._cdp().call("Fetch.failRequest", {"requestId": rid,
                                    "errorReason": "Aborted"}, session=self.session, timeout=5)
                self._broadcast(("state", self.state()))

    def _allowed(self, url: str) -> bool:
        """The policy's answer for a document request; an address it cannot read is refused."""
        try:
            return bool(self.allowed(url))
        except (ValueError, SfguardError):    # a malformed address or port, a host the policy refuses to read
            return False

    # -- input from a viewer -------------------------------------------------------------------
    async def input(self, msg: Any) -> bool:
        """Forward one validated viewer message to the login tab; False when it was dropped."""
        if self.closed.is_set() or self.cdp is None or not isinstance(msg, dict):
            return False
        call = _translate(msg, self.size)
        if call is None:
            return False
        method, params = call
        if method == "Emulation.setDeviceMetricsOverride":
            self.size = (params["width"], params["height"])
        try:
            await self._cdp().call(method, params, session=self.session, timeout=10)
        except (CdpCallError, PipeClosed, TimeoutError):
            return False
        return True


def _offer(q: ViewerQueue, item: tuple[str, Any] | None) -> None:
    while True:
        try:
            q.put_nowait(item)
            return
        except asyncio.QueueFull:
            with contextlib.suppress(asyncio.QueueEmpty):
                q.get_nowait()


def _num(v: Any, lo: float, hi: float) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(min(max(v, lo), hi))


def _mods(v: Any) -> int:
    return int(v) & 0b1111 if isinstance(v, int) and not isinstance(v, bool) else 0


def _translate(msg: dict[str, Any], size: tuple[int, int]) -> tuple[str, dict[str, Any]] | None:
    """A viewer message -> (CDP method, params), or None when it is not valid."""
    t = msg.get("t")
    w, h = size
    if t == "mouse":
        typ, x, y = msg.get("type"), _num(msg.get("x"), 0, w), _num(msg.get("y"), 0, h)
        if typ not in MOUSE_TYPES or x is None or y is None:
            return None
        button = msg.get("button") if msg.get("button") in BUTTONS else "none"
        if typ != "mouseMoved" and button == "none":
            button = "left"
        raw_clicks = msg.get("clickCount")
        clicks = raw_clicks if isinstance(raw_clicks, int) else 1
        return "Input.dispatchMouseEvent", {"type": typ, "x": x, "y": y, "button": button,
                                            "clickCount": max(0, min(clicks, 3)),
                                            "modifiers": _mods(msg.get("modifiers"))}
    if t == "wheel":
        x, y = _num(msg.get("x"), 0, w), _num(msg.get("y"), 0, h)
        dx, dy = _num(msg.get("dx", 0), -5000, 5000), _num(msg.get("dy", 0), -5000, 5000)
        if None in (x, y, dx, dy):
            return None
        return "Input.dispatchMouseEvent", {"type": "mouseWheel", "x": x, "y": y,
                                            "deltaX": dx, "deltaY": dy}
    if t == "key":
        typ, key = msg.get("type"), msg.get("key")
        if typ not in ("keyDown", "keyUp") or key not in KEYS:
            return None
        params = {"type": typ, "key": key, "code": "Space" if key == " " else key,
                  "windowsVirtualKeyCode": KEYS[key], "nativeVirtualKeyCode": KEYS[key],
                  "modifiers": _mods(msg.get("modifiers"))}
        if typ == "keyDown" and key in KEY_TEXT:
            params["text"] = KEY_TEXT[key]
        return "Input.dispatchKeyEvent", params
    if t == "text":
        text = msg.get("text")
        if not isinstance(text, str) or not 0 < len(text) <= MAX_TEXT:
            return None
        return "Input.insertText", {"text": text}
    if t == "navigate":
        url = msg.get("url")
        if not isinstance(url, str) or not 0 < len(url) <= MAX_URL or any(c <= " " or c == "\x7f" for c in url):
            return None
        try:
            p = urlsplit(url)
            _ = p.port    # a malformed port raises
        except ValueError:
            return None
        if p.scheme not in ("http", "https") or not p.hostname:
            return None
        # where the tab may go is decided for every document request (Fetch), this one too
        return "Page.navigate", {"url": url, "transitionType": "typed"}
    if t == "resize":
        nw, nh = _num(msg.get("w"), MIN_W, MAX_W), _num(msg.get("h"), MIN_H, MAX_H)
        if nw is None or nh is None:
            return None
        return "Emulation.setDeviceMetricsOverride", {"width": int(nw), "height": int(nh),
                                                      "deviceScaleFactor": 1, "mobile": False}
    return None


def encode_state(state: dict[str, Any]) -> str:
    return json.dumps(state, separators=(",", ":"))
