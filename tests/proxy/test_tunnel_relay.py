"""What a judged CONNECT tunnel relays, through a real `sfguard proxy` over raw sockets: bulk
bytes both ways in order, a client's half-close (the site still answers after the client's
EOF), a site's half-close (the client still sends after the site's EOF), and a close from
either side reaching the other. These hold whichever way the tunnel's events travel inside the
proxy (BoundedHttpLayer hands them to the relay directly; mitmproxy's layers would pass them
on unchanged)."""
from __future__ import annotations

import hashlib
import os
import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from .conftest import TOKEN_A, basic, connect, serve_tcp, write_policy

A = basic("a", TOKEN_A)
#: what the site sends after its answer's digest, and before its own EOF
TAIL = bytes(range(256)) * 8192  # 2 MiB


class Site:
    """A loopback site with two behaviours, chosen by the first byte it reads:
    `d`: read to EOF, then answer the SHA-256 of everything read and TAIL, then close;
    `g`: answer TAIL at once and half-close, then record what still comes until EOF."""

    def __init__(self) -> None:
        self.received: dict[str, bytes] = {}
        self.done = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                sock.settimeout(20)
                got = b""
                try:
                    first = sock.recv(65536)
                    got += first
                    if first[:1] == b"g":
                        sock.sendall(TAIL)
                        sock.shutdown(socket.SHUT_WR)
                    while True:
                        data = sock.recv(65536)
                        if not data:
                            break
                        got += data
                    if first[:1] == b"d":
                        sock.sendall(hashlib.sha256(got).hexdigest().encode() + b"\n" + TAIL)
                finally:
                    outer.received[chr(first[0]) if first else "?"] = got
                    outer.done.set()

        self.server, self.port = serve_tcp(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site() -> Iterator[Site]:
    s = Site()
    yield s
    s.close()


@pytest.fixture
def guard(proxies, tmp_path, site):
    pol = write_policy(tmp_path / "sites.yaml", private_allow=["127.0.0.1/32"],
                       ports=(80, 443, site.port))
    return proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                    "--resolve", "site-a.test=127.0.0.1", "--decision-log", str(tmp_path / "d.jsonl")])


def read_to_eof(sock: socket.socket, limit: int = 16 << 20) -> bytes:
    sock.settimeout(20)
    out = bytearray()
    while len(out) <= limit:
        data = sock.recv(1 << 20)
        if not data:
            return bytes(out)
        out += data
    raise AssertionError("more than the site sent")


def tunnel(guard, site: Site) -> socket.socket:
    return connect(guard.port, f"site-a.test:{site.port}", A).tunnel


def test_bulk_both_ways_and_a_client_half_close(guard, site):
    """4 MiB up in 64 KiB writes, then the client's EOF: the site reads every byte in order,
    then answers (after the client's EOF) with their digest and 2 MiB, then closes."""
    sock = tunnel(guard, site)
    up = b"d" + os.urandom(4 << 20)
    for i in range(0, len(up), 65536):
        sock.sendall(up[i:i + 65536])
    sock.shutdown(socket.SHUT_WR)
    answer = read_to_eof(sock)
    sock.close()
    assert site.done.wait(10)
    assert site.received["d"] == up
    digest, _, tail = answer.partition(b"\n")
    assert digest == hashlib.sha256(up).hexdigest().encode()
    assert tail == TAIL


def test_a_site_half_close_lets_the_client_go_on_sending(guard, site):
    """The site answers and half-closes first: the client gets every byte, then EOF, and what
    it sends after that still reaches the site, until the client closes."""
    sock = tunnel(guard, site)
    sock.sendall(b"go")
    assert read_to_eof(sock) == TAIL
    late = os.urandom(300_000)
    sock.sendall(late)
    sock.close()
    assert site.done.wait(10)
    assert site.received["g"] == b"go" + late


def test_a_client_close_mid_answer_ends_the_site_connection(guard, site):
    """The client closes while the site is still sending: the site's connection ends too."""
    sock = tunnel(guard, site)
    sock.sendall(b"g")
    sock.settimeout(10)
    assert sock.recv(1) == TAIL[:1]  # the relay runs
    sock.close()
    assert site.done.wait(10), "the site never saw the client's close"
    assert site.received["g"] == b"g"
