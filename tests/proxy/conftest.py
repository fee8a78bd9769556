"""Fixtures for the guard proxy tests: a `sfguard proxy` subprocess, loopback servers that
record what they receive, and a raw-socket proxy client."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import queue
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SFGUARD = [sys.executable, "-m", "sfguard.cli.main"]
TOKEN_A = "tok-A-0123456789abcdef"
TOKEN_B = "tok-B-0123456789abcdef"
READY_TIMEOUT = 30.0


# --- the proxy under test -----------------------------------------------------------------------
@dataclass
class ProxyProc:
    proc: subprocess.Popen
    host: str
    port: int
    first_lines: list[str]
    stderr_path: Path
    stdout_lines: queue.Queue[str | None]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def read_stdout_rest(self) -> list[str]:
        """After stop(): the lines the proxy wrote to stdout after the first lines."""
        assert self.proc.poll() is not None
        rest = []
        deadline = time.monotonic() + 10
        while (line := _readline(self.stdout_lines, deadline)) is not None:
            rest.append(line)
        return rest


def _pump(proc: subprocess.Popen, lines: queue.Queue[str | None]) -> None:
    """Reader thread: every stdout line of the proxy into a queue (None at EOF)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _readline(lines: queue.Queue[str | None], deadline: float) -> str | None:
    try:
        return lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return None


def start_proxy(args: list[str], tmp_path: Path, env: dict | None = None,
                extra_lines: int = 0) -> ProxyProc:
    """Start `sfguard proxy ARGS`; wait (bounded) for its ready line."""
    stderr_path = tmp_path / f"proxy-stderr-{time.monotonic_ns()}.txt"
    full_env = {k: v for k, v in os.environ.items()
                if k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")}
    full_env.update(env or {})
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(SFGUARD + ["proxy", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=full_env, bufsize=1)
    out: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc, out), daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT
    line = _readline(out, deadline)
    if not line or not line.startswith("ready "):
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"no ready line (got {line!r}); stderr: {stderr_path.read_text()}")
    lines = [line]
    for _ in range(extra_lines):
        lines.append(_readline(out, deadline) or "")
    port = int(lines[0].rsplit(":", 1)[1])
    return ProxyProc(proc, "127.0.0.1", port, lines, stderr_path, out)


@pytest.fixture
def proxies(tmp_path):
    """Factory: start proxies; every one is stopped at the end of the test."""
    started: list[ProxyProc] = []

    def factory(args, env=None, extra_lines=0) -> ProxyProc:
        p = start_proxy(args, tmp_path, env, extra_lines)
        started.append(p)
        return p

    yield factory
    for p in started:
        p.stop()


# --- loopback servers ---------------------------------------------------------------------------
def serve_tcp(handler: type[socketserver.BaseRequestHandler]) -> tuple[socketserver.ThreadingTCPServer, int]:
    """A threaded TCP server on 127.0.0.1 (a free port), serving in a daemon thread; returns
    (server, port). Stop it with `server.shutdown(); server.server_close()`."""
    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    server = Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


class RecordingServer:
    """TCP server on 127.0.0.1 that records every byte received; echoes or answers HTTP."""

    def __init__(self, mode: str = "echo") -> None:
        self.mode = mode
        self.received = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                with outer._lock:
                    outer.connections += 1
                self.request.settimeout(10)
                buf = b""
                try:
                    while True:
                        data = self.request.recv(65536)
                        if not data:
                            return
                        with outer._lock:
                            outer.received += data
                        if outer.mode == "echo":
                            self.request.sendall(data)
                        else:  # minimal HTTP/1.1: answer each complete head
                            buf += data
                            while b"\r\n\r\n" in buf:
                                head, buf = buf.split(b"\r\n\r\n", 1)
                                body = b"hello from upstream\n"
                                self.request.sendall(
                                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                except OSError:
                    return

        self.server, self.port = serve_tcp(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def echo_server():
    s = RecordingServer("echo")
    yield s
    s.close()


@pytest.fixture
def http_server():
    s = RecordingServer("http")
    yield s
    s.close()


# --- a raw proxy client ---------------------------------------------------------------------------
def basic(name: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{token}".encode()).decode()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    sock: socket.socket | None

    @property
    def tunnel(self) -> socket.socket:
        """The open tunnel of a 200 reply to CONNECT (the test fails without one)."""
        assert self.sock is not None, f"no tunnel: the proxy answered {self.status}"
        return self.sock


def read_head(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            break
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0]:
        return 0, {}, b""
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, rest


def read_body(sock: socket.socket, headers: dict[str, str], rest: bytes) -> bytes:
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        data = sock.recv(65536)
        if not data:
            break
        rest += data
    return rest[:n]


def connect(proxy_port: int, target: str, auth: str | None = None,
            extra: bytes = b"") -> Reply:
    """Send `CONNECT target` with optional Proxy-Authorization; return the reply.

    On 200 the socket stays open (the tunnel); otherwise it is closed.
    """
    s = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if auth:
        head += f"Proxy-Authorization: {auth}\r\n"
    s.sendall(head.encode() + extra + b"\r\n")
    status, headers, rest = read_head(s)
    if status == 200:
        return Reply(status, headers, rest, s)
    body = read_body(s, headers, rest)
    s.close()
    return Reply(status, headers, body, None)


def get(proxy_port: int, url: str, auth: str | None = None, host_header: str | None = None,
        extra_headers: dict[str, str] | None = None) -> Reply:
    """A plain-HTTP proxy request (absolute-form URL)."""
    s = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    if host_header is None:
        host_header = url.split("/", 3)[2]
    head = f"GET {url} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n"
    if auth:
        head += f"Proxy-Authorization: {auth}\r\n"
    for k, v in (extra_headers or {}).items():
        head += f"{k}: {v}\r\n"
    s.sendall(head.encode() + b"\r\n")
    status, headers, rest = read_head(s)
    body = read_body(s, headers, rest)
    s.close()
    return Reply(status, headers, body, None)


def write_policy(path: Path, *, private_allow=(), allow_always=(), block=(), mode="enforce",
                 ports=(80, 443), quiet=()) -> Path:
    """Write a site policy file for a test (schema: policy/sites.yaml)."""
    def seq(items):
        return "[" + ", ".join(f'"{x}"' for x in items) + "]"
    lines = ["version: 1", f"mode: {mode}", "ports: [" + ", ".join(map(str, ports)) + "]",
             f"allow_always: {seq(allow_always)}", "block:" + ("" if block else " []")]
    for pattern in block:
        lines += [f'  - pattern: "{pattern}"', '    reason: "test block"']
    lines += ["private_networks:", f"  allow: {seq(private_allow)}", f"quiet: {seq(quiet)}"]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


# --- an in-process guard in front of a loopback site ---------------------------------------------
@dataclass
class InProcessGuard:
    proxy: Any           # sfguard.proxy_addons.server.GuardProxy
    registry: Any        # its ClientRegistry
    port: int            # the guard's port
    up: int              # the site's port
    policy: Path
    log: Path            # the decision log
    site: Any = None     # the test's own site object, when it passed one

    def lines(self) -> list[dict]:
        """The decision log's lines so far."""
        return [json.loads(x) for x in self.log.read_text().splitlines()] if self.log.exists() else []


@contextlib.asynccontextmanager
async def in_process_guard(tmp_path: Path, site_handler, *, allow=("site-a.test",),
                           names=("site-a.test",), addon=None, site=None, **config) -> AsyncIterator[InProcessGuard]:
    """A GuardProxy in this process in front of a loopback site (`site_handler`, an
    `asyncio.start_server` callback): client `a` (TOKEN_A) may reach `allow`, each of `names`
    resolves to the site on 127.0.0.1, the site's port is an allowed port. `addon` is added after
    the guard's own addons; `site` is kept beside it; `config` goes to GuardConfig."""
    from sfguard.proxy_addons.clients import ClientRegistry, make_client
    from sfguard.proxy_addons.server import GuardConfig, GuardProxy
    server = await asyncio.start_server(site_handler, "127.0.0.1", 0)
    up = server.sockets[0].getsockname()[1]
    pol = write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, up))
    log = tmp_path / "decisions.log"
    registry = ClientRegistry([make_client("a", TOKEN_A, list(allow))])
    proxy = GuardProxy(GuardConfig(policy_path=pol, decision_log=str(log),
                                   resolve={n: ["127.0.0.1"] for n in names}, **config), registry)
    try:
        _, port = await proxy.start()
        if addon is not None:
            proxy._master.addons.add(addon)
        yield InProcessGuard(proxy, registry, port, up, pol, log, site)
    finally:
        await proxy.stop()
        server.close()
