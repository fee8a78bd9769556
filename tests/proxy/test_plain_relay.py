"""The plain-HTTP relay (proxy_addons/plain_http.py) as a client or a hostile site would meet
it: an in-process guard, raw sockets, and a loopback site that records every byte it gets and
answers each path with bytes the test chose. Each case asserts what the client got and what
reached the site."""
from __future__ import annotations

import asyncio

import pytest

from sfguard.proxy_addons.clients import ClientRegistry, make_client
from sfguard.proxy_addons.server import GuardConfig, GuardProxy

from .conftest import TOKEN_A, basic, write_policy

A = basic("a", TOKEN_A)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Site:
    """A loopback site: records what it receives; answers `/<name>` with ANSWERS[name]."""

    def __init__(self, answers: dict[str, bytes]) -> None:
        self.answers = answers
        self.received = bytearray()
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                self.received += head
                fields = head.lower()
                if b"content-length:" in fields:
                    n = int(fields.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                    self.received += await reader.readexactly(n)
                elif b"transfer-encoding: chunked" in fields:
                    self.received += await reader.readuntil(b"0\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                answer = self.answers.get(path.lstrip("/"), OK)
                if answer == b"close":
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def relay(tmp_path):
    """(proxy port, site port, site, decision log) for a guard that lets client `a` reach
    site-a.test (and not site-b.test), both resolved to the site on 127.0.0.1."""
    site = Site({
        "big-head": b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * (300 * 1024) + b"\r\n\r\n",
        "switch": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\nRAW",
        "old": b"HTTP/1.0 200 OK\r\n\r\nuntil the end",
        "close": b"close",
        "extra": OK + b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\ninjected",
        "both": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        "head": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        "not-modified": b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
    })
    server = await asyncio.start_server(site.handle, "127.0.0.1", 0)
    up = server.sockets[0].getsockname()[1]
    pol = write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, up))
    log = tmp_path / "decisions.log"
    proxy = GuardProxy(GuardConfig(policy_path=pol, decision_log=str(log),
                                   resolve={"site-a.test": ["127.0.0.1"], "site-b.test": ["127.0.0.1"]}),
                       ClientRegistry([make_client("a", TOKEN_A, ["site-a.test"])]))
    _, port = await proxy.start()
    yield port, up, site, log
    await proxy.stop()
    server.close()


def req(up: int, path: str, method: str = "GET", host: str = "site-a.test", extra: str = "",
        body: bytes = b"") -> bytes:
    return (f"{method} http://{host}:{up}/{path} HTTP/1.1\r\nHost: {host}:{up}\r\n"
            f"Proxy-Authorization: {A}\r\n{extra}\r\n").encode() + body


async def exchange(port: int, data: bytes, want: int = 1 << 20, timeout: float = 5) -> bytes:
    """Send `data`, return every byte the guard sent until it closed (or `want` bytes, or
    the timeout passed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = b""
    try:
        while len(got) < want:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        pass
    writer.close()
    return got


# (case, request bytes (a function of the site's port), what the client gets starts with,
#  what reached the site: None = nothing)
SMUGGLING = [
    ("length-and-chunked", lambda up: req(up, "x", "POST", extra="Content-Length: 5\r\n"
                                          "Transfer-Encoding: chunked\r\n", body=b"0\r\n\r\n")),
    ("two-lengths", lambda up: req(up, "x", "POST", extra="Content-Length: 5\r\nContent-Length: 6\r\n",
                                   body=b"hello!")),
    ("chunked-not-last", lambda up: req(up, "x", "POST", extra="Transfer-Encoding: chunked, gzip\r\n",
                                        body=b"0\r\n\r\n")),
    ("bad-header-name", lambda up: req(up, "x", extra="Bad Name: x\r\n")),
    ("signed-length", lambda up: req(up, "x", "POST", extra="Content-Length: +5\r\n", body=b"hello")),
]


@pytest.mark.parametrize("build", [c[1] for c in SMUGGLING], ids=[c[0] for c in SMUGGLING])
async def test_ambiguous_framing_is_refused_before_anything_reaches_the_site(relay, build):
    port, up, site, _ = relay
    got = await exchange(port, build(up))
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert site.connections == 0 and bytes(site.received) == b""


async def test_a_request_hidden_in_a_body_is_decided_on_its_own(relay):
    port, up, site, _ = relay
    hidden = req(up, "hidden", host="site-b.test")
    got = await exchange(port, req(up, "first", "POST", extra=f"Content-Length: {len(hidden)}\r\n", body=hidden)
                         + req(up, "second", host="site-b.test"))
    assert got.startswith(OK)
    assert b"HTTP/1.1 403 " in got[len(OK):] and b"not_allowed" in got  # the second, decided alone
    assert bytes(site.received).count(b"POST /first HTTP/1.1") == 1
    assert b"GET /second" not in site.received  # the hidden one arrived as body bytes only


async def test_each_request_on_one_connection_is_decided(relay):
    port, up, site, log = relay
    got = await exchange(port, req(up, "one") + req(up, "two", host="site-b.test") + req(up, "three"))
    assert got.startswith(OK + b"HTTP/1.1 403 ")
    assert b"/three" not in site.received and b"/two" not in site.received  # closed after the denial
    lines = log.read_text()
    assert lines.count('"decision":"allow"') == 1 and lines.count('"decision":"deny"') == 1


async def test_pipelined_requests_are_answered_in_order_on_one_site_connection(relay):
    port, up, site, _ = relay
    got = await exchange(port, req(up, "a") + req(up, "b") + req(up, "c"), want=3 * len(OK), timeout=3)
    assert got == OK * 3
    assert site.connections == 1
    assert [p for p in (b"/a ", b"/b ", b"/c ") if p in site.received] == [b"/a ", b"/b ", b"/c "]


async def test_request_bodies_arrive_whole_and_chunked_bodies_are_reframed(relay):
    port, up, site, _ = relay
    got = await exchange(port, req(up, "len", "POST", extra="Content-Length: 11\r\n", body=b"hello world")
                         + req(up, "chunks", "POST", extra="Transfer-Encoding: chunked\r\n",
                               body=b"5;name=x\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"),
                         want=2 * len(OK), timeout=3)
    assert got == OK * 2
    assert b"\r\n\r\nhello world" in site.received
    # chunk extensions and trailers are not forwarded: the chunks are written afresh
    assert bytes(site.received).endswith(b"\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert b"Proxy-Authorization" not in site.received and b"name=x" not in site.received


async def test_chunked_responses_are_reframed(relay):
    port, up, _, _ = relay
    got = await exchange(port, req(up, "chunked", extra="Connection: close\r\n"))
    assert got.endswith(b"\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n") and b"ext=1" not in got


@pytest.mark.parametrize("method,path", [("HEAD", "head"), ("GET", "not-modified")])
async def test_bodiless_answers_keep_their_framing_for_the_next_request(relay, method, path):
    """A HEAD answer or a 304 announces a body it never has: nothing is added to it, and the
    next answer on the connection is read and relayed whole."""
    port, up, _, _ = relay
    first = relay[2].answers[path]
    got = await exchange(port, req(up, path, method) + req(up, "after"), want=len(first) + len(OK), timeout=3)
    assert got == first + OK


async def test_expect_continue_is_answered_by_the_guard_after_the_decision(relay):
    port, up, site, _ = relay
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(req(up, "upload", "POST", extra="Content-Length: 4\r\nExpect: 100-continue\r\n"))
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"data")
    assert await asyncio.wait_for(reader.readexactly(len(OK)), 5) == OK
    writer.close()
    assert b"expect" not in bytes(site.received).lower()


async def test_denied_expect_continue_gets_the_denial_not_continue(relay):
    port, up, site, _ = relay
    got = await exchange(port, req(up, "upload", "POST", host="site-b.test",
                                   extra="Content-Length: 4\r\nExpect: 100-continue\r\n"))
    assert got.startswith(b"HTTP/1.1 403 ") and b"100 Continue" not in got
    assert site.connections == 0


@pytest.mark.parametrize("path,starts,closes", [
    ("big-head", b"HTTP/1.1 502 ", True),        # a response head over the bound
    ("close", b"HTTP/1.1 502 ", True),           # the site closed without answering
    ("both", b"HTTP/1.1 502 ", True),            # a response with both framings: smuggling
    ("switch", b"", True),                        # an upgrade: never relayed
    ("old", b"HTTP/1.0 200 OK\r\n\r\nuntil the end", True),  # a body until the end: then closed
])
async def test_hostile_or_odd_responses(relay, path, starts, closes):
    port, up, _, _ = relay
    got = await exchange(port, req(up, path))
    assert got.startswith(starts) if starts else got == b"", got[:200]
    assert b"RAW" not in got


async def test_bytes_after_a_response_never_answer_the_next_request(relay):
    """A site that sends more than its response (a second, unasked one) is not used again:
    the client's next request gets its own answer from a new connection."""
    port, up, site, _ = relay
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(req(up, "extra"))
    assert await asyncio.wait_for(reader.readexactly(len(OK)), 5) == OK
    await asyncio.sleep(0.2)
    site.answers["next"] = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"
    writer.write(req(up, "next"))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"next", head
    writer.close()
    assert site.connections == 2


async def test_a_connect_after_plain_requests_is_refused(relay):
    port, up, site, _ = relay
    got = await exchange(port, req(up, "a") + f"CONNECT site-a.test:{up} HTTP/1.1\r\n"
                         f"Proxy-Authorization: {A}\r\n\r\nTUNNELLED".encode())
    assert got.startswith(OK + b"HTTP/1.1 400 ")
    assert b"TUNNELLED" not in site.received and b"CONNECT" not in site.received


async def test_origin_form_request_is_decided_by_its_host_header(relay):
    port, up, site, _ = relay
    for host, status in (("site-a.test", b"200"), ("site-b.test", b"403")):
        got = await exchange(port, f"GET /o HTTP/1.1\r\nHost: {host}:{up}\r\nProxy-Authorization: {A}\r\n"
                             "Connection: close\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.1 " + status), got[:200]
    assert bytes(site.received).count(b"GET /o ") == 1


@pytest.mark.parametrize("extra,reason", [
    ("".join(f"X-H{i}: v\r\n" for i in range(5000)), "too_many_headers"),
    ("X-Big: " + "a" * (70 * 1024) + "\r\n", "request_head_too_large"),
])
async def test_every_request_head_on_a_connection_is_bounded(relay, extra, reason):
    port, up, site, log = relay
    got = await exchange(port, req(up, "first") + req(up, "second", extra=extra))
    assert got.startswith(OK + b"HTTP/1.1 431 ")
    assert b"/second" not in site.received
    assert f'"reason":"{reason}"' in log.read_text()
