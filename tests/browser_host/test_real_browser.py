"""Properties only the real Chromium + agent-browser can show: the login cookie survives a
close/relaunch of the same profile, and the anchor's traffic (loopback included) goes through
the run's proxy with the run's credential, answered by the guard over the DevTools pipe.
The anchor is driven the way stages drive it: an agent-browser session through the CDP gate."""
from __future__ import annotations

import asyncio
import base64
import json

import psutil
import pytest

from sfguard.supervisor.browsers import agent_browser as ab
from sfguard.supervisor.procs import scan_orphans

pytestmark = pytest.mark.browser


async def login(env, binary, site):
    await ab.run_ok(env, "open", site + "/login", binary=binary)
    await ab.run_ok(env, "fill", "input[name=user]", "operator", binary=binary)
    await ab.run_ok(env, "fill", "input[name=password]", "correct-horse", binary=binary)
    await ab.run_ok(env, "click", "button[type=submit]", binary=binary)
    for _ in range(50):
        url = (await ab.run_ok(env, "get", "url", binary=binary)).strip()
        if url.endswith("/account"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("login did not reach /account")


async def received_cookies(env, binary, site) -> dict[str, str]:
    await ab.run_ok(env, "open", site + "/cookies.json", binary=binary)
    return json.loads(await ab.run_ok(env, "get", "text", "body", binary=binary))["cookies"]


async def test_persistent_cookie_survives_close_and_relaunch_session_cookie_does_not(real_rig, site, gate):
    rig = real_rig
    profile = rig.root / "p1"
    anchor = await rig.host.launch_anchor(rig.spec(profile))
    env = await rig.stage(anchor, gate)
    try:
        await login(env, rig.binary, site)
        first = await received_cookies(env, rig.binary, site)
        assert set(first) == {"sf_persist", "sf_session"}
    finally:
        await rig.host.close_stage_session(env)
        report = await rig.host.close_anchor(anchor)
    assert report.graceful
    again = await rig.host.launch_anchor(rig.spec(profile))
    env = await rig.stage(again, gate)
    try:
        second = await received_cookies(env, rig.binary, site)
        assert second == {"sf_persist": first["sf_persist"]}       # same value, session cookie gone
        await ab.run_ok(env, "open", site + "/account", binary=rig.binary)
        text = await ab.run_ok(env, "get", "text", "body", binary=rig.binary)
        assert "Signed in as operator" in text
    finally:
        await rig.host.close_stage_session(env)
        await rig.host.close_anchor(again)
    assert scan_orphans([rig.root]) == []


class RecordingProxy:
    """A tiny HTTP proxy that demands a Basic credential (407 otherwise), records what it was
    asked for, forwards plain HTTP to 127.0.0.1 only and refuses every CONNECT."""

    def __init__(self, user: str, token: str):
        self.expected = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
        self.seen: list[tuple[str, str, bool]] = []   # (method, target, authenticated)
        self.server = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self):
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader, writer):
        try:
            while True:   # a 407 keeps the connection open for the retry with credentials
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
                authed = headers.get("proxy-authorization") == self.expected
                self.seen.append((method, target, authed))
                length = int(headers.get("content-length", "0") or 0)
                body = await reader.readexactly(length) if length else b""
                if not authed:
                    writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                                 b"Proxy-Authenticate: Basic realm=\"t\"\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                if method == "CONNECT" or not target.startswith("http://127.0.0.1:"):
                    writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                else:
                    hostport, _, path = target[len("http://"):].partition("/")
                    host, _, port = hostport.partition(":")
                    up_r, up_w = await asyncio.open_connection(host, int(port))
                    keep = [l for l in lines[1:] if l and not l.lower().startswith(("proxy-", "connection"))]
                    up_w.write((f"{method} /{path} HTTP/1.1\r\n" + "\r\n".join(keep) +
                                "\r\nConnection: close\r\n\r\n").encode("latin-1") + body)
                    await up_w.drain()
                    writer.write(await asyncio.wait_for(up_r.read(), 10))
                    up_w.close()
                await writer.drain()
                break
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


async def test_anchor_traffic_goes_through_the_proxy_with_credentials_loopback_included(real_rig, site, gate):
    rig = real_rig
    proxy = RecordingProxy("run-1", "s3cret-token")
    port = await proxy.start()
    try:
        spec = rig.spec(rig.root / "p1", proxy_url=f"http://run-1:s3cret-token@127.0.0.1:{port}",
                        allow_direct=False)
        anchor = await rig.host.launch_anchor(spec)
        env = await rig.stage(anchor, gate)
        try:
            assert "--proxy-bypass-list=<-loopback>" in psutil.Process(anchor.pid).cmdline()
            # the stage's very first navigation: the guard answers the 407 over the pipe
            await ab.run_ok(env, "open", site + "/", binary=rig.binary)
            title = ""
            for _ in range(50):   # `open` may return before the title is set
                title = await ab.run_ok(env, "get", "title", binary=rig.binary)
                if "Fixture site" in title:
                    break
                await asyncio.sleep(0.1)
            assert "Fixture site" in title, await ab.run_ok(env, "get", "url", binary=rig.binary)
            # the credential never appears in a process command line or environment
            for pid in [anchor.pid] + [c.pid for c in psutil.Process(anchor.pid).children(recursive=True)]:
                p = psutil.Process(pid)
                assert "s3cret-token" not in " ".join(p.cmdline()) + json.dumps(p.environ())
        finally:
            await rig.host.close_stage_session(env)
            await rig.host.close_anchor(anchor)
        targets = [(m, t) for m, t, authed in proxy.seen if authed]
        assert ("GET", site + "/") in targets          # loopback went through the proxy, authenticated
    finally:
        await proxy.stop()


async def test_headed_without_display_fails_clearly_and_leaves_no_process(real_rig, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    from sfguard.supervisor.browsers.host import AnchorError
    with pytest.raises(AnchorError, match="DISPLAY"):
        await real_rig.host.launch_anchor(real_rig.spec(real_rig.root / "p1", headed=True))
    assert scan_orphans([real_rig.root]) == []


async def test_failed_browser_start_leaves_nothing_behind(real_rig, tmp_path):
    broken = tmp_path / "broken-browser"
    broken.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n")
    broken.chmod(0o700)
    spec = real_rig.spec(real_rig.root / "p1")
    spec = type(spec)(**{**spec.__dict__, "browser_path": str(broken)})
    from sfguard.supervisor.browsers.host import AnchorError
    with pytest.raises(AnchorError, match="could not launch anchor .*exited during start"):
        await real_rig.host.launch_anchor(spec)
    assert scan_orphans([real_rig.root]) == []



async def test_crash_reports_stay_in_the_profile_and_the_crash_handler_ends_with_the_anchor(real_rig):
    """A crash dump is the browser's memory (live cookies): it belongs inside the profile,
    never in ~/.config/chromium. Chromium's crash handler double-forks out of the browser's
    process group, so closing the anchor must end it explicitly."""
    profile = real_rig.root / "p1"
    anchor = await real_rig.host.launch_anchor(real_rig.spec(profile))
    try:
        handlers = []
        for _ in range(40):           # the handler starts within ~50 ms of the browser
            handlers = [r for r in scan_orphans([profile]) if r.kind == "crashpad"]
            if handlers:
                break
            await asyncio.sleep(0.05)
        assert handlers, "no crash handler names the profile"
        for rec in handlers:
            db = [a for a in psutil.Process(rec.pid).cmdline() if a.startswith("--database=")]
            assert db and db[0] == f"--database={profile}/Crash Reports", db
    finally:
        report = await real_rig.host.close_anchor(anchor)
    assert report.graceful
    assert scan_orphans([profile]) == []
