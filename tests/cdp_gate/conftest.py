"""Fixtures for the CDP gate tests: a real anchor browser, a page server, the gate, stage sessions."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
from aiohttp import web

from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.host import AnchorSpec, LocalBrowserHost
from sfguard.supervisor.gate.cdp_gate import CdpGate

CMD_TIMEOUT_S = 45


def _ab_path() -> str:
    ab = tools.find_agent_browser()
    if not ab.found:
        pytest.fail("agent-browser missing: run ./dev setup")
    return ab.path


def base_env() -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "AGENT_BROWSER_EXECUTABLE_PATH": tools.find_browser().path or "/usr/bin/chromium"}
    if os.geteuid() == 0:
        env["AGENT_BROWSER_ARGS"] = "--no-sandbox"
    return env


class Session:
    """One agent-browser session with a fixed env (every command must carry the same env)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.sock_dir = Path(env["AGENT_BROWSER_SOCKET_DIR"])
        self.name = env["AGENT_BROWSER_SESSION"]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([_ab_path(), *args], env=self.env, capture_output=True, text=True,
                             timeout=CMD_TIMEOUT_S)
        if check and out.returncode != 0:
            raise AssertionError(f"agent-browser {args[0]} failed: {out.stdout}{out.stderr}")
        return out

    async def arun(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return await asyncio.to_thread(self.run, *args, check=check)

    def daemon_pid(self) -> int | None:
        try:
            return int((self.sock_dir / f"{self.name}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        pid = self.daemon_pid()
        if pid is None or not psutil.pid_exists(pid):
            # no daemon (the test closed the session): a `close` now would start a new daemon
            # that retries the revoked gate URL for half a minute before giving up
            return
        try:
            self.run("close", check=False)
        except subprocess.TimeoutExpired:
            pass
        _kill(pid)


def _kill(pid: int | None) -> None:
    if not pid:
        return
    try:
        proc = psutil.Process(pid)
        proc.wait(timeout=5)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _chrome_pid(profile: Path) -> int | None:
    try:
        target = os.readlink(profile / "SingletonLock")
        return int(target.rsplit("-", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def stage_env(gate_url: str, tag: str) -> dict[str, str]:
    sock = tempfile.mkdtemp(prefix="cg", dir="/tmp")
    env = base_env()
    env.update({"AGENT_BROWSER_CDP": gate_url, "AGENT_BROWSER_SESSION": f"st{tag}{uuid.uuid4().hex[:8]}",
                "AGENT_BROWSER_SOCKET_DIR": sock, "AGENT_BROWSER_PIN_TAB": "1",
                "AGENT_BROWSER_IDLE_TIMEOUT_MS": "0"})
    return env


@pytest.fixture
async def anchor():
    """A real anchor browser started the guard's way (DevTools pipe, no port), temp profile,
    no proxy; yields the Anchor (its `pipe` is what the gate relays onto)."""
    root = Path(tempfile.mkdtemp(prefix="cga", dir="/tmp"))
    host = LocalBrowserHost()
    spec = AnchorSpec(session=f"anc{uuid.uuid4().hex[:8]}", socket_dir=root / "s",
                      config_path=root / "cfg.json", browser_path=tools.find_browser().path,
                      temp_root=root, allow_direct=True)
    anc = await host.launch_anchor(spec)
    try:
        yield anc
    finally:
        await host.close_anchor(anc)
        shutil.rmtree(root, ignore_errors=True)


PAGES = {
    "/index.html": "<html><head><title>Index</title></head><body><a href='/p2.html'>next</a>"
                   "<input id='q' aria-label='query'><button onclick=\"document.title='clicked:'+"
                   "document.getElementById('q').value\">Go</button></body></html>",
    "/p2.html": "<html><head><title>Second</title></head><body>second page</body></html>",
    "/a.html": "<html><head><title>StageA</title></head><body>a</body></html>",
    "/b.html": "<html><head><title>StageB</title></head><body>b</body></html>",
}
SECRET_COOKIE = "sfgsecret" + uuid.uuid4().hex


@pytest.fixture
async def pages():
    """Tiny page server on 127.0.0.1; /cookie sets an HttpOnly cookie with a unique value."""
    async def page(request: web.Request) -> web.Response:
        body = PAGES.get(request.path)
        if body is None:
            raise web.HTTPNotFound()
        return web.Response(text=body, content_type="text/html")

    async def cookie(request: web.Request) -> web.Response:
        resp = web.Response(text="<html><body>cookie set</body></html>", content_type="text/html")
        resp.set_cookie("sid", SECRET_COOKIE, httponly=True, path="/")
        return resp

    app = web.Application()
    app.router.add_get("/cookie", cookie)
    app.router.add_get("/{name}", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.fixture
async def gate(tmp_path):
    refusals: list[tuple[str, str, str]] = []
    g = CdpGate(on_refusal=lambda *a: refusals.append(a), record_methods=True)
    g.refusals = refusals  # type: ignore[attr-defined]
    await g.start()
    yield g
    await g.stop()


@pytest.fixture
def sessions():
    """Stage sessions opened by a test; all closed at teardown."""
    opened: list[Session] = []

    def make(gate_url: str, tag: str = "") -> Session:
        s = Session(stage_env(gate_url, tag))
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
        _kill_by_socket_dir(s.sock_dir)
        shutil.rmtree(s.sock_dir, ignore_errors=True)


def _kill_by_socket_dir(sock_dir: Path) -> None:
    """End any agent-browser daemon this test started in `sock_dir` that is still alive
    (a `--cdp` session's `close` may not end it when the gate is already gone)."""
    for proc in psutil.process_iter(["name"]):
        try:
            if "agent-browser" not in (proc.info["name"] or ""):
                continue
            if proc.environ().get("AGENT_BROWSER_SOCKET_DIR") == str(sock_dir):
                proc.kill()
                proc.wait(5)
        except (psutil.Error, psutil.TimeoutExpired):
            pass


class CdpClient:
    """A plain aiohttp WebSocket CDP client (what a hostile stage script would use)."""

    def __init__(self, ws) -> None:
        self.ws, self.next_id, self.events = ws, 0, []
        self.received: list[str] = []

    async def call(self, method: str, params: dict | None = None, session_id: str | None = None,
                   timeout: float = 10.0) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session_id:
            msg["sessionId"] = session_id
        await self.ws.send_str(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(method)
            m = await self.ws.receive(timeout=left)
            if m.type.name != "TEXT":
                raise ConnectionError(f"connection ended: {m.type.name}")
            self.received.append(m.data)
            data = json.loads(m.data)
            if data.get("id") == self.next_id:
                return data
            self.events.append(data)

    async def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                m = await self.ws.receive(timeout=left)
            except TimeoutError:
                return
            if m.type.name != "TEXT":
                return
            self.received.append(m.data)
            self.events.append(json.loads(m.data))
