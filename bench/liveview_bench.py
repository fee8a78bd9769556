"""Live-view latency: what the console adds between the login tab and the person's browser.

Real parts, in one process: a guard anchor (LocalBrowserHost: Chromium over its DevTools pipe,
no proxy), a `LiveView` on one tab of it serving a local page, the console server
(`ConsoleServer`, the live view's WebSocket behind a session cookie and an Origin check), and a
WebSocket client as the viewer. Measured in the same run, alternating rounds:

  1. frame latency: a DOM change in the tab (Runtime.evaluate) -> the next screencast frame
     arriving in the guard (baseline: what Chromium itself takes) vs at the viewer (through
     the console's WebSocket);
  2. input latency: text typed into the page's focused field -> its `input` event in the page
     (reported through a Runtime binding), sent directly over the guard's pipe
     (`Input.insertText`, baseline) vs from the viewer over the WebSocket.

Run: ./dev bench liveview_bench [--rounds N]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sfguard.supervisor.browsers import tools  # noqa: E402
from sfguard.supervisor.browsers.host import AnchorSpec, LocalBrowserHost  # noqa: E402
from sfguard.supervisor.console import handoff as live  # noqa: E402
from sfguard.supervisor.console.listen import ConsoleConfig  # noqa: E402
from sfguard.supervisor.console.liveview import LiveView  # noqa: E402
from sfguard.supervisor.console.server import LIVE_COOKIE, ConsoleServer  # noqa: E402
from sfguard.supervisor.profiles.audit import LocalAuditSink  # noqa: E402
from sfguard.supervisor.profiles.keys import FileKeyProvider  # noqa: E402
from sfguard.supervisor.testing.console_view import FakeConsoleView  # noqa: E402

PAGE = ("<!doctype html><title>bench</title><h1 id='n'>0</h1>"
        "<input id='f' autofocus style='font-size:30px'>")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def main(rounds: int) -> None:
    # the page the tab shows
    app = web.Application()
    async def index(_r):
        return web.Response(text=PAGE, content_type="text/html")
    app.router.add_get("/", index)
    page_runner = web.AppRunner(app)
    await page_runner.setup()
    site = web.TCPSite(page_runner, "127.0.0.1", 0)
    await site.start()
    page_url = f"http://127.0.0.1:{page_runner.addresses[0][1]}/"

    tmp = Path(tempfile.mkdtemp(prefix="lvb-"))
    host = LocalBrowserHost()
    browser = tools.find_browser().path
    assert browser is not None, "no browser: run ./dev setup"
    anchor = await host.launch_anchor(AnchorSpec(
        session="lvbench", socket_dir=tmp / "s", config_path=tmp / "c.json",
        browser_path=browser, temp_root=tmp, allow_direct=True))
    view = LiveView(anchor.pipe, lambda url: url.startswith(page_url), name="bench")
    guard_frames: list[float] = []
    orig_frame = view._frame

    async def frame_hook(params):
        guard_frames.append(time.perf_counter())
        await orig_frame(params)
    view._frame = frame_hook  # type: ignore[method-assign]  # the benchmark times each frame
    await view.start(page_url)

    # the console audits sign-ins (and refuses one it cannot record): a real audit log in tmp
    audit = LocalAuditSink(tmp / "home", FileKeyProvider(tmp / "home"))

    console = ConsoleServer(FakeConsoleView(tmp, audit=audit), ConsoleConfig(host="127.0.0.1", port=0))
    await console.start()
    h = live.LiveHandoff("b" * 16, "bench", "bench", None, "127.0.0.1", "127.0.0.1", None,
                         time.monotonic() + 3600, view)
    console.handoffs[h.id] = h
    token = console.auth.new_link(h.scope)
    probe = await anchor.pipe.session("bench-probe")
    sid = (await probe.call("Target.attachToTarget", {"targetId": view.target, "flatten": True}))["sessionId"]
    await probe.call("Runtime.enable", session=sid)
    await probe.call("Runtime.addBinding", {"name": "fx"}, session=sid)
    effects: asyncio.Queue = asyncio.Queue()

    async def watch_probe():
        while True:
            ev = await probe.events.get()
            if ev.get("method") == "Runtime.bindingCalled" and ev.get("sessionId") == sid:
                effects.put_nowait(time.perf_counter())
    probe_task = asyncio.get_running_loop().create_task(watch_probe())

    async def evaluate(expr: str):
        return await probe.call("Runtime.evaluate", {"expression": expr}, session=sid)

    # the page must be loaded before the hooks go in
    for _ in range(200):
        r = await probe.call("Runtime.evaluate", {"expression": "!!document.getElementById('f')",
                                                  "returnByValue": True}, session=sid)
        if (r.get("result") or {}).get("value"):
            break
        await asyncio.sleep(0.05)
    await evaluate("document.getElementById('f').addEventListener('input', () => fx('1')); "
                   "document.getElementById('f').focus()")

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{console.base_url}/live/{h.id}?t={token}") as resp:
            cookie = resp.cookies[LIVE_COOKIE].value
        ws = await http.ws_connect(f"{console.base_url}/live/{h.id}/ws", origin=console.base_url,
                                   headers={"Cookie": f"{LIVE_COOKIE}={cookie}"})
        viewer_frames: list[float] = []

        async def read_ws():
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    viewer_frames.append(time.perf_counter())
        reader = asyncio.get_running_loop().create_task(read_ws())
        await asyncio.sleep(1.5)
        # the k-th frame the guard got is the (k + offset)-th the viewer got (the viewer also
        # got the last frame from before it connected)
        offset = len(viewer_frames) - len(guard_frames)

        async def until(pred, limit=10.0):
            end = time.perf_counter() + limit
            while not pred():
                if time.perf_counter() > end:
                    raise TimeoutError("no frame")
                await asyncio.sleep(0.001)

        async def frame_round(n: int) -> tuple[float, float]:
            mark = len(guard_frames)
            t0 = time.perf_counter()
            await evaluate(f"document.getElementById('n').textContent = 'frame {n}'")
            await until(lambda: any(t >= t0 for t in guard_frames[mark:]))
            i = next(k for k in range(mark, len(guard_frames)) if guard_frames[k] >= t0)
            await until(lambda: len(viewer_frames) > i + offset)
            await asyncio.sleep(0.15)   # let the change settle (no frame of it left in flight)
            return (guard_frames[i] - t0) * 1000, (viewer_frames[i + offset] - t0) * 1000

        async def input_round(direct: bool) -> float:
            while not effects.empty():
                effects.get_nowait()
            t0 = time.perf_counter()
            if direct:
                assert view.cdp is not None
                await view.cdp.call("Input.insertText", {"text": "a"}, session=view.session)
            else:
                await ws.send_json({"t": "text", "text": "a"})
            t1 = await asyncio.wait_for(effects.get(), 10)
            return (t1 - t0) * 1000

        for i in range(3):  # warm-up
            await frame_round(-i)
            await input_round(True)
            await input_round(False)
        chromium, viewer, direct_in, ws_in = [], [], [], []
        for n in range(rounds):
            g, v = await frame_round(n)
            chromium.append(g)
            viewer.append(v)
            await asyncio.sleep(0.05)
            if n % 2:
                direct_in.append(await input_round(True))
                ws_in.append(await input_round(False))
            else:
                ws_in.append(await input_round(False))
                direct_in.append(await input_round(True))
            if n % 20 == 19:
                await evaluate("document.getElementById('f').value = ''")
        reader.cancel()
        await ws.close()

    probe_task.cancel()
    await probe.close()
    await view.close()
    await console.stop()
    await host.close_anchor(anchor)
    await page_runner.cleanup()

    def line(name, xs, base):
        return (f"{name:<44} p50 {statistics.median(xs):7.1f} ms  p90 {pct(xs, 90):7.1f} ms"
                + (f"  x{statistics.median(xs) / statistics.median(base):.2f} of baseline" if base else ""))
    print(f"live view latency, {rounds} rounds each ({tools.find_browser().version})")
    print(line("DOM change -> frame in the guard (baseline)", chromium, None))
    print(line("DOM change -> frame at the viewer", viewer, chromium))
    print(f"{'  the console adds (p50)':<44} {statistics.median(viewer) - statistics.median(chromium):7.1f} ms")
    print(line("input -> effect, direct CDP (baseline)", direct_in, None))
    print(line("input -> effect, from the viewer", ws_in, direct_in))
    print(f"{'  the console adds (p50)':<44} {statistics.median(ws_in) - statistics.median(direct_in):7.1f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    asyncio.run(main(ap.parse_args().rounds))
