"""Write gates in the guard's own DevTools pipe, with real Chromium behind the run proxy.

A fixture site (two hosts: `b.test` guarded, `a.test` allowed) with a logged-in session cookie
records every request it receives. The page sends writes every way a page can (form into the
same tab, a new tab, a popup, an iframe; fetch; XHR; sendBeacon; <a ping>; a dedicated worker; a
307 redirect from an allowed host); the test asserts what the site received and what the page saw.
"""
from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sfguard.supervisor.daemon.run_proxy import RunProxy
from sfguard.supervisor.testing.approver import FakeApprover
from sfguard.supervisor.writes.intercept import WriteContext, WriteInterceptor

from .test_fetch_switch_off import Tab

PAGE = """<!doctype html><html><head><title>site</title></head><body>
<form name=same method=post action="/w/form"><input name=msg value="hello"></form>
<form name=blank method=post action="/w/blank" target=_blank><input name=msg value="b"></form>
<form name=pop method=post action="/w/popup" target=popwin><input name=msg value="p"></form>
<form name=frm method=post action="/w/iframe" target=fr><input name=msg value="i"></form>
<form name=redir method=post action="{a}/r307"><input name=msg value="r"></form>
<iframe name=fr src="/blank"></iframe>
<a id=ping ping="/w/ping" href="#pinged">ping</a>
</body></html>"""

#: name -> (script run in the page, the path the site must (not) receive)
WAYS = {
    "form": ("document.forms.same.submit()", "/w/form"),
    "form_new_tab": ("document.forms.blank.submit()", "/w/blank"),
    "form_popup": ("window.open('/blank', 'popwin'); setTimeout(() => document.forms.pop.submit(), 300)",
                   "/w/popup"),
    "form_iframe": ("document.forms.frm.submit()", "/w/iframe"),
    "fetch": ("fetch('/w/fetch', {method: 'POST', body: 'x=1'}).then(r => window.__st = r.status,"
              " e => window.__st = 'error')", "/w/fetch"),
    "xhr": ("(() => { const x = new XMLHttpRequest(); x.open('PUT', '/w/xhr');"
            " x.onloadend = () => window.__st = x.status; x.send('y=2'); })()", "/w/xhr"),
    "beacon": ("navigator.sendBeacon('/w/beacon', 'z=3')", "/w/beacon"),
    "ping": ("document.getElementById('ping').click()", "/w/ping"),
    "worker": ("new Worker(URL.createObjectURL(new Blob([`fetch('${location.origin}/w/worker',"
               " {method: 'POST', body: 'w=4'})`], {type: 'text/javascript'})))", "/w/worker"),
    "redirect_307": ("document.forms.redir.submit()", "/w/r307"),
}


#: a page whose subresources are GETs the site policy names writes (`GET /w/out*`), one of each
#: type the write gate does not pause for reads (intercept.GET_ONLY_TYPES), and one read
GET_PAGE = """<!doctype html><html><head><title>gets</title>
<link rel=stylesheet href="/w/out-style"><script src="/w/out-script"></script>
<style>@font-face { font-family: f; src: url(/w/out-font); } body { font-family: f; }</style>
</head><body>text<img src="/w/out-img"><img src="/read.gif"><video src="/w/out-media" preload=auto></video>
</body></html>"""


class Site:
    """One loopback server for both hosts; records (host, method, path, cookie) of every request."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str, str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                host = (self.headers.get("Host") or "").split(":")[0]
                path = self.path.split("?")[0]
                outer.got.append((host, self.command, path, self.headers.get("Cookie") or ""))
                if path == "/r307":
                    self.send_response(307)
                    self.send_header("Location", f"{outer.b}/w/r307")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path == "/page":
                    body = PAGE.format(a=outer.a).encode()
                elif path == "/getpage":
                    body = GET_PAGE.encode()
                else:
                    body = b"<!doctype html><title>ok</title><p>written</p>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Cache-Control", "no-store")
                if path == "/page":
                    self.send_header("Set-Cookie", "sid=logged-in; Path=/; HttpOnly")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.a, self.b = f"http://a.test:{self.port}", f"http://b.test:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def writes(self) -> list[tuple[str, str, str, str]]:
        return [g for g in self.got if g[1] != "GET"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
async def guarded(real_rig):
    site = Site()
    policy = real_rig.root / "sites.yaml"
    policy.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site.port}]\nallow_always: []\n"
                      'block: []\nprivate_networks:\n  allow: ["127.0.0.1/32"]\n')
    proxy = RunProxy("run-w", policy, real_rig.root / "decisions.log",
                     {"a.test": "127.0.0.1", "b.test": "127.0.0.1"})
    await proxy.start()
    anchor = None
    try:
        client = await proxy.add_client(["a.test", "b.test"])
        anchor = await real_rig.host.launch_anchor(real_rig.spec(
            None, proxy_url=proxy.url_for(client), allow_direct=False))
        # the proxy's challenge answered and the pipe's proxy authentication off (until then
        # every request pauses): the tests see only what the write gate's patterns pause
        err, _ = await (await Tab(anchor).open()).load(f"{site.b}/blank")
        assert err is None
        assert await until(lambda: not anchor.pipe.fetch_on)
        yield anchor, site
    finally:
        if anchor is not None:
            await real_rig.host.close_anchor(anchor)
        await proxy.stop()
        site.close()


def gate(anchor, mode: str, approver=None, timeout: float = 30.0, **ctx) -> WriteInterceptor:
    logged: list[dict] = []
    w = WriteInterceptor(anchor.pipe, WriteContext("run-w", "p", "s1", 1,
                                                   {"a.test": "allow", "b.test": mode}, **ctx),
                         approver=approver, timeout=timeout, record=lambda d, rec: logged.append(rec))
    w.logged = logged  # type: ignore[attr-defined]
    anchor.pipe.writes = w
    anchor.pipe.apply_write_patterns()
    return w


async def fresh_tab(anchor, site) -> Tab:
    tab = await Tab(anchor).open()
    err, _ = await tab.load(f"{site.b}/page")
    assert err is None
    return tab


async def run(tab: Tab, script: str) -> None:
    await tab.cdp.call("Runtime.evaluate", {"expression": script}, session=tab.session)


async def until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


async def page_text(tab: Tab) -> str:
    res = await tab.cdp.call("Runtime.evaluate", {"expression": "document.body ? document.body.innerText : ''",
                                                  "returnByValue": True}, session=tab.session)
    return str(res["result"].get("value"))


@pytest.mark.browser
async def test_deny_the_site_receives_no_write_and_the_page_is_told(guarded):
    anchor, site = guarded
    w = gate(anchor, "deny")
    for name, (script, _path) in WAYS.items():
        tab = await fresh_tab(anchor, site)
        n = len(site.got)
        await run(tab, script)
        await asyncio.sleep(1.5)
        # only the redirect's first POST, to the allowed host a.test, reaches the site
        assert [g for g in site.got[n:] if g[1] != "GET" and g[0] == "b.test"] == [], name
        assert [g[:3] for g in site.got[n:] if g[1] != "GET" and g[0] == "a.test"] == (
            [("a.test", "POST", "/r307")] if name == "redirect_307" else []), name
        if name in ("form", "redirect_307"):
            assert "sfguard: this write was refused" in await page_text(tab), name
        if name in ("fetch", "xhr"):
            st = await tab.cdp.call("Runtime.evaluate", {"expression": "window.__st",
                                                         "returnByValue": True}, session=tab.session)
            assert st["result"].get("value") == 403, name
    # the redirect's first POST went to the allowed host; nothing reached the guarded one
    assert [g for g in site.writes() if g[0] == "b.test"] == []
    assert {r["decision"] for r in w.logged} == {"write_refused"}


@pytest.mark.browser
async def test_gate_holds_until_approved_then_exactly_once(guarded):
    anchor, site = guarded
    approver = FakeApprover("manual")
    gate(anchor, "gate", approver)
    for name, (script, path) in WAYS.items():
        tab = await fresh_tab(anchor, site)
        n, asked = len(site.got), len(approver.asked)
        await run(tab, script)
        assert await until(lambda asked=asked: len(approver.asked) > asked), f"{name}: not held"
        await asyncio.sleep(1.0)
        assert [g for g in site.got[n:] if g[0] == "b.test" and g[1] != "GET"] == [], name
        held = approver.asked[-1]
        assert (held.host, held.stage_id, held.run_id) == ("b.test", "s1", "run-w")
        assert approver.decide_all(True) == 1, name
        assert await until(lambda n=n: any(g[0] == "b.test" and g[1] != "GET" for g in site.got[n:])), name
        await asyncio.sleep(0.5)
        sent = [g for g in site.got[n:] if g[0] == "b.test" and g[1] != "GET"]
        assert len(sent) == 1, (name, sent)
        assert "sid=logged-in" in sent[0][3], name   # the logged-in session went with it
        if path is not None:
            assert sent[0][2] == path, name


@pytest.mark.browser
@pytest.mark.parametrize("answer", ["deny", "timeout"])
async def test_gate_denied_or_timed_out_sends_nothing(guarded, answer):
    anchor, site = guarded
    approver = FakeApprover("deny" if answer == "deny" else "never")
    gate(anchor, "gate", approver, timeout=1.0)
    for name in ("form", "fetch", "beacon"):
        tab = await fresh_tab(anchor, site)
        n = len(site.got)
        await run(tab, WAYS[name][0])
        assert await until(lambda name=name: bool(approver.asked) and approver.asked[-1].path == WAYS[name][1]), name
        await asyncio.sleep(2.0)
        assert [g for g in site.got[n:] if g[1] != "GET"] == [], name
        if name == "form":
            assert "sfguard: this write was refused" in await page_text(tab)


@pytest.mark.browser
async def test_allow_is_unchanged_and_reads_pass_in_gate(guarded):
    anchor, site = guarded
    gate(anchor, "allow")
    for name, (script, _) in WAYS.items():
        tab = await fresh_tab(anchor, site)
        n = len(site.got)
        await run(tab, script)
        assert await until(lambda n=n: any(g[1] != "GET" for g in site.got[n:])), name


@pytest.mark.browser
async def test_a_retry_of_a_replay_unsafe_stage_is_held_with_what_the_first_attempt_sent(guarded):
    anchor, site = guarded
    # attempt 1 (writes: allow, replay_safe: false) posts the form: it reaches the site
    first = gate(anchor, "allow", replay_unsafe=True)
    tab = await fresh_tab(anchor, site)
    n = len(site.got)
    await run(tab, WAYS["form"][0])
    assert await until(lambda: any(g[1] == "POST" for g in site.got[n:]))
    assert [(r["method"], str(r["url"]).split(":")[-1]) for r in first.released] == [
        ("POST", f"{site.port}/w/form")]
    # attempt 2 of the same stage: the same form is held, showing attempt 1's write
    approver = FakeApprover("manual")
    gate(anchor, "allow", approver, earlier=tuple(first.released))
    tab = await fresh_tab(anchor, site)
    n = len(site.got)
    await run(tab, WAYS["form"][0])
    assert await until(lambda: bool(approver.asked))
    await asyncio.sleep(1.0)
    assert [g for g in site.got[n:] if g[1] != "GET"] == []
    held = approver.asked[-1]
    assert held.why == "replay_unsafe_retry"
    assert [e["url"] for e in held.earlier] == [r["url"] for r in first.released]
    assert held.form == (("msg", "hello"),)
    approver.decide_all(False)
    # a replay-safe stage's retry (no history kept) is not held
    gate(anchor, "allow", FakeApprover("manual"))
    tab = await fresh_tab(anchor, site)
    n = len(site.got)
    await run(tab, WAYS["form"][0])
    assert await until(lambda: any(g[1] == "POST" for g in site.got[n:]))


@pytest.mark.browser
async def test_gets_the_policy_names_writes_are_caught_whatever_the_type(guarded):
    """Reads of an image, a script, a style sheet, a font or a medium are not paused on a gated
    host; a GET the site policy names a write is, whatever the type that sends it."""
    from sfguard.policy import parse_policy
    anchor, site = guarded
    rules = parse_policy('version: 1\nwrites:\n  - pattern: "b.test"\n    reason: "r"\n'
                         '    writes: ["GET /w/out*"]\n').writes
    logged: list[dict] = []
    anchor.pipe.writes = WriteInterceptor(anchor.pipe, WriteContext("run-w", "p", "s1", 1, {"b.test": "deny"}),
                                          rules=rules, record=lambda d, rec: logged.append(rec))
    anchor.pipe.apply_write_patterns()
    tab = await Tab(anchor).open()
    # the proxy's challenges answered first: until then every request pauses (the pipe's proxy
    # authentication), afterwards only what the write gate's patterns name
    err, _ = await tab.load(f"{site.b}/blank")
    assert err is None
    assert await until(lambda: not anchor.pipe.fetch_on)
    err, _ = await tab.load(f"{site.b}/getpage")
    assert err is None
    await run(tab, "fetch('/w/out-fetch').catch(() => 0); setTimeout(() => location.href = '/w/out-nav', 300)")
    assert await until(lambda: {"/w/out-nav"} <= {r["path"] for r in logged})
    await asyncio.sleep(1.0)
    got = {g[2] for g in site.got if g[0] == "b.test"}
    assert {"/getpage", "/read.gif"} <= got                 # the page and its read arrived
    assert {p for p in got if p.startswith("/w/out")} == set()
    assert {r["path"] for r in logged} >= {"/w/out-style", "/w/out-script", "/w/out-font", "/w/out-img",
                                            "/w/out-media", "/w/out-fetch", "/w/out-nav"}
    assert {r["decision"] for r in logged} == {"write_refused"}


@pytest.mark.browser
async def test_the_types_the_gate_pauses_and_those_it_does_not_are_every_type_a_pattern_takes(real_rig):
    """intercept.WRITE_TYPES and GET_ONLY_TYPES together are the resource types the installed
    Chromium's Fetch patterns take, out of the Network.ResourceType of its own protocol: a type
    a later Chromium adds to either fails here, not silently past the write gate."""
    import json
    import os
    import shutil
    import subprocess
    import urllib.request

    from sfguard.supervisor.gate.cdp_pipe import CdpCallError
    from sfguard.supervisor.writes.intercept import GET_ONLY_TYPES, WRITE_TYPES
    browser = shutil.which("chromium")
    assert browser is not None
    # the protocol, from a second browser with a debugging port (its sandbox on, as an
    # unprivileged user when the tests run as root)
    import tempfile
    home = Path(tempfile.mkdtemp(prefix="sfg-protocol-", dir="/tmp"))     # reachable by that user
    data = home / "u"
    data.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:
        os.chown(home, 65534, -1)
        os.chown(data, 65534, -1)
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", f"HOME={home}"]
    proc = subprocess.Popen([*prefix, browser, "--headless", "--remote-debugging-port=0", f"--user-data-dir={data}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = data / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/protocol", timeout=10) as res:
            protocol = json.load(res)
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(home, ignore_errors=True)
    network = next(d for d in protocol["domains"] if d["domain"] == "Network")
    types = next(t["enum"] for t in network["types"] if t["id"] == "ResourceType")
    # which of them a Fetch pattern takes, asked of the guard's own kind of browser
    anchor = await real_rig.host.launch_anchor(real_rig.spec(None))
    taken = []
    try:
        for t in types:
            try:
                await anchor.pipe.call("Fetch.enable", {"patterns": [{"urlPattern": "http://x.invalid/*",
                                                                      "resourceType": t}]})
                taken.append(t)
            except CdpCallError:
                pass
        await anchor.pipe.call("Fetch.disable")
    finally:
        await real_rig.host.close_anchor(anchor)
    assert sorted(WRITE_TYPES + GET_ONLY_TYPES) == sorted(taken)
    assert not set(WRITE_TYPES) & set(GET_ONLY_TYPES)


@pytest.mark.browser
async def test_patterns_the_browser_refuses_leave_every_request_paused(guarded, monkeypatch):
    """A Fetch.enable the browser refuses would leave the patterns before it in force (here:
    none): the pipe pauses every request instead, so the write gate still judges each."""
    anchor, site = guarded
    monkeypatch.setattr(WriteInterceptor, "patterns",
                        lambda self: [{"urlPattern": "*", "resourceType": "TextTrack"}])   # refused
    w = gate(anchor, "deny")
    tab = await fresh_tab(anchor, site)
    n = len(site.got)
    await run(tab, WAYS["fetch"][0])
    assert await until(lambda: bool(w.logged))
    await asyncio.sleep(1.0)
    assert [g for g in site.got[n:] if g[1] != "GET"] == []
    assert {r["decision"] for r in w.logged} == {"write_refused"}


@pytest.mark.browser
async def test_a_write_filed_under_a_type_the_gate_does_not_pause_is_refused_by_the_browser(real_rig):
    """A renderer a page took over chooses the type of its requests: a POST filed as an image
    passes the write gate's Fetch patterns, so the extension's GET_ONLY_RULE must refuse it. No
    page can send one, so the browser's own rule matcher is asked, for every browser's rules."""
    from sfguard.supervisor.writes.websockets import GET_ONLY_RULE_ID
    anchor = await real_rig.host.launch_anchor(real_rig.spec(None))
    try:
        gate_ = anchor.pipe.websockets
        for rtype in ("image", "script", "stylesheet", "font", "media"):
            for method in ("post", "put", "delete", "patch", "options"):
                assert await gate_.matched("https://b.test/w/x", rtype, method) == [GET_ONLY_RULE_ID], (rtype, method)
            for method in ("get", "head"):
                assert await gate_.matched("https://b.test/x.png", rtype, method) == [], (rtype, method)
        # the types the gate pauses are left to it
        for rtype in ("main_frame", "sub_frame", "xmlhttprequest", "ping", "csp_report", "other"):
            assert await gate_.matched("https://b.test/w/x", rtype, "post") == [], rtype
    finally:
        await real_rig.host.close_anchor(anchor)


@pytest.mark.browser
async def test_a_write_held_while_the_gate_loosens_still_waits_for_its_person(guarded):
    """When every host's mode turns to allow (a stage that gated it ended, a floor loosened by a
    live edit) while a write is held, the held write is not let go: turning interception off
    (Fetch.disable) would send it unapproved (measured), so the pipe keeps interception on,
    naming nothing, until no write is held."""
    anchor, site = guarded
    approver = FakeApprover("manual")
    w = gate(anchor, "gate", approver)
    tab = await fresh_tab(anchor, site)
    n = len(site.got)
    await run(tab, WAYS["fetch"][0])
    assert await until(lambda: bool(approver.asked))
    w.set_modes({"a.test": "allow", "b.test": "allow"})
    anchor.pipe.apply_write_patterns()
    await asyncio.sleep(2.0)
    assert [g for g in site.got[n:] if g[1] != "GET"] == []        # still held
    assert approver.decide_all(False) == 1
    await asyncio.sleep(1.0)
    assert [g for g in site.got[n:] if g[1] != "GET"] == []        # denied: never sent
    # no write held any more: interception is off, a write to b.test (now allow) is sent
    await run(tab, WAYS["xhr"][0])
    assert await until(lambda: any(g[1] == "PUT" for g in site.got[n:]))
