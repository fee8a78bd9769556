"""A scripted person at a live view: a separate, unguarded headless Chromium that opens the
live-view link and logs in through the page, as a person would (issue 16).

Used by `sfguard demo --auto-login` (tests and CI) and the live-view tests. It is NOT the guard's
browser: it is started here over its
own `--remote-debugging-pipe` (no port), with a temporary profile, no proxy, and reaches only
the console on loopback. It never gets the stage's env or anything of the guard's: only the
one-time link. It drives the viewer page with real input events (`Input.*` on the viewer
page), which the page's script forwards to the login tab. Like a person it knows the login
tab only from its frames: it finds the Sign in button by its colour in the latest frame and
clicks there (the fixture site gives the button a colour of its own), and on a real site's
page the focused field by the focus ring Chromium draws around it (`focused_field`). Run by
root, it runs as the browser user (supervisor/browsers/browser_user.py) with Chromium's sandbox
on, like the guard's browsers.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from sfguard.errors import SfguardError
from sfguard.supervisor.browsers import browser_user as bu
from sfguard.supervisor.browsers import chromium, tools
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, CdpSession
from sfguard.supervisor.procs import ProcRecord, terminate_recorded

T = TypeVar("T")


class ViewerError(SfguardError):
    pass


class Viewer:
    """One headless Chromium with one page, driven over its DevTools pipe."""

    def __init__(self, browser_path: str | None = None, width: int = 1400, height: int = 1000,
                 mobile: bool = False, extra_args: tuple[str, ...] = ()):
        self.browser_path = browser_path or tools.find_browser().path
        self.width, self.height = width, height
        self.mobile = mobile        # a phone: the page's viewport meta applies, touch input
        self.extra_args = extra_args    # more Chromium flags (tests: a name's address, a test CA's key)
        self.dir: Path | None = None
        self.home: Path | None = None
        self.user: bu.BrowserUser | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.pipe: CdpPipe | None = None
        self.cdp: CdpSession | None = None
        self.session: str | None = None
        self.console_log: list[str] = []
        self.keys_sent: list[str] = []       # named keys pressed on the viewer page, in order

    async def __aenter__(self) -> Viewer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if not self.browser_path:
            raise ViewerError("no Chromium found for the viewer")
        try:
            self.user = bu.resolve()   # None unless root; then created when missing
            tmp = Path(tempfile.gettempdir())
            if self.user is not None:
                bu.check_reachable(tmp / "x", self.user)
            self.dir = bu.owned_dir(tmp, "sfguard-viewer-", self.user)
            if self.user is not None:
                self.home = bu.owned_dir(tmp, "sfguard-viewer-home-", self.user)
        except (bu.BrowserUserError, OSError) as exc:
            raise ViewerError(f"the viewer's browser cannot be prepared: {exc}") from None
        argv = chromium.chromium_args(browser_path=self.browser_path, profile_dir=self.dir,
                                      proxy_port=None, headed=False,
                                      no_sandbox=os.geteuid() == 0 and self.user is None)
        argv[-1:-1] = list(self.extra_args)          # before the first page
        self.proc, reader, writer = await chromium.spawn(
            argv, env=chromium.browser_env(profile_dir=self.dir, home=self.home),
            cwd=str(self.dir), user=self.user.uid if self.user else None,
            group=self.user.gid if self.user else None)
        self.pipe = CdpPipe(reader, writer)
        await self.pipe.start(timeout=60)
        self.cdp = await self.pipe.session("viewer")
        target = (await self.cdp.call("Target.createTarget", {"url": "about:blank"}))["targetId"]
        self.session = (await self.cdp.call("Target.attachToTarget",
                                            {"targetId": target, "flatten": True}))["sessionId"]
        for m in ("Page.enable", "Runtime.enable"):
            await self.call(m)
        await self.call("Emulation.setDeviceMetricsOverride", {
            "width": self.width, "height": self.height, "deviceScaleFactor": 2 if self.mobile else 1,
            "mobile": self.mobile})
        if self.mobile:
            await self.call("Emulation.setTouchEmulationEnabled", {"enabled": True, "maxTouchPoints": 5})
        asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                ev = await self._cdp().events.get()
                if ev.get("method") == "Runtime.consoleAPICalled":
                    args = (ev.get("params") or {}).get("args") or []
                    self.console_log.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
                elif ev.get("method") == "Runtime.exceptionThrown":
                    self.console_log.append(json.dumps((ev.get("params") or {}).get("exceptionDetails", {}))[:500])

    async def close(self) -> None:
        if self.pipe is not None:
            with contextlib.suppress(Exception):
                await self.pipe.call("Browser.close", timeout=5)
            await self.pipe.close()
        if self.proc is not None:
            rec = ProcRecord.of(self.proc.pid, "browser")
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                await asyncio.to_thread(terminate_recorded, [rec] if rec else [], 3)
        if self.dir is not None:
            uids = (self.user.uid,) if self.user is not None else ()
            await asyncio.to_thread(chromium.end_helpers, self.dir, 3.0, uids)
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    async def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30) -> dict[str, Any]:
        return await self._cdp().call(method, params or {}, session=self.session, timeout=timeout)

    def _cdp(self) -> CdpSession:
        if self.cdp is None:
            raise RuntimeError("the viewer's CDP session is not open")
        return self.cdp

    async def eval(self, expr: str) -> Any:
        res = await self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True,
                                                   "awaitPromise": True})
        if res.get("exceptionDetails"):
            raise ViewerError(f"evaluation failed: {expr[:80]}")
        return (res.get("result") or {}).get("value")

    async def goto(self, url: str, timeout: float = 30) -> None:
        await self.call("Page.navigate", {"url": url})
        await self.wait_for("document.readyState === 'complete' && !document.querySelector('meta[http-equiv=refresh]')",
                            timeout)

    async def wait_for(self, expr: str, timeout: float = 30, what: str | None = None) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(ViewerError, Exception):
                value = await self.eval(expr)
                if value:
                    return value
            if time.monotonic() >= deadline:
                raise ViewerError(f"timed out waiting for {what or expr[:80]}")
            await asyncio.sleep(0.05)

    async def screenshot(self, path: Path | None = None, clip_selector: str | None = None) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if clip_selector:
            r = await self.eval(f"(() => {{ const r = document.querySelector({json.dumps(clip_selector)})"
                                ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()")
            params["clip"] = {"x": r[0], "y": r[1], "width": r[2], "height": r[3], "scale": 1}
        else:
            params["captureBeyondViewport"] = True
        for attempt in range(5):
            try:
                data = base64.b64decode((await self.call("Page.captureScreenshot", params))["data"])
                break
            except CdpCallError:
                # a page just navigated to may not be laid out yet ("... with 0 width")
                if attempt == 4:
                    raise
                await asyncio.sleep(0.3)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return data

    async def click_selector(self, selector: str) -> None:
        r = await self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
                            "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        await self.click(r[0], r[1])

    async def click(self, x: float, y: float) -> None:
        for typ in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", {"type": typ, "x": x, "y": y,
                                                         "button": "left", "clickCount": 1})

    async def key(self, key: str, code: int) -> None:
        self.keys_sent.append(key)
        params = {"key": key, "code": key, "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code}
        text = {"Enter": "\r"}.get(key)
        await self.call("Input.dispatchKeyEvent", {"type": "keyDown", **params, **({"text": text} if text else {})})
        await self.call("Input.dispatchKeyEvent", {"type": "keyUp", **params})

    async def type_text(self, text: str) -> None:
        await self.call("Input.insertText", {"text": text})

    # -- the live view -------------------------------------------------------------------------
    async def frames(self) -> int:
        return int(await self.eval("Number(document.getElementById('screen').dataset.frames || 0)") or 0)

    async def screen_point(self, fx: float, fy: float) -> tuple[float, float]:
        """Viewer-page coordinates of a point (fx, fy) in the login tab's frame."""
        r = await self.eval("(() => { const s = document.getElementById('screen'); const r = "
                            "s.getBoundingClientRect(); return [r.x, r.y, r.width, r.height, "
                            "s.naturalWidth || s.width, s.naturalHeight || s.height]; })()")
        x, y, w, h, nw, nh = r
        return x + fx * w / nw, y + fy * h / nh

    #: the latest frame's pixels in the page's script: `w`, `h` and `d` (RGBA), or null when no
    #: frame is drawn at the moment (none yet, or the picture is being replaced)
    _FRAME = ("const s = document.getElementById('screen'); const w = s.naturalWidth, h = s.naturalHeight; "
              "if (!w || !h) return null; const c = document.createElement('canvas'); c.width = w; "
              "c.height = h; const x = c.getContext('2d'); try { x.drawImage(s, 0, 0); } catch (e) "
              "{ return null; } const d = x.getImageData(0, 0, w, h).data; ")

    async def find_colour(self, rgb: tuple[int, int, int], tolerance: int = 60, min_pixels: int = 80,
                          region: tuple[float, float, float, float] | None = None) -> tuple[float, float] | None:
        """The centre (frame pixels) of the pixels of the latest frame within `tolerance` (sum
        of channel differences) of `rgb`, or None when fewer than `min_pixels` match. It reads
        the picture the page shows, nothing else: the frame is drawn into a canvas. `region`
        (x0, y0, x1, y1, frame pixels) limits the search to that box."""
        r, g, b = (int(c) for c in rgb)
        x0, y0, x1, y1 = (int(v) for v in (region or (0, 0, 1 << 20, 1 << 20)))
        found = await self.eval(
            "(() => { " + self._FRAME + "let n = 0, sx = 0, sy = 0; "
            f"for (let y = Math.max(0, {y0}); y < Math.min(h, {y1}); y++) "
            f"for (let xx = Math.max(0, {x0}); xx < Math.min(w, {x1}); xx++) {{ const i = (y * w + xx) * 4; "
            f"if (Math.abs(d[i] - {r}) + Math.abs(d[i + 1] - {g}) + Math.abs(d[i + 2] - {b}) <= {int(tolerance)}) "
            "{ n += 1; sx += xx; sy += y; } } "
            "return [n, n ? sx / n : 0, n ? sy / n : 0]; })()")
        if not found or found[0] < min_pixels:
            return None
        return float(found[1]), float(found[2])

    #: the ring Chromium draws around the focused field (light colour scheme)
    FOCUS_RING_RGB = (16, 16, 16)

    async def focused_field(self, tolerance: int = 90, min_run: int = 40) -> tuple[float, float, float, float] | None:
        """The box (x0, y0, x1, y1, frame pixels) of the focus ring in the latest frame, or None
        when it shows none. A person sees the ring; here it is the rows holding a long run (at
        least `min_run` pixels) of near-black pixels: the ring's top and bottom edges. Text, dark
        as it may be, has no such runs."""
        r, g, b = self.FOCUS_RING_RGB
        rows = await self.eval(
            "(() => { " + self._FRAME + "const out = []; for (let y = 0; y < h; y++) { let run = 0, best = 0, "
            "end = 0; for (let xx = 0; xx < w; xx++) { const i = (y * w + xx) * 4; "
            f"if (Math.abs(d[i] - {r}) + Math.abs(d[i + 1] - {g}) + Math.abs(d[i + 2] - {b}) <= {int(tolerance)}) "
            "{ run += 1; if (run > best) { best = run; end = xx; } } else run = 0; } "
            f"if (best >= {int(min_run)}) out.push([y, end - best + 1, end]); }} return out; }})()")
        # the ring: the topmost such row and the lowest one spanning the same columns (a rule or
        # an underline has no partner; a ring is at least a line of text tall)
        for top in rows or []:
            same = [y for y, a, z in rows if y - top[0] >= 8 and abs(a - top[1]) <= 4 and abs(z - top[2]) <= 4]
            if same:
                return float(top[1]), float(top[0]), float(top[2]), float(max(same))
        return None

    async def look(self, find: Callable[[], Awaitable[T | None]], timeout: float, what: str) -> T:
        """Look at the frames until `find()` sees something (a person waits for the page)."""
        deadline = time.monotonic() + timeout
        while True:
            seen = await find()
            if seen is not None:
                return seen
            if time.monotonic() >= deadline:
                raise ViewerError(f"{what} is not in the live view's frame")
            await asyncio.sleep(0.1)

    async def click_frame(self, fx: float, fy: float) -> None:
        """A left click on the viewer page at the point (fx, fy) of the login tab's frame."""
        x, y = await self.screen_point(fx, fy)
        await self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        await self.click(x, y)

    async def open_live_view(self, url: str, timeout: float = 30) -> None:
        await self.goto(url, timeout)
        await self.wait_for("location.pathname.startsWith('/live/') && document.body.dataset.live === '1'",
                            timeout, "the live view to connect")
        await self.wait_for("Number(document.getElementById('screen').dataset.frames || 0) > 0 && "
                            "document.getElementById('screen').naturalWidth > 0 && "
                            "document.getElementById('screen').getBoundingClientRect().width > 0",
                            timeout, "the first frame of the login tab")


#: the fixture site's Sign in button (fixtures/login_server: SIGN_IN_RGB)
SIGN_IN_RGB = (0x12, 0x6B, 0xD8)


async def scripted_login(url: str, user: str, password: str, *, say: Callable[[str], None] = lambda s: None,
                         shots: Path | None = None, timeout: float = 60, done: bool = True,
                         button_rgb: tuple[int, int, int] = SIGN_IN_RGB,
                         before_click: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
    """Open the live-view `url` in a new viewer and sign in through the page: click into the
    page, Tab to the user field, type, Tab, type the password, then click the Sign in button
    where the frame shows it (a mouse click forwarded at that point; Enter is never pressed).
    Checks that the frames changed, then presses Done (or Cancel with `done=False`).
    `before_click` is awaited just before the click (a test looks at the site then). Returns
    {"frames_before", "frames_after", "pixels_changed", "button", "keys", "result",
    "console_log"}: `button` is the point clicked (frame pixels), `keys` the named keys pressed."""
    async with Viewer() as v:
        await v.open_live_view(url, timeout)
        say("[person] the live view shows the login tab")
        before_png = await v.screenshot(shots / "live-before.png" if shots else None, "#screen")
        frames_before = await v.frames()
        # a click on an empty spot of the page focuses it (forwarded as a real mouse click)
        x, y = await v.screen_point(5, 5)
        await v.click(x, y)
        await v.key("Tab", 9)
        await v.type_text(user)
        await v.key("Tab", 9)
        await v.type_text(password)
        await v.wait_for(f"Number(document.getElementById('screen').dataset.frames || 0) > {frames_before}",
                         timeout, "a new frame after typing")
        await asyncio.sleep(0.3)
        after_png = await v.screenshot(shots / "live-typed.png" if shots else None, "#screen")
        if shots:
            await v.screenshot(shots / "console-live-view.png")
        say("[person] typed the user and the password into the login tab")
        button = None
        deadline = time.monotonic() + timeout
        while button is None:
            button = await v.find_colour(button_rgb)
            if button is None:
                if time.monotonic() >= deadline:
                    raise ViewerError("the Sign in button is not in the live view's frame")
                await asyncio.sleep(0.1)
        if before_click is not None:
            await before_click()
        await v.click_frame(*button)
        say(f"[person] clicked Sign in where the live view shows it ({button[0]:.0f}, {button[1]:.0f})")
        await v.wait_for("!/\\/login/.test(document.getElementById('address').textContent)",
                         timeout, "the login tab to leave the login page")
        shown = await v.eval("document.getElementById('address').textContent")
        say(f"[person] signed in; the live view shows {shown}")
        frames_after = await v.frames()
        await v.click_selector("#done" if done else "#cancel")
        text = await v.wait_for("document.getElementById('result') && document.getElementById('result').textContent",
                                timeout, "the result of Done")
        if shots:
            await v.screenshot(shots / "live-result.png")
        return {"frames_before": frames_before, "frames_after": frames_after,
                "pixels_changed": before_png != after_png, "button": button,
                "keys": list(v.keys_sent), "result": text, "console_log": list(v.console_log)}
