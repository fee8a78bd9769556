"""Console sessions keep to their scope, and what they opened ends with them (issue 30,
sections 1 and 2; issue 35, section 4), against a real `sfguard start` with the fake browser:

* every route of the console's router, with a console session, this handoff's live session,
  another handoff's live session, another guard's console session, a signed-out session and
  none, each under both cookie names: only the right scope gets through (a new route is in
  the table by itself, as a console-only route); on loopback, and over TLS at the console's
  public URL (issue 46);
* an `/events` stream and a live-view socket end within a second of their session ending:
  sign-out, the handoff's end, expiry, the guard's stop; `/events` with a foreign Origin is
  refused;
* sign-in, live-view sign-in, live-view opened, sign-out and refused links are in the audit
  chain, in the order they happened, with no token or cookie value."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import aiohttp
import pytest

from sfguard.supervisor.console.server import CONSOLE_COOKIE, LIVE_COOKIE, ConsoleServer
from sfguard.supervisor.profiles.audit import LOG_FILE
from tests.console.conftest import ROOT, connect, fake_guards, link
from tests.daemon.fake_cdp import FakeCdp

#: routes that take no session: the sign-in link and the page's own scripts and styles
PUBLIC = {("GET", "/login"), ("GET", "/static/{name}")}
END_WITHIN = 1.0


def routes() -> list[tuple[str, str]]:
    """(method, path pattern) of every console route, from the app's own router. HEAD routes
    run their GET twin's handler (checked here), so the GET stands for both."""
    app = ConsoleServer(None).app()
    out, handlers = [], {}
    for r in app.router.routes():
        path = r.resource.canonical if r.resource is not None else ""
        handlers[(r.method, path)] = r.handler
    for (method, path), handler in sorted(handlers.items()):
        if method == "HEAD":
            assert handlers.get(("GET", path)) is handler, path
            continue
        out.append((method, path))
    assert ("GET", "/") in out and ("GET", "/live/{hid}/ws") in out and len(out) >= 10, out
    return out


# -- speaking to the console ---------------------------------------------------------------------
def request(base: str, method: str, path: str, *, cookie: str | None = None,
            origin: str | None = None, body: str | None = None, ws: bool = False,
            stream: bool = False) -> tuple[int, str]:
    """(status, body) of one request; a stream or a socket upgrade is closed after its head."""
    conn = connect(base)
    headers = {"Accept": "text/event-stream" if stream else "text/html"}
    if cookie:
        headers["Cookie"] = cookie
    if origin:
        headers["Origin"] = origin
    if ws:
        headers.update({"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode()})
    if body is not None:
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        if r.status == 101 or (stream and r.status == 200):
            return r.status, ""
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def redeem(base: str, url: str) -> str:
    """Use a one-time link; the cookie's value."""
    u = urlsplit(url)
    conn = connect(base)
    conn.request("GET", f"{u.path}?{u.query}")
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status == 200, r.status
    m = re.match(r"(sfguard_console|sfguard_live)=([^;]+);", r.headers.get("Set-Cookie") or "")
    assert m, r.headers
    return m.group(2)


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, html[:500]
    return m.group(1)


def open_handoff(d, run_id: str, profile: str) -> dict:
    assert d.call("POST", "/v1/runs", {"run_id": run_id})[0] == 201
    status, ans = d.call("POST", f"/v1/runs/{run_id}/stages", {
        "stage_id": "login", "attempt": 1,
        "browser": {"profile": profile, "headed": False, "allow_domains": ["site-a.test"]}})
    assert status == 200, ans
    status, payload = d.call("POST", f"/v1/runs/{run_id}/handoff", {
        "profile": profile, "site": "site-a.test", "reason": "sign in",
        "url": "http://site-a.test/login", "kind": "live_view", "stage_id": "login"})
    assert status == 200 and payload["kind"] == "live_view", payload
    return {"url": payload["url"], "hid": urlsplit(payload["url"]).path.split("/")[2]}


@pytest.fixture(scope="module")
def shared_fake(tmp_path_factory):
    """One fake-browser guard for this module's tests that neither stop it nor need a flag."""
    cdp = FakeCdp()
    cdp.start()
    try:
        with fake_guards(tmp_path_factory.mktemp("scope"), cdp) as start:
            yield start()
    finally:
        cdp.stop()


@pytest.fixture(params=["loopback", "tls-public-url"])
def any_console(request):
    """The walk below runs on the console as it comes (loopback, plain HTTP) and over TLS at
    its public URL; `.other` is the other guard (its sessions are no good here)."""
    names = ("shared_fake", "shared_tls") if request.param == "loopback" else ("shared_tls", "shared_fake")
    d, other = (request.getfixturevalue(n) for n in names)
    assert d.console.startswith("https://console.test:" if request.param != "loopback" else "http://127.0.0.1:")
    d.other = other
    return d


# -- 1. every route, every session, both cookie names ----------------------------------------------
NO_APPROVAL = "ap_" + "0" * 20
NO_SHOT = "99999.jpg"
#: what each route variable is in the walk: this handoff's id (below), an approval and a
#: screenshot that do not exist, the run, stage and browser of the handoff (issue 48)
VARIABLES = {"aid": NO_APPROVAL, "shot": NO_SHOT, "rid": "scope-a", "sid": "login", "bkey": "acct-a"}


def test_every_console_route_takes_only_its_own_scope(any_console):
    d = any_console
    base = d.console
    a, b = open_handoff(d, "scope-a", "acct-a"), open_handoff(d, "scope-b", "acct-b")
    sessions = {"console": redeem(base, link(d)), "live": redeem(base, a["url"]),
                "other-live": redeem(base, b["url"]),
                "other-guard": redeem(d.other.console, link(d.other)),     # another guard's console session
                "signed-out": signed_out(d)}
    # what each route answers to a session it takes: a page 200, a stream 200, a socket 101;
    # a POST without its CSRF token 403 (past the session check; with it, it would act)
    cases, answers = [], []
    for method, pattern in routes():
        if (method, pattern) in PUBLIC:
            continue
        names = set(re.findall(r"{(\w+)}", pattern))
        assert names <= {"hid", *VARIABLES}, f"a new route variable in {pattern}: add it to this table"
        path = pattern.replace("{hid}", a["hid"])
        for name, value in VARIABLES.items():
            path = path.replace("{" + name + "}", value)
        live_route = pattern.startswith("/live/{hid}")
        ok = 403 if method == "POST" else 101 if path.endswith("/ws") else 200
        if ("{aid}" in pattern or "{shot}" in pattern) and method == "GET":
            ok = 404           # past the session check: no such approval, no such screenshot
        for who in ("console", "live", "other-live", "other-guard", "signed-out", None):
            for name in (CONSOLE_COOKIE, LIVE_COOKIE) if who else (None,):
                right = (who == "console" and name == CONSOLE_COOKIE) or \
                        (live_route and who == "live" and name == LIVE_COOKIE)
                cases.append((method, path, who, name, ok if right else 401))
    for method, path, who, name, _want in cases:
        cookie = f"{name}={sessions[who]}" if who else None
        got, _ = request(base, method, path, cookie=cookie, origin=base,
                         body="csrf=wrong" if method == "POST" else None,
                         ws=path.endswith("/ws"), stream=path == "/events")
        answers.append(got)
    wrong = [(case, got) for case, got in zip(cases, answers, strict=True) if case[4] != got]
    assert wrong == [], f"(method, path, session, cookie name, wanted) -> got: {wrong}"
    # and the right scope with its CSRF token acts: this handoff's Cancel with its own live
    # session, the other's Done with the console session, then sign-out
    live_csrf = csrf_of(request(base, "GET", f"/live/{a['hid']}", cookie=f"{LIVE_COOKIE}={sessions['live']}")[1])
    console_cookie = f"{CONSOLE_COOKIE}={sessions['console']}"
    console_csrf = csrf_of(request(base, "GET", "/", cookie=console_cookie)[1])
    assert request(base, "POST", f"/live/{a['hid']}/cancel", cookie=f"{LIVE_COOKIE}={sessions['live']}",
                   origin=base, body=f"csrf={live_csrf}")[0] == 200
    assert request(base, "POST", f"/live/{b['hid']}/done", cookie=console_cookie, origin=base,
                   body=f"csrf={console_csrf}")[0] == 200
    assert request(base, "POST", "/logout", cookie=console_cookie, origin=base,
                   body=f"csrf={console_csrf}")[0] == 200
    for name, value in sessions.items():       # every session is dead now
        for cookie_name in (CONSOLE_COOKIE, LIVE_COOKIE):
            assert request(base, "GET", f"/live/{a['hid']}", cookie=f"{cookie_name}={value}")[0] in (401, 410)
            assert request(base, "GET", "/", cookie=f"{cookie_name}={value}")[0] == 401, name


def signed_out(d) -> str:
    """The cookie value of a console session that has ended (signed out: the guard forgets it,
    as it does an expired one)."""
    value = redeem(d.console, link(d))
    cookie = f"{CONSOLE_COOKIE}={value}"
    csrf = csrf_of(request(d.console, "GET", "/", cookie=cookie)[1])
    assert request(d.console, "POST", "/logout", cookie=cookie, origin=d.console, body=f"csrf={csrf}")[0] == 200
    return value


# -- 2. streams end with their session --------------------------------------------------------------
class Stream:
    """An open `/events` stream read on a raw socket: `ended_after(seconds)` says whether the
    guard closed it within that time."""

    def __init__(self, base: str, cookie: str, origin: str | None = None):
        u = urlsplit(base)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=10)
        extra = f"Origin: {origin}\r\n" if origin else ""
        self.sock.sendall((f"GET /events?page=overview HTTP/1.1\r\nHost: {u.netloc}\r\n"
                           f"Accept: text/event-stream\r\nCookie: {cookie}\r\n{extra}\r\n").encode())
        self.data = b""
        while b"\r\n\r\n" not in self.data:
            self.data += self._recv()
        self.status = int(self.data.split(b" ", 2)[1])
        if self.status == 200:
            while b"event: update" not in self.data:       # the first fragment
                self.data += self._recv()

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        assert chunk, self.data
        return chunk

    def ended_after(self, limit: float) -> float | None:
        """Seconds until the stream ended, or None when it still ran after `limit`."""
        t0 = time.monotonic()
        self.sock.settimeout(0.1)
        while time.monotonic() - t0 < limit:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return time.monotonic() - t0
            self.data += chunk
            if not chunk or self.data.endswith(b"0\r\n\r\n"):      # closed, or its last chunk
                return time.monotonic() - t0
        return None

    def close(self) -> None:
        self.sock.close()


def console_session(d) -> tuple[str, str]:
    """A signed-in console session: (Cookie header, CSRF token)."""
    cookie = f"{CONSOLE_COOKIE}={redeem(d.console, link(d))}"
    return cookie, csrf_of(request(d.console, "GET", "/", cookie=cookie)[1])


async def live_socket(base: str, hid: str,
                      cookie: str) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
    s = aiohttp.ClientSession()
    ws = await s.ws_connect(f"{base}/live/{hid}/ws", headers={"Cookie": cookie, "Origin": base})
    return s, ws


async def socket_end(ws: aiohttp.ClientWebSocketResponse, limit: float) -> tuple[float | None, list]:
    """Seconds until the guard closed the socket (None: still open after `limit`), and the
    text messages it sent meanwhile."""
    t0, texts = time.monotonic(), []
    try:
        async with asyncio.timeout(limit):
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    texts.append(json.loads(msg.data))
    except TimeoutError:
        return None, texts
    return time.monotonic() - t0, texts


async def drain(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Read what the guard sent on opening (state), so that what follows is news."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            async for _ in ws:
                pass


def test_a_stream_and_a_socket_end_within_a_second_of_sign_out(shared_fake):
    d = shared_fake
    base = d.console
    h = open_handoff(d, "so-1", "acct-so")
    cookie, csrf = console_session(d)
    other, _ = console_session(d)
    stream, bystander = Stream(base, cookie), Stream(base, other)

    async def go() -> tuple[float | None, list, float | None]:
        s, ws = await live_socket(base, h["hid"], cookie)      # the operator watches the live view
        try:
            await drain(ws)
            assert request(base, "POST", "/logout", cookie=cookie, origin=base, body=f"csrf={csrf}")[0] == 200
            ended, texts = await socket_end(ws, END_WITHIN)
            return stream.ended_after(END_WITHIN), texts, ended
        finally:
            await s.close()

    try:
        stream_ended, texts, socket_ended = asyncio.run(go())
        assert stream_ended is not None, "the /events stream outlived the sign-out"
        assert b"event: ended" in stream.data
        assert socket_ended is not None, "the live-view socket outlived the sign-out"
        assert texts[-1:] == [{"t": "ended", "state": "signed_out"}], texts
        # another session's stream goes on; a run created now is not sent to the ended one
        assert bystander.ended_after(0.3) is None
        assert d.call("POST", "/v1/runs", {"run_id": "after-logout"})[0] == 201
        t0 = time.monotonic()
        while b"after-logout" not in bystander.data and time.monotonic() - t0 < 5:
            bystander.ended_after(0.2)
        assert b"after-logout" in bystander.data and b"after-logout" not in stream.data
    finally:
        stream.close()
        bystander.close()


def test_a_live_session_and_its_socket_end_with_the_handoff(shared_fake):
    d = shared_fake
    base = d.console
    h = open_handoff(d, "he-1", "acct-he")
    live = f"{LIVE_COOKIE}={redeem(base, h['url'])}"
    # a live session opens no console stream at all (section 1), only its socket
    assert request(base, "GET", "/events?page=overview", cookie=f"{CONSOLE_COOKIE}={live.split('=', 1)[1]}",
                   stream=True)[0] == 401

    async def go() -> tuple[float | None, list]:
        s, ws = await live_socket(base, h["hid"], live)
        try:
            await drain(ws)
            # the run's stage ends: the guard ends its handoff, the live session, the socket
            assert d.call("POST", "/v1/runs/he-1/stages/login/end", {"outcome": "succeeded"})[0] == 200
            return await socket_end(ws, END_WITHIN)
        finally:
            await s.close()

    ended, texts = asyncio.run(go())
    assert ended is not None, "the live-view socket outlived its handoff"
    assert texts[-1:] == [{"t": "ended", "state": "ended"}], texts
    assert request(base, "GET", f"/live/{h['hid']}", cookie=live)[0] in (401, 410)


def test_a_stream_and_a_socket_end_within_a_second_of_expiry(fake_guard):
    life = 4
    d = fake_guard("--console-session", str(life))
    base = d.console
    h = open_handoff(d, "ex-1", "acct")
    url = link(d)
    t0 = time.monotonic()
    cookie = f"{CONSOLE_COOKIE}={redeem(base, url)}"
    stream = Stream(base, cookie)

    async def go() -> tuple[float | None, list]:
        s, ws = await live_socket(base, h["hid"], cookie)
        try:
            await drain(ws)
            ended, texts = await socket_end(ws, life + END_WITHIN - (time.monotonic() - t0))
            return (None if ended is None else time.monotonic() - t0), texts
        finally:
            await s.close()

    try:
        socket_at, texts = asyncio.run(go())
        assert socket_at is not None and socket_at >= life - 0.5, socket_at
        assert texts[-1:] == [{"t": "ended", "state": "signed_out"}], texts
        ended = stream.ended_after(max(0.3, life + END_WITHIN - (time.monotonic() - t0)))
        assert ended is not None, "the /events stream outlived its session's expiry"
        assert request(base, "GET", "/", cookie=cookie)[0] == 401
    finally:
        stream.close()


def test_a_stream_ends_within_a_second_of_the_guard_stopping(fake_guard):
    d = fake_guard()
    cookie, _ = console_session(d)
    stream = Stream(d.console, cookie)
    try:
        d.proc.send_signal(signal.SIGTERM)
        assert stream.ended_after(END_WITHIN) is not None, "the /events stream outlived the guard's stop"
    finally:
        stream.close()
    assert d.proc.wait(60) == 0


@pytest.mark.parametrize("origin,want", [
    ("http://evil.test", 403),
    ("http://127.0.0.1:1", 403),          # another port of this machine: same site, not same origin
    ("null", 403),                        # a sandboxed frame, a data: page
    (None, 200),                          # the console's own page (a same-origin GET has none)
    ("own", 200),
])
def test_events_refuses_a_foreign_origin(shared_fake, origin, want):
    d = shared_fake
    cookie, _ = console_session(d)
    stream = Stream(d.console, cookie, origin=d.console if origin == "own" else origin)
    try:
        assert stream.status == want, stream.data[:200]
        if want != 200:
            assert b"update" not in stream.data
    finally:
        stream.close()


# -- 3. console sessions in the audit chain -------------------------------------------------------------
def test_console_sessions_are_audited_in_order_without_secrets(fake_guard):
    d = fake_guard()
    base = d.console
    url = link(d)
    cookie_value = redeem(base, url)
    cookie = f"{CONSOLE_COOKIE}={cookie_value}"
    csrf = csrf_of(request(base, "GET", "/", cookie=cookie)[1])
    h = open_handoff(d, "au-1", "acct")
    live_value = redeem(base, h["url"])
    assert request(base, "GET", f"/live/{h['hid']}", cookie=f"{LIVE_COOKIE}={live_value}")[0] == 200
    for bad in (url, f"{base}/login?t=made-up", h["url"]):        # used, unknown, used
        u = urlsplit(bad)
        assert request(base, "GET", f"{u.path}?{u.query}")[0] == 401
    assert request(base, "POST", "/logout", cookie=cookie, origin=base, body=f"csrf={csrf}")[0] == 200
    assert d.stop() == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "show", "--json",
                        "--home", str(d.home)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    mine = [(x["event"], x["fields"]) for x in records
            if x["event"].startswith(("console_", "handoff_"))]
    signed_in = [f for e, f in mine if e == "console_signed_in"]
    assert [f["mode"] for f in signed_in] == ["console", "live_view"], mine
    console_id, live_id = signed_in[0]["by"], signed_in[1]["by"]
    assert re.fullmatch(r"s-[0-9a-f]{8}", console_id) and console_id != live_id
    assert signed_in[1]["run"] == "au-1" and signed_in[1]["profile"] == "acct"
    order = [(e, f.get("by")) for e, f in mine if e != "console_sign_in_refused"]
    assert order[:5] == [("console_signed_in", console_id), ("handoff_opened", None),
                         ("console_signed_in", live_id), ("handoff_viewed", live_id),
                         ("console_signed_out", console_id)], order
    assert sum(f["count"] for e, f in mine if e == "console_sign_in_refused") == 3, mine
    # the chain verifies, and no link token or cookie value is in it
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "verify",
                        "--home", str(d.home)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (d.home / LOG_FILE).read_text()
    for secret in (cookie_value, live_value, url.split("t=")[1], h["url"].split("t=")[1]):
        assert secret not in text
