"""WebSocket upgrades under write gates, through a real `sfguard start`, Chromium and
agent-browser (issue 32): a page's `new WebSocket(...)`, from the page and from a dedicated
Worker, over ws:// and wss://, to a host whose effective write mode is `deny` or `gate` is refused
in the browser before the site sees the handshake (the page's socket fails, the site's own record
shows no upgrade, the decision log has `write_refused` / `websocket_upgrade`); an `allow` host's
socket opens and echoes; a live edit of the site policy's `writes:` floor refuses the next one.

The site (aiohttp on 127.0.0.1, in this process) serves the same page over HTTP and HTTPS (one
certificate per name, chosen by SNI, from an authority given to the guard with --ca-file)."""
from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
import uuid

import pytest
from aiohttp import web

from sfguard.supervisor.browsers import trust
from tests.conftest import free_port
from tests.tls_site import issue, make_ca

from .conftest import ROOT, Daemon
from .test_real_browser import as_stage
from .test_real_site_features import result_of

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(trust.certutil() is None, reason="certutil comes with ./dev setup (libnss3-tools)")]

HOSTS = ("deny.test", "gate.test", "allow.test")
PAGE = """<html><body><p>websocket page</p><script>
function tryWs(u) {
  return new Promise((res) => {
    let ws; try { ws = new WebSocket(u); } catch (e) { res('throw'); return; }
    ws.onopen = () => ws.send('ping');
    ws.onmessage = (e) => { res('echo:' + e.data); ws.close(); };
    ws.onerror = () => res('error');
    ws.onclose = (e) => res('close:' + e.code);
    setTimeout(() => res('timeout'), 8000);
  });
}
const base = (location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/echo?tag=';
const tag = new URLSearchParams(location.search).get('tag');
const worker = new Worker('/worker.js');
const fromWorker = new Promise((res) => { worker.onmessage = (e) => res(e.data); });
worker.postMessage(base + 'worker-' + tag);
// a service worker (a secure context only: over https)
const fromSw = !window.isSecureContext ? Promise.resolve('none') :
  navigator.serviceWorker.register('/sw.js').then(() => navigator.serviceWorker.ready).then((reg) =>
    new Promise((res) => {
      navigator.serviceWorker.onmessage = (e) => res(e.data);
      reg.active.postMessage(base + 'sw-' + tag);
    }), (e) => 'register-failed');
// a shared worker (none in a guarded browser: `SharedWorker` is not there)
const fromShared = typeof SharedWorker === 'undefined' ? Promise.resolve('none') : new Promise((res) => {
  const shared = new SharedWorker('/shared.js');
  shared.port.onmessage = (e) => res(e.data);
  shared.port.postMessage(base + 'shared-' + tag);
});
window.__parts = {};     // each part as it ends (a failure message shows which one hangs)
const part = (name, p) => p.then((r) => { window.__parts[name] = r; return r; });
Promise.all([part('page', tryWs(base + 'page-' + tag)), part('worker', fromWorker), part('sw', fromSw),
             part('shared', fromShared)])
  .then(([a, b, c, d]) => { window.__result = 'page=' + a + ';worker=' + b + ';sw=' + c + ';shared=' + d; });
</script></body></html>"""
TRY_WS = PAGE.split("<script>")[1].split("const base")[0]
WORKER = TRY_WS + "onmessage = (e) => { tryWs(e.data).then((r) => postMessage(r)); };\n"
SHARED_WORKER = TRY_WS + ("onconnect = (c) => { const p = c.ports[0]; "
                          "p.onmessage = (e) => { tryWs(e.data).then((r) => p.postMessage(r)); }; };\n")
SERVICE_WORKER = TRY_WS + """self.addEventListener('install', () => self.skipWaiting());
self.addEventListener('activate', (e) => e.waitUntil(self.clients.claim()));
self.addEventListener('message', (e) => e.waitUntil(tryWs(e.data).then((r) => e.source.postMessage(r))));
"""


class Site:
    """HTTP and HTTPS on loopback; `seen` is every request it received (host, path, query, upgrade)."""

    def __init__(self, tmp) -> None:
        self.ca = make_ca("sfguard websocket authority")
        self.contexts = {}
        for host in HOSTS:
            cert, key = issue(self.ca, host, tmp)
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(cert, key)
            self.contexts[host] = ctx
        self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.tls.load_cert_chain(*issue(self.ca, "deny.test", tmp))
        self.tls.sni_callback = self._sni
        self.seen: list[dict] = []
        self.http_port, self.https_port = free_port(), free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(20)

    def _sni(self, sock, name, _ctx) -> None:
        if name in self.contexts:
            sock.context = self.contexts[name]

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/page", self._page)
        app.router.add_get("/worker.js", self._worker)
        app.router.add_get("/sw.js", self._worker)
        app.router.add_get("/shared.js", self._worker)
        app.router.add_get("/echo", self._echo)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        for port, tls in ((self.http_port, None), (self.https_port, self.tls)):
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=tls).start())
        self.ready.set()
        self.loop.run_forever()

    def _note(self, request: web.Request) -> None:
        self.seen.append({"host": request.host.split(":")[0], "path": request.path, "tag": request.query.get("tag"),
                          "upgrade": request.headers.get("Upgrade", "").lower(),
                          "cookie": "sid" in request.cookies})

    async def _page(self, request: web.Request) -> web.Response:
        self._note(request)
        resp = web.Response(text=PAGE, content_type="text/html")
        resp.set_cookie("sid", "session-secret", samesite="Lax")
        return resp

    async def _worker(self, request: web.Request) -> web.Response:
        self._note(request)
        text = {"/sw.js": SERVICE_WORKER, "/shared.js": SHARED_WORKER}.get(request.path, WORKER)
        return web.Response(text=text, content_type="text/javascript")

    async def _echo(self, request: web.Request) -> web.WebSocketResponse:
        self._note(request)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_str("pong:" + msg.data)
        return ws

    def upgrades(self, tag: str, where=("page", "worker", "sw", "shared")) -> list[dict]:
        return [s for s in list(self.seen) if s["path"] == "/echo" and s["tag"] in {f"{w}-{tag}" for w in where}]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """(guard, site, policy file, {mode: stage env}) with one stage per mode on one browser."""
    import os
    tmp = tmp_path_factory.mktemp("wsgate")
    site = Site(tmp)
    home = (tmp / "home").absolute()
    pol = tmp / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site.http_port}, {site.https_port}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp / "daemon.log")
    resolve = [a for h in HOSTS for a in ("--resolve", f"{h}=127.0.0.1")]
    d.start("--policy", str(pol), "--ca-file", str(site.ca.write(tmp / "ca.pem")), *resolve)
    try:
        assert d.call("POST", "/v1/runs", {"run_id": "ws1"})[0] == 201
        envs = {}
        for mode, host in zip(("deny", "gate", "allow"), HOSTS, strict=True):
            body = {"stage_id": f"s-{mode}", "attempt": 1, "browser": {
                "profile": "acct", "headed": False, "allow_domains": [host], "writes": mode}}
            status, answer = d.call("POST", "/v1/runs/ws1/stages", body)
            assert status == 200, answer
            assert answer["writes"] == {host: mode}
            envs[mode] = answer["env"]
        yield d, site, pol, envs
    finally:
        d.finish()
        site.close()


def sockets_of(env: dict, url: str, bound: float = 20.0) -> str:
    """Open `url` as the stage and wait (bounded) for the page's window.__result; on a timeout,
    the parts that did end (a failure message shows which one hangs)."""
    got = result_of(env, url, bound)
    if got:
        return got
    parts = as_stage(env, "eval", "JSON.stringify(window.__parts ?? null)").stdout.strip()
    return f"timeout={parts[:300]}"


def origin(site: Site, host: str, scheme: str) -> str:
    return f"{scheme}://{host}:{site.https_port if scheme == 'https' else site.http_port}"


def refusals(d: Daemon) -> list[dict]:
    lines = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    return [x for x in lines if x.get("decision") == "write_refused" and x.get("reason") == "websocket_upgrade"]


def results(got: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in got.split(";")) if got else {}


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_deny_and_gate_hosts_refuse_websocket_upgrades_allow_echoes(guarded, scheme):
    """Pages and dedicated workers: the upgrade is refused in the browser process (one decision
    line each). Service and shared workers: test_a_service_or_shared_workers_websocket_... below."""
    d, site, _, envs = guarded
    where = ("page", "worker")
    for mode, host in zip(("deny", "gate", "allow"), HOSTS, strict=True):
        tag = uuid.uuid4().hex[:10]
        before = len([r for r in refusals(d) if r["host"] == host])
        got = results(sockets_of(envs[mode], f"{origin(site, host, scheme)}/page?tag={tag}"))
        page = [s for s in site.seen if s["path"] == "/page" and s["tag"] == tag]
        assert page and page[0]["host"] == host, (mode, site.seen[-5:])     # the page itself loaded
        if scheme == "http":
            assert got.get("sw") == "none", got           # a service worker needs https
        if mode == "allow":
            assert {w: got.get(w) for w in where} == {w: "echo:pong:ping" for w in where}, (scheme, got)
            ups = site.upgrades(tag, where)
            assert len(ups) == len(where) and all(u["upgrade"] == "websocket" and u["cookie"] for u in ups), ups
        else:
            assert all(got.get(w) in ("error", "close:1006") for w in where), (scheme, mode, got)
            time.sleep(0.5)
            assert site.upgrades(tag, where) == [], (scheme, mode, site.upgrades(tag))    # the site saw nothing
            deadline = time.monotonic() + 10           # one line for each refused handshake
            while time.monotonic() < deadline and len([r for r in refusals(d) if r["host"] == host]) \
                    < before + len(where):
                time.sleep(0.2)
            mine = [r for r in refusals(d) if r["host"] == host]
            assert len(mine) == before + len(where), mine
            assert all(r["method"] == "GET" and r["run"] == "ws1" and r["client"] == f"writes:s-{mode}"
                       for r in mine), mine
            assert tag not in json.dumps(mine)                   # no query value in the log
    assert not [r for r in refusals(d) if r["host"] == "allow.test"]


@pytest.mark.parametrize("mode", ["deny", "allow"])
def test_no_service_or_shared_worker_runs_so_none_opens_a_websocket(guarded, mode):
    """declarativeNetRequest does not see a WebSocket that a service or shared worker opens: a
    guarded browser has neither, on every host (a host's mode may turn to gate later). The
    service worker's registration is refused before its script leaves the browser; the shared
    worker's constructor is not there. The page and its dedicated worker are as before."""
    _, site, _, envs = guarded
    host = f"{mode}.test"
    tag = uuid.uuid4().hex[:10]
    scripts = len([s for s in site.seen if s["path"] in ("/sw.js", "/shared.js")])
    got = results(sockets_of(envs[mode], f"{origin(site, host, 'https')}/page?tag={tag}"))
    assert got.get("sw") == "register-failed" and got.get("shared") == "none", got
    expected = "echo:pong:ping" if mode == "allow" else None
    assert (got["page"] == expected) if expected else got["page"] in ("error", "close:1006"), got
    time.sleep(0.5)
    assert site.upgrades(tag, ("sw", "shared")) == []
    assert len([s for s in site.seen if s["path"] in ("/sw.js", "/shared.js")]) == scripts   # never fetched
    r = as_stage(envs[mode], "eval", "typeof SharedWorker + '/' + typeof Worker")
    assert r.stdout.strip().strip('"') == "undefined/function", r.stdout


def test_a_popup_opens_in_a_guarded_browser(guarded):
    """window.open in a browser whose WebSocket gate is loaded answers at once (a browser-level
    auto-attach, tried for the workers above, made it hang its opener)."""
    _, site, _, envs = guarded
    assert as_stage(envs["deny"], "open", f"{origin(site, 'deny.test', 'http')}/page?tag=popup").returncode == 0
    started = time.monotonic()
    r = as_stage(envs["deny"], "eval", "String(!!window.open(location.href.replace('popup', 'popup2'), 'w2'))")
    assert r.returncode == 0 and "true" in r.stdout, (r.stdout, r.stderr)
    assert time.monotonic() - started < 10


def test_a_live_floor_of_gate_refuses_the_next_websocket(guarded):
    d, site, pol, envs = guarded
    url = f"{origin(site, 'allow.test', 'https')}/page?tag="
    tag = uuid.uuid4().hex[:10]
    assert sockets_of(envs["allow"], url + tag).startswith("page=echo:pong:ping")
    pol.write_text(pol.read_text() + 'writes:\n  - pattern: "allow.test"\n    mode: gate\n    reason: "live edit"\n')
    deadline = time.monotonic() + 30
    got = ""
    while time.monotonic() < deadline:
        tag = uuid.uuid4().hex[:10]
        got = sockets_of(envs["allow"], url + tag)
        if not got.startswith("page=echo"):
            break
        time.sleep(0.5)
    assert results(got)["page"] in ("error", "close:1006") and results(got)["worker"] in ("error", "close:1006"), got
    time.sleep(0.5)
    assert site.upgrades(tag, ("page", "worker")) == []
    assert [r for r in refusals(d) if r["host"] == "allow.test"]


def test_the_next_run_on_the_sealed_profile_gets_the_gate_again(guarded):
    d, site, pol, _ = guarded
    pol.write_text(pol.read_text().split("writes:")[0])       # the live floor goes again
    assert d.call("POST", "/v1/runs/ws1/end", {"outcome": "succeeded"})[0] == 200
    assert d.call("POST", "/v1/runs", {"run_id": "ws2"})[0] == 201
    envs = {}
    for mode, host in (("deny", "deny.test"), ("allow", "allow.test")):
        body = {"stage_id": f"t-{mode}", "attempt": 1, "browser": {
            "profile": "acct", "headed": False, "allow_domains": [host], "writes": mode}}
        status, answer = d.call("POST", "/v1/runs/ws2/stages", body)
        assert status == 200 and answer["writes"] == {host: mode}, answer
        envs[mode] = answer["env"]
    tag = uuid.uuid4().hex[:10]
    got = results(sockets_of(envs["deny"], f"{origin(site, 'deny.test', 'http')}/page?tag={tag}"))
    assert got["page"] in ("error", "close:1006") and got["worker"] in ("error", "close:1006"), got
    assert site.upgrades(tag, ("page", "worker")) == []
    tag = uuid.uuid4().hex[:10]
    got = results(sockets_of(envs["allow"], f"{origin(site, 'allow.test', 'http')}/page?tag={tag}"))
    assert got["page"] == got["worker"] == "echo:pong:ping" and got["sw"] == "none", got
    # the https origin of the first run: its page works, and still no service worker
    tag = uuid.uuid4().hex[:10]
    got = results(sockets_of(envs["allow"], f"{origin(site, 'allow.test', 'https')}/page?tag={tag}"))
    assert got.get("page") == "echo:pong:ping" and got.get("sw") == "register-failed", got
    assert d.call("POST", "/v1/runs/ws2/end", {"outcome": "succeeded"})[0] == 200
