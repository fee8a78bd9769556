"""LiveView on a real guard anchor, in process: input reaches the login tab only as validated
events, scrolling and resizing work, and a navigation outside the allowed sites is refused in
the tab (the run's proxy refuses it too; here there is no proxy, so the refusal is the tab's)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp import web

from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.host import AnchorSpec, LocalBrowserHost
from sfguard.supervisor.console.liveview import LiveView, _translate, display_url

PAGE = ("<!doctype html><title>t</title><body style='margin:0'>"
        "<a id='out' href='http://127.0.0.2:{port}/elsewhere' style='display:block;height:100px;"
        "font-size:40px'>leave</a><a id='in' href='/next' style='display:block;height:100px;"
        "font-size:40px'>stay</a><input id='f' style='font-size:30px'>"
        "<div style='height:5000px'></div></body>")


@pytest.mark.parametrize("msg,ok", [
    ({"t": "mouse", "type": "mousePressed", "x": 10, "y": 10, "button": "left"}, True),
    ({"t": "mouse", "type": "mouseMoved", "x": 1e9, "y": -5}, True),             # clamped
    ({"t": "mouse", "type": "dragIntercepted", "x": 1, "y": 1}, False),
    ({"t": "mouse", "type": "mousePressed", "x": "1", "y": 1}, False),
    ({"t": "key", "type": "keyDown", "key": "Enter"}, True),
    ({"t": "key", "type": "keyDown", "key": "F12"}, False),                      # not a named key
    ({"t": "key", "type": "rawKeyDown", "key": "Enter"}, False),
    ({"t": "text", "text": "hello"}, True),
    ({"t": "text", "text": ""}, False),
    ({"t": "text", "text": "x" * 2001}, False),
    ({"t": "wheel", "x": 5, "y": 5, "dy": 300}, True),
    ({"t": "resize", "w": 10, "h": 99999}, True),                                # clamped
    ({"t": "navigate", "url": "http://evil.test/"}, True),      # asked; the tab's check decides
    ({"t": "navigate", "url": "https://site-a.test:8443/login?x=1"}, True),
    ({"t": "navigate", "url": "javascript:alert(1)"}, False),                     # never a script
    ({"t": "navigate", "url": "file:///etc/passwd"}, False),
    ({"t": "navigate", "url": "chrome://settings"}, False),
    ({"t": "navigate", "url": "data:text/html,x"}, False),
    ({"t": "navigate", "url": "http:///nohost"}, False),
    ({"t": "navigate", "url": "http://a.test:99999/"}, False),
    ({"t": "navigate", "url": "http://a.test/ x"}, False),
    ({"t": "navigate", "url": "http://a.test/" + "x" * 2048}, False),
    ({"t": "navigate", "url": 5}, False),
    ({"t": "cdp", "method": "Storage.getCookies"}, False),
    ({"method": "Runtime.evaluate"}, False),
])
def test_viewer_messages_are_validated(msg, ok):
    call = _translate(msg, (1280, 720))
    assert (call is not None) == ok, (msg, call)
    if call is not None:
        method, params = call
        assert method in ("Input.dispatchMouseEvent", "Input.dispatchKeyEvent", "Input.insertText",
                          "Emulation.setDeviceMetricsOverride", "Page.navigate")
        if method == "Page.navigate":
            assert params == {"url": msg["url"], "transitionType": "typed"}
        if method == "Input.dispatchMouseEvent":
            assert 0 <= params["x"] <= 1280 and 0 <= params["y"] <= 720
        if method == "Emulation.setDeviceMetricsOverride":
            assert (params["width"], params["height"]) == (320, 1200)


@pytest.mark.parametrize("url,shown", [
    ("http://site-a.test:8080/login?next=/account&code=SECRET#x", "http://site-a.test:8080/login"),
    ("https://user:pw@example.com/a/b?q=1", "https://example.com/a/b"),
    ("http://[::1]:9/", "http://[::1]:9/"),
    ("http://[::1]/x?q=1", "http://[::1]/x"),
    ("about:blank", "about:"),
])
def test_the_address_shown_has_no_query_or_credentials(url, shown):
    assert display_url(url) == shown


@pytest.mark.browser
def test_input_scroll_resize_and_refused_navigation_on_a_real_tab(tmp_path):
    asyncio.run(_real_tab(tmp_path))


async def _real_tab(tmp_path: Path) -> None:
    app = web.Application()
    port_box = {}
    async def index(_r):
        return web.Response(text=PAGE.format(port=port_box["p"]), content_type="text/html")

    async def nxt(_r):
        return web.Response(text="<h1 id='next'>next</h1>", content_type="text/html")
    app.router.add_get("/", index)
    app.router.add_get("/next", nxt)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_box["p"] = port = site._server.sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    host = LocalBrowserHost()
    anchor = await host.launch_anchor(AnchorSpec(
        session="lvtab", socket_dir=tmp_path / "s", config_path=tmp_path / "c.json",
        browser_path=tools.find_browser().path, temp_root=tmp_path, allow_direct=True))
    view = LiveView(anchor.pipe, lambda u: u.startswith(base + "/"), name="t")
    try:
        await view.start(base + "/")
        q = view.add_viewer()
        probe = await anchor.pipe.session("probe")
        sid = (await probe.call("Target.attachToTarget", {"targetId": view.target, "flatten": True}))["sessionId"]

        async def js(expr):
            r = await probe.call("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=sid)
            return (r.get("result") or {}).get("value")

        async def until(cond, what, limit=15.0):
            end = time.monotonic() + limit
            while time.monotonic() < end:
                try:
                    if await cond():
                        return
                except Exception:
                    pass
                await asyncio.sleep(0.05)
            raise AssertionError(f"timed out: {what}")

        await until(lambda: js("!!document.getElementById('f')"), "the page")
        await until(lambda: asyncio.sleep(0, view.frames > 0), "a first frame")
        # typed text lands in the focused field
        await js("document.getElementById('f').focus()")
        assert await view.input({"t": "text", "text": "typed"})
        assert await js("document.getElementById('f').value") == "typed"
        # a wheel scrolls the page
        assert await view.input({"t": "wheel", "x": 100, "y": 300, "dy": 800})
        await until(lambda: js("window.scrollY > 0"), "the page to scroll")
        await js("window.scrollTo(0, 0)")
        # a resize changes the tab's viewport and the frames' size
        assert await view.input({"t": "resize", "w": 800, "h": 600})
        assert await js("innerWidth") == 800
        await until(lambda: asyncio.sleep(0, view.size == (800, 600)), "frames of the new size")
        # a click on a link to a site outside the allowed ones: refused, the tab stays
        for typ in ("mousePressed", "mouseReleased"):
            await view.input({"t": "mouse", "type": typ, "x": 30, "y": 50, "button": "left", "clickCount": 1})
        await until(lambda: asyncio.sleep(0, bool(view.refused)), "the refusal")
        assert view.refused == [f"http://127.0.0.2:{port}/elsewhere"]
        assert display_url(view.url) == base + "/"
        # the viewers were told (state messages carry the address and refusals, never a frame's content)
        states = []
        while not q.empty():
            item = q.get_nowait()
            if item and item[0] == "state":
                states.append(item[1])
        assert states and set(states[-1]) == {"t", "url", "w", "h", "refused", "frames"}
        # the address box: a site outside the allowed ones is refused the same way
        assert await view.input({"t": "navigate", "url": f"http://127.0.0.2:{port}/typed"})
        await until(lambda: asyncio.sleep(0, len(view.refused) == 2), "the refusal of the typed address")
        assert view.refused[-1] == f"http://127.0.0.2:{port}/typed"
        assert display_url(view.url) == base + "/"
        assert await js("location.href") == base + "/"
        # a link inside the allowed site works, and the tab is still streamed after the refusals
        frames = view.frames
        for typ in ("mousePressed", "mouseReleased"):
            await view.input({"t": "mouse", "type": typ, "x": 30, "y": 150, "button": "left", "clickCount": 1})
        await until(lambda: asyncio.sleep(0, view.url == base + "/next"), "the allowed navigation")
        await until(lambda: asyncio.sleep(0, view.frames > frames), "a frame of the next page")
        # and so does a typed address inside it
        assert await view.input({"t": "navigate", "url": base + "/"})
        await until(lambda: asyncio.sleep(0, view.url == base + "/"), "the typed allowed address")
        # after close, input is dropped and the tab is gone
        await view.close()
        assert not await view.input({"t": "text", "text": "late"})
        async def gone():
            targets = (await probe.call("Target.getTargets")).get("targetInfos") or []
            return view.target not in {t["targetId"] for t in targets}
        await until(gone, "the login tab to close")
        await probe.close()
    finally:
        await view.close()
        await host.close_anchor(anchor)
        await runner.cleanup()
