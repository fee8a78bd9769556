"""The CDP gate with a real anchor browser and real agent-browser stage sessions."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from sfguard.supervisor.gate import cdp_policy
from sfguard.supervisor.gate.cdp_gate import CdpGate, GateError
from sfguard.supervisor.gate.cdp_pipe import CdpCallError
from tests.cdp_gate.conftest import SECRET_COOKIE, CdpClient

pytestmark = pytest.mark.browser


async def raw_call(anchor, method: str, params: dict | None = None) -> dict:
    """One call on the anchor's DevTools pipe (the guard's view, to check what really happened)."""
    try:
        return {"result": await anchor.pipe.call(method, params or {}, timeout=10)}
    except CdpCallError as exc:
        return {"error": {"message": str(exc)}}


async def raw_page_ids(raw) -> set[str]:
    infos = (await raw_call(raw, "Target.getTargets"))["result"]["targetInfos"]
    return {i["targetId"] for i in infos if i["type"] == "page"}


async def test_agent_browser_commands_through_gate(anchor, pages, gate, sessions, tmp_path):
    """open, snapshot, click, fill, screenshot, get url, tab new/list/close, close all work; only
    allowlisted methods are used and nothing is refused."""
    url = gate.add_stage("s1", anchor.pipe, artifacts_dir=tmp_path)
    pre = await gate.create_stage_tab("s1")
    st = sessions(url, "a")
    assert st.env["AGENT_BROWSER_CDP"] == url

    out = await st.arun("open", f"{pages}/index.html")
    assert "Index" in out.stdout
    snap = (await st.arun("snapshot", "-i")).stdout
    assert 'textbox "query" [ref=e2]' in snap and 'button "Go" [ref=e3]' in snap
    await st.arun("fill", "@e2", "hello")
    await st.arun("click", "@e3")
    assert (await st.arun("get", "title")).stdout.strip() == "clicked:hello"
    shot = tmp_path / "shot.png"
    await st.arun("screenshot", str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (await st.arun("get", "url")).stdout.strip() == f"{pages}/index.html"
    await st.arun("tab", "new", f"{pages}/p2.html")
    listed = (await st.arun("tab", "list")).stdout
    assert f"{pages}/index.html" in listed and f"{pages}/p2.html" in listed
    assert "about:blank" in listed  # the guard's pre-created tab; the anchor's own tab is not listed
    assert listed.count("[t") == 3, listed
    await st.arun("tab", "close")
    assert f"{pages}/p2.html" not in (await st.arun("tab", "list")).stdout
    await st.arun("close")

    assert gate.refusals == []
    used = gate.methods_seen("s1")
    assert {"Target.createTarget", "Page.navigate", "Accessibility.getFullAXTree", "Input.insertText",
            "Page.captureScreenshot"} <= set(used)
    assert all(cdp_policy.is_allowed_method(m) for m in used), used
    # tabs: the pre-created one + the session's pinned tab are left; closing them at stage end works
    owned = gate.stage_targets("s1")
    assert pre in owned and len(owned) == 2
    closed = await gate.close_stage_tabs("s1")
    assert set(closed) == owned and not (owned & await raw_page_ids(anchor))


async def test_hostile_script_is_refused_and_reaches_nothing(anchor, gate, caplog, tmp_path):
    caplog.set_level(logging.DEBUG, logger="sfguard.cdp_gate")
    url_a = gate.add_stage("A", anchor.pipe, tab_quota=8)
    gate.add_stage("B", anchor.pipe)
    other_tab = await gate.create_stage_tab("B")
    contexts_before = (await raw_call(anchor, "Target.getBrowserContexts"))["result"]["browserContextIds"]
    pages_before = await raw_page_ids(anchor)

    async with aiohttp.ClientSession() as s, s.ws_connect(url_a) as ws:
        c = CdpClient(ws)
        attacks = [
            ("Target.createBrowserContext", {"proxyServer": "direct://"}),
            ("Storage.getCookies", {}),
            ("Network.getAllCookies", {}),
            ("Target.attachToTarget", {"targetId": other_tab, "flatten": True}),
            ("Target.closeTarget", {"targetId": other_tab}),
            ("Target.createTarget", {"url": "file:///etc/passwd"}),
            ("Browser.close", {}),
        ]
        for method, params in attacks:
            reply = await c.call(method, params)
            assert reply["error"]["message"].startswith(f"sfguard: refused {method}: "), reply
            assert "result" not in reply
        # a session id of someone else: refused with the sessionId kept on the reply
        reply = await c.call("Runtime.evaluate", {"expression": "document.cookie"}, session_id="FOREIGNSESSION")
        assert reply["sessionId"] == "FOREIGNSESSION" and "sfguard: refused" in reply["error"]["message"]
        # the 9th tab: 8 allowed, then the quota refuses
        created = []
        for _ in range(8):
            created.append((await c.call("Target.createTarget", {"url": "about:blank"}))["result"]["targetId"])
        ninth = await c.call("Target.createTarget", {"url": "about:blank"})
        assert ninth["error"]["message"] == "sfguard: refused Target.createTarget: tab quota reached (8)"
        # own tabs work; the target list shows only them
        listed = (await c.call("Target.getTargets"))["result"]["targetInfos"]
        assert {i["targetId"] for i in listed} == set(created)

    # nothing reached Chrome: no new context, B's tab untouched, exactly 8 new pages
    assert (await raw_call(anchor, "Target.getBrowserContexts"))["result"]["browserContextIds"] == contexts_before
    pages_after = await raw_page_ids(anchor)
    assert other_tab in pages_after and pages_after - pages_before == set(created)
    refused = [(k, m) for k, m, _ in gate.refusals]
    assert refused == [("A", m) for m, _ in attacks] + [("A", "Runtime.evaluate"), ("A", "Target.createTarget")]
    token = url_a.rsplit("/", 1)[1]
    assert "refused Storage.getCookies" in caplog.text
    assert token not in caplog.text
    await gate.close_stage_tabs("A")
    await gate.close_stage_tabs("B")


@pytest.mark.parametrize("case", ["wrong_token", "revoked", "origin", "no_token"])
async def test_refused_before_upgrade(anchor, gate, case):
    url = gate.add_stage("S", anchor.pipe)
    headers = {}
    if case == "wrong_token":
        url = url[:-4] + ("AAAA" if not url.endswith("AAAA") else "BBBB")
    elif case == "revoked":
        await gate.revoke("S")
    elif case == "origin":
        headers = {"Origin": "http://127.0.0.1:1"}
    elif case == "no_token":
        url = url.rsplit("/", 1)[0] + "/"
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await s.ws_connect(url, headers=headers)
        expected = 404 if case == "no_token" else 403
        assert err.value.status == expected
        body_url = url.replace("ws://", "http://")
        async with s.get(body_url, headers=headers) as resp:
            text = await resp.text()
            assert resp.status == expected and "sfguard: refused" in text or case == "no_token"


async def test_revoke_closes_open_connection_and_token_stays_dead(anchor, gate):
    url = gate.add_stage("S", anchor.pipe)
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(url)
        c = CdpClient(ws)
        assert "result" in await c.call("Browser.getVersion")
        await gate.revoke("S")
        msg = await ws.receive(timeout=5)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        await ws.close()
        # a new stage with the same key gets a new token; the old one stays refused
        new_url = gate.add_stage("S", anchor.pipe)
        assert new_url != url
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await s.ws_connect(url)
        assert err.value.status == 403


async def test_rekey_hands_token_tabs_and_connection_to_the_new_key_once(anchor, gate):
    """A session started ahead under a placeholder key becomes one stage's: same token, its tab
    and open connection kept; the old key is gone, the new key's revoke cuts it at once."""
    url = gate.add_stage("run/~spare/x", anchor.pipe, tab_quota=3)
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(url)
        c = CdpClient(ws)
        created = await c.call("Target.createTarget", {"url": "about:blank"})
        tid = created["result"]["targetId"]
        gate.rekey("run/~spare/x", "run/stage/1", tab_quota=5)
        assert gate.stage_targets("run/stage/1") == {tid}
        with pytest.raises(GateError):
            gate.stage_targets("run/~spare/x")
        with pytest.raises(GateError):   # taken once: the placeholder no longer exists
            gate.rekey("run/~spare/x", "run/other/1")
        gate.add_stage("run/other/1", anchor.pipe)
        with pytest.raises(GateError):   # never onto a key that is another stage's
            gate.rekey("run/stage/1", "run/other/1")
        assert "result" in await c.call("Browser.getVersion")   # the connection went along
        await gate.revoke("run/~spare/x")                        # a no-op now
        assert "result" in await c.call("Browser.getVersion")
        await gate.close_stage_tabs("run/stage/1")
        assert tid not in await raw_page_ids(anchor)
        await gate.revoke("run/stage/1")
        msg = await ws.receive(timeout=5)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        await ws.close()
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await s.ws_connect(url)
        assert err.value.status == 403


async def test_discovery_events_show_only_own_tabs(anchor, gate):
    url_a, url_b = gate.add_stage("A", anchor.pipe), gate.add_stage("B", anchor.pipe)
    async with aiohttp.ClientSession() as s, s.ws_connect(url_a) as wa, s.ws_connect(url_b) as wb:
        a, b = CdpClient(wa), CdpClient(wb)
        await a.call("Target.setDiscoverTargets", {"discover": True})
        await a.drain(0.5)
        # existing targets (the anchor's tab, browser UI) were not announced to A
        assert [e for e in a.events if e.get("method", "").startswith("Target.")] == []
        own = (await a.call("Target.createTarget", {"url": "about:blank"}))["result"]["targetId"]
        other = (await b.call("Target.createTarget", {"url": "about:blank"}))["result"]["targetId"]
        await b.call("Target.closeTarget", {"targetId": other})
        await a.drain(1.0)
        seen = {e["params"].get("targetInfo", {}).get("targetId") or e["params"].get("targetId")
                for e in a.events if e.get("method", "").startswith("Target.")}
        assert own in seen and other not in seen
        assert "Target.targetCreated" in {e["method"] for e in a.events}
        assert other not in "".join(a.received)
        info = await a.call("Target.getTargetInfo", {"targetId": other})
        assert "sfguard: refused" in info["error"]["message"]
    await gate.close_stage_tabs("A")


async def test_httponly_cookie_not_visible_in_network_events(anchor, pages, gate):
    url = gate.add_stage("A", anchor.pipe)
    async with aiohttp.ClientSession() as s, s.ws_connect(url, max_msg_size=0) as ws:
        c = CdpClient(ws)
        tid = (await c.call("Target.createTarget", {"url": "about:blank"}))["result"]["targetId"]
        sid = (await c.call("Target.attachToTarget", {"targetId": tid, "flatten": True}))["result"]["sessionId"]
        await c.call("Network.enable", {}, sid)
        await c.call("Page.enable", {}, sid)
        await c.call("Page.navigate", {"url": f"{pages}/cookie"}, sid)
        await c.call("Page.navigate", {"url": f"{pages}/p2.html"}, sid)  # sends the cookie back
        await c.drain(1.5)
        methods = {e.get("method") for e in c.events}
        assert "Network.requestWillBeSent" in methods and "Network.responseReceived" in methods
        assert SECRET_COOKIE not in "".join(c.received)
        refused = await c.call("Network.getCookies", {}, sid)
        assert "sfguard: refused" in refused["error"]["message"]
    # the cookie is really in the browser (so the test above could have failed)
    cookies = (await raw_call(anchor, "Storage.getCookies"))["result"]["cookies"]
    assert any(ck["value"] == SECRET_COOKIE for ck in cookies)
    await gate.close_stage_tabs("A")


async def test_two_stages_see_only_their_own_tabs(anchor, pages, gate, sessions):
    sa = sessions(gate.add_stage("A", anchor.pipe), "a")
    sb = sessions(gate.add_stage("B", anchor.pipe), "b")
    await asyncio.gather(sa.arun("open", f"{pages}/a.html"), sb.arun("open", f"{pages}/b.html"))
    la, lb = (await sa.arun("tab", "list")).stdout, (await sb.arun("tab", "list")).stdout
    assert "/a.html" in la and "/b.html" not in la
    assert "/b.html" in lb and "/a.html" not in lb
    assert not (gate.stage_targets("A") & gate.stage_targets("B"))
    # stage end order: close tabs, close the session through the still-valid token, then revoke
    for key, st in (("A", sa), ("B", sb)):
        tabs = gate.stage_targets(key)
        await gate.close_stage_tabs(key)
        await st.arun("close")
        await gate.revoke(key)
        assert not (tabs & await raw_page_ids(anchor))
    assert gate.refusals == []


async def test_api_errors_on_duplicate_stage_and_dead_browser(anchor, gate):
    gate.add_stage("S", anchor.pipe)
    with pytest.raises(GateError):
        gate.add_stage("S", anchor.pipe)
    with pytest.raises(GateError) as err:
        gate.add_stage("T", "ws://10.0.0.1:9222/devtools/browser/x")
    assert "10.0.0.1" not in str(err.value)
    gate.add_stage("D", anchor.pipe)
    await anchor.pipe.close()   # the browser's pipe is gone: the gate says so, nothing more
    with pytest.raises(GateError) as err:
        await gate.create_stage_tab("D")
    assert "browser unavailable" in str(err.value)
    with pytest.raises(GateError):
        gate.add_stage("E", anchor.pipe)
    with pytest.raises(GateError):
        CdpGate(host="0.0.0.0")


async def test_tabs_of_another_connection_are_not_pushed_to_the_session(anchor, pages, gate, sessions):
    """Issue 37: agent-browser sets up every page its connection is told about before its next
    command. Tabs that another connection of the same stage opened (a raw script) are the
    stage's (listed, attachable, closed at stage end) but target events announce them only to
    the connection that opened them, so the session's commands and `close` stay instant."""
    url = gate.add_stage("S", anchor.pipe)
    pre = await gate.create_stage_tab("S")
    st = sessions(url, "s")
    await st.arun("open", f"{pages}/index.html")
    attaches = gate.methods_seen("S")["Target.attachToTarget"]
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as wx, s.ws_connect(url) as wy:
        x, y = CdpClient(wx), CdpClient(wy)
        await y.call("Target.setDiscoverTargets", {"discover": True})
        y_tab = (await y.call("Target.createTarget", {"url": "about:blank"}))["result"]["targetId"]
        x_tabs = [(await x.call("Target.createTarget", {"url": f"{pages}/p2.html"}))["result"]["targetId"]
                  for _ in range(3)]
        await y.drain(1.0)
        told = {e["params"].get("targetInfo", {}).get("targetId") or e["params"].get("targetId")
                for e in y.events if e.get("method", "").startswith("Target.")}
        assert pre in told and y_tab in told       # the guard's tab and its own
        assert not told & set(x_tabs), told
        # still the stage's: listed, attachable (then announced), closed at stage end
        listed = {i["targetId"] for i in (await y.call("Target.getTargets"))["result"]["targetInfos"]}
        assert set(x_tabs) | {pre, y_tab} <= listed
        attached = await y.call("Target.attachToTarget", {"targetId": x_tabs[0], "flatten": True})
        assert "result" in attached, attached
        y.events.clear()
        await x.call("Target.closeTarget", {"targetId": x_tabs[0]})
        await y.drain(1.0)
        assert {"Target.detachedFromTarget", "Target.targetDestroyed"} <= {e.get("method") for e in y.events}
    # the session's next commands set up none of them
    assert (await st.arun("get", "url")).stdout.strip() == f"{pages}/index.html"
    await st.arun("close")
    assert gate.methods_seen("S")["Target.attachToTarget"] == attaches + 1   # y's one attach
    assert set(x_tabs[1:]) <= gate.stage_targets("S")
    closed = await gate.close_stage_tabs("S")
    assert set(x_tabs[1:]) <= set(closed) and not set(closed) & await raw_page_ids(anchor)


async def test_tabs_asked_for_on_a_connection_closed_at_once_are_the_stages(anchor, gate):
    """A script that sends createTarget and closes its connection at once (or fires creates on
    many connections together) gets no more tabs than the quota, and every tab it got is the
    stage's: closed at stage end, not left in the browser."""
    url = gate.add_stage("S", anchor.pipe, tab_quota=2)
    before = await raw_page_ids(anchor)
    create = json.dumps({"id": 1, "method": "Target.createTarget", "params": {"url": "about:blank"}})

    async def fire_and_close(s: aiohttp.ClientSession) -> None:
        ws = await s.ws_connect(url)
        await ws.send_str(create)
        await ws.close()

    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            await fire_and_close(s)
        await asyncio.gather(*(fire_and_close(s) for _ in range(4)))
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline and len(gate.stage_targets("S")) < 2:
        await asyncio.sleep(0.1)
    made = await raw_page_ids(anchor) - before
    assert len(made) <= 2 and made == gate.stage_targets("S"), (made, gate.stage_targets("S"))
    closed = await gate.close_stage_tabs("S")
    assert set(closed) == made and not (await raw_page_ids(anchor)) - before


@pytest.mark.parametrize("closer", ["the browser", "the stage, leaving at once"])
async def test_a_tab_that_ends_while_no_connection_is_open_is_no_longer_the_stages(anchor, gate, closer):
    """The gate hears of every tab that ends from the browser's pipe, not only through a stage's
    open connection: a tab closed from the browser's side, or by a stage that leaves before the
    end is announced, no longer counts against the stage's tabs or its quota."""
    url = gate.add_stage("S", anchor.pipe, tab_quota=2)
    tabs = [await gate.create_stage_tab("S") for _ in range(2)]
    if closer == "the browser":
        for tid in tabs:
            await raw_call(anchor, "Target.closeTarget", {"targetId": tid})
    else:
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(url)
            for n, tid in enumerate(tabs, 1):
                await ws.send_str(json.dumps({"id": n, "method": "Target.closeTarget",
                                              "params": {"targetId": tid}}))
            await ws.receive(timeout=10)
            await ws.close()
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline and gate.stage_targets("S"):
        await asyncio.sleep(0.05)
    assert gate.stage_targets("S") == set()
    assert not set(tabs) & await raw_page_ids(anchor)
    async with aiohttp.ClientSession() as s:   # the quota is whole again
        c = CdpClient(await s.ws_connect(url))
        made = [await c.call("Target.createTarget", {"url": "about:blank"}) for _ in range(2)]
        assert all("result" in m for m in made), made
    assert len(gate.stage_targets("S")) == 2
    await gate.close_stage_tabs("S")
