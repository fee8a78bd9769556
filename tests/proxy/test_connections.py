"""Connections as a client, a slow client or a hostile one meets them, whatever their first
bytes: an in-process guard, raw sockets, a loopback site."""
from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from .conftest import TOKEN_A, basic, in_process_guard, write_policy

A = basic("a", TOKEN_A)
BIG = 32 * 1024 * 1024


class Site:
    """Answers `/big` with BIG bytes (counting what it managed to hand to its socket), anything
    else with `ok`; counts connections."""

    def __init__(self) -> None:
        self.connections = 0
        self.sent = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                if head.split(b" ", 2)[1] == b"/big":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BIG)
                    chunk = b"b" * 65536
                    for _ in range(BIG // len(chunk)):
                        writer.write(chunk)
                        await writer.drain()
                        self.sent += len(chunk)
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def guard(tmp_path, allow=("site-a.test",), addon=None, **config):
    """(proxy, guard port, site port, site, decision log): client `a` may reach `allow`."""
    site = Site()
    async with in_process_guard(tmp_path, site.handle, allow=allow, addon=addon, **config) as g:
        yield g.proxy, g.port, g.up, site, g.log


def get(up: int, path: str = "x", method: str = "GET", host: str = "site-a.test") -> bytes:
    return (f"{method} http://{host}:{up}/{path} HTTP/1.1\r\nHost: {host}:{up}\r\n"
            f"Proxy-Authorization: {A}\r\n\r\n").encode()


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """True once the guard closed the connection (EOF or reset) within `seconds`."""
    try:
        while await asyncio.wait_for(reader.read(65536), seconds):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


# -- every start of a connection gets its answer -----------------------------------------------------
@pytest.mark.parametrize("request_bytes, status", [
    (lambda up: get(up), b"200"),
    (lambda up: get(up, method="POST"), b"200"),
    (lambda up: get(up, method="DELETE"), b"200"),
    (lambda up: get(up, method="COPY"), b"200"),
    (lambda up: get(up, method="get"), b"200"),   # a token, so a method: relayed as sent
    (lambda up: b"GARBAGE\r\n\r\n", b"400"),
    (lambda up: b"garbage\r\n\r\n", b"400"),
    (lambda up: b"GET http://site-a.test:%d/x HTTP/1.1\r\n\r\n" % up, b"407"),  # no credentials
], ids=["GET", "POST", "DELETE", "COPY", "get", "GARBAGE", "garbage", "no-credentials"])
async def test_each_start_of_a_connection_gets_its_answer(tmp_path, request_bytes, status):
    async with guard(tmp_path) as (_, port, up, site, _log):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes(up))
        answer = await read_answer(reader)
        writer.close()
        assert answer.split(b" ", 2)[1] == status, answer[:200]
        assert site.connections == (1 if status == b"200" else 0)


async def test_a_connect_sent_one_byte_at_a_time_is_a_tunnel(tmp_path):
    async with guard(tmp_path) as (_, port, up, _site, _log):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (f"CONNECT site-a.test:{up} HTTP/1.1\r\nHost: site-a.test:{up}\r\n"
                f"Proxy-Authorization: {A}\r\n\r\n").encode()
        for i in range(len(head)):
            writer.write(head[i:i + 1])
            await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        writer.write(b"GET /x HTTP/1.1\r\nHost: site-a.test\r\n\r\n")
        assert (await read_answer(reader)).endswith(b"ok")
        writer.close()


async def test_a_client_speaking_tls_to_the_proxy_port_is_closed_unanswered(tmp_path):
    async with guard(tmp_path) as (_, port, _up, site, _log):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01\x00\x05hello")
        assert await closed_within(reader, 5)
        assert site.connections == 0


# -- the head-read timeout counts from the accept ----------------------------------------------------
@pytest.mark.parametrize("first", [b"", b"G", b"C"], ids=["silent", "plain", "connect"])
async def test_head_timeout_counts_from_the_accept(tmp_path, first):
    """A client that waits 0.7 s before its first byte, then trickles the rest, is closed about
    1 s after it connected (head timeout 1 s), not 1 s after its first byte."""
    async with guard(tmp_path, head_timeout=1.0) as (_, port, up, site, _log):
        loop = asyncio.get_running_loop()
        start = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        rest = {b"": b"", b"G": get(up)[1:], b"C": f"ONNECT site-a.test:{up} HTTP/1.1\r\n".encode()}[first]
        closed_at = None
        await asyncio.sleep(0.7)
        if first:
            writer.write(first)
        for i in range(40):  # one byte every 0.1 s: the head is never complete within 4 s
            if reader.at_eof() or await closed_within(reader, 0.1):
                closed_at = loop.time() - start
                break
            writer.write(rest[i:i + 1])
        writer.close()
        assert closed_at is not None, "the guard kept a trickling client"
        assert closed_at < 1.6, f"closed {closed_at:.2f} s after the accept"
        assert site.connections == 0


# -- plain-HTTP connections ---------------------------------------------------------------------------
async def test_stop_closes_plain_connections_and_status_counts_them(tmp_path):
    async with guard(tmp_path) as (proxy, port, up, _site, _log):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get(up))
        assert (await read_answer(reader)).endswith(b"ok")
        assert proxy.status().open_connections == 1
        await proxy.stop()
        assert await closed_within(reader, 5)
        writer.close()


async def test_a_client_that_does_not_read_holds_the_site_back(tmp_path):
    """Backpressure: while the client reads nothing, the guard stops reading the site, so the
    site can hand its socket only what the buffers on the way hold; then everything arrives."""
    async with guard(tmp_path) as (_, port, up, site, _log):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        transport = writer.transport
        writer.write(get(up, "big"))
        await asyncio.sleep(1.0)
        transport.pause_reading()  # the client's own buffer stops taking bytes too
        await asyncio.sleep(1.5)
        held = site.sent
        assert held < 16 * 1024 * 1024, f"the site could send {held} bytes to a client that did not read"
        transport.resume_reading()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        got = 0
        while got < BIG:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 10)
            assert chunk
            got += len(chunk)
        assert got == BIG
        writer.close()


@pytest.mark.parametrize("how", ["plain", "connect"])
async def test_the_guard_never_connects_to_its_own_listen_address(tmp_path, how):
    """127.0.0.1 is allowed (by the client's list and private_networks), but not the port the
    guard itself listens on: a request through the guard to the guard is refused before any
    connection."""
    async with guard(tmp_path, allow=("127.0.0.1",)) as (proxy, port, _up, _site, log):
        write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, port))
        await asyncio.sleep(0.6)  # the policy watcher's poll
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if how == "plain":
            writer.write(get(port, host="127.0.0.1"))
            answer = await read_answer(reader)
            assert answer.startswith(b"HTTP/1.1 502"), answer[:200]
            assert b"Connection killed" in answer  # refused at server_connect, never connected
        else:
            writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                         f"Proxy-Authorization: {A}\r\n\r\n".encode())
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert answer.startswith(b"HTTP/1.1 200"), answer  # the server is connected lazily
            writer.write(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            try:  # refused at server_connect: closed, nothing answered
                rest = await asyncio.wait_for(reader.read(), 5)
            except ConnectionError:
                rest = b""
            assert rest == b""
        writer.close()
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert any(x.get("port") == port and x.get("decision") == "allow" for x in lines)
        assert proxy.status().open_connections <= 1


async def test_bytes_sent_while_a_connect_hook_waits_keep_their_order(tmp_path):
    """An addon's `client_connected` waits 0.3 s; the client sends its request in two parts
    meanwhile. The guard reads the second part only after the first: a well-formed request."""
    class SlowHello:
        async def client_connected(self, client) -> None:
            await asyncio.sleep(0.3)

    async with guard(tmp_path, addon=SlowHello()) as (_, port, up, site, _log):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = get(up)
        writer.write(request[:20])
        await asyncio.sleep(0.1)
        writer.write(request[20:])
        answer = await read_answer(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok"), answer[:200]
        assert site.connections == 1
