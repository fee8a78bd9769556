"""Framing through the plain-HTTP relay, generated: a run of keep-alive requests (bodies by
Content-Length or in chunks, or none) written to a real `sfguard proxy` in arbitrary pieces,
answered by a loopback site that echoes each body back with a framing the request chose.
Every body must reach the site whole and come back whole, in order, on one connection."""
from __future__ import annotations

import socket
import socketserver
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import TOKEN_A, basic, serve_tcp, write_policy

A = basic("a", TOKEN_A)


def _read_until(sock: socket.socket, buf: bytes, marker: bytes) -> tuple[bytes, bytes]:
    while marker not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        buf += data
    head, _, rest = buf.partition(marker)
    return head, rest


def _read_exact(sock: socket.socket, buf: bytes, n: int) -> tuple[bytes, bytes]:
    while len(buf) < n:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        buf += data
    return buf[:n], buf[n:]


def read_message(sock: socket.socket, buf: bytes) -> tuple[bytes, dict[str, str], bytes, bytes]:
    """(first line, fields, body, rest of buf) of one HTTP/1.1 message with a body."""
    head, buf = _read_until(sock, buf, b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    if "content-length" in fields:
        body, buf = _read_exact(sock, buf, int(fields["content-length"]))
    elif fields.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size_line, buf = _read_until(sock, buf, b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                _, buf = _read_until(sock, buf, b"\r\n")
                break
            chunk, buf = _read_exact(sock, buf, size + 2)
            body += chunk[:-2]
    else:
        body = b""
    return lines[0].encode(), fields, body, buf


class EchoSite:
    """Echoes each request body, framed as its `X-Answer` header says (length / chunks)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.connections = 0
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                outer.connections += 1
                self.request.settimeout(10)
                buf = b""
                try:
                    while True:
                        _, fields, body, buf = read_message(self.request, buf)
                        outer.bodies.append(body)
                        if fields.get("x-answer") == "chunks":
                            wire = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                                            for i in range(0, len(body), 7)) + b"0\r\n\r\n"
                            self.request.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + wire)
                        else:
                            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                except (ConnectionError, OSError):
                    return

        self.server, self.port = serve_tcp(Handler)


@pytest.fixture
def framing(proxies, tmp_path):
    site = EchoSite()
    pol = write_policy(tmp_path / "sites.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, site.port))
    proxy = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                     "--resolve", "site-a.test=127.0.0.1"])
    yield proxy.port, site
    site.server.shutdown()
    site.server.server_close()


def encode(up: int, body: bytes, framing: str, answer: str, chunk: int) -> bytes:
    head = (f"POST http://site-a.test:{up}/echo HTTP/1.1\r\nHost: site-a.test:{up}\r\n"
            f"Proxy-Authorization: {A}\r\nX-Answer: {answer}\r\n")
    if framing == "chunks":
        wire = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + chunk]), body[i:i + chunk])
                        for i in range(0, len(body), chunk)) + b"0\r\n\r\n"
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + wire
    if framing == "none":
        return (head + "\r\n").encode()
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


message = st.tuples(st.binary(max_size=300), st.sampled_from(["length", "chunks", "none"]),
                    st.sampled_from(["length", "chunks"]), st.integers(1, 64))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=5), cuts=st.lists(st.integers(1, 200), max_size=8))
def test_bodies_survive_any_split_of_a_keep_alive_run(framing, messages, cuts):
    port, site = framing
    site.bodies.clear()
    wire = b"".join(encode(site.port, b, f, a, c) for b, f, a, c in messages)
    expected = [b if f != "none" else b"" for b, f, _, _ in messages]
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        i = 0
        for n in cuts:  # pieces of the run, each its own write
            if i >= len(wire):
                break
            sock.sendall(wire[i:i + n])
            i += n
            time.sleep(0.002)
        sock.sendall(wire[i:])
        buf = b""
        got = []
        for _ in expected:
            line, _, body, buf = read_message(sock, buf)
            assert line == b"HTTP/1.1 200 OK"
            got.append(body)
    finally:
        sock.close()
    assert got == expected
    assert site.bodies == expected
