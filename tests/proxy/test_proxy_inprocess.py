"""The in-process API the daemon uses: GuardProxy start/stop, ClientRegistry changes at run
time, and the status object (policy state included)."""
from __future__ import annotations

import asyncio
import time

import pytest

from sfguard import policy
from sfguard.proxy_addons.clients import ClientRegistry, ClientSpecError, make_client
from sfguard.proxy_addons.server import GuardConfig, GuardProxy, GuardStartError

from .conftest import TOKEN_A, TOKEN_B, basic, write_policy


async def connect_status(port: int, target: str, auth: str | None) -> tuple[int, bytes]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if auth:
        head += f"Proxy-Authorization: {auth}\r\n"
    writer.write(head.encode() + b"\r\n")
    resp = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status = int(resp.split()[1])
    if status == 200:
        writer.write(b"ping")
        echoed = await asyncio.wait_for(reader.readexactly(4), 5)
    else:
        echoed = b""
    writer.close()
    return status, echoed


@pytest.fixture
async def echo():
    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def test_registry_changes_apply_to_new_connections(tmp_path, echo):
    pol = write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, echo))
    registry = ClientRegistry([make_client("a", TOKEN_A, ["site-a.test"], run="run-1")])
    proxy = GuardProxy(GuardConfig(policy_path=pol, resolve={"site-a.test": ["127.0.0.1"],
                                                            "site-b.test": ["127.0.0.1"]}),
                       registry)
    host, port = await proxy.start()
    try:
        assert host == "127.0.0.1" and port > 0 and proxy.url == f"http://127.0.0.1:{port}"
        A, B = basic("a", TOKEN_A), basic("b", TOKEN_B)
        assert await connect_status(port, f"site-a.test:{echo}", A) == (200, b"ping")
        assert (await connect_status(port, f"site-a.test:{echo}", B))[0] == 407

        registry.add(make_client("b", TOKEN_B, ["site-b.test"]))
        assert await connect_status(port, f"site-b.test:{echo}", B) == (200, b"ping")
        assert (await connect_status(port, f"site-a.test:{echo}", B))[0] == 403

        registry.update_allow("b", ["site-a.test"])
        assert (await connect_status(port, f"site-a.test:{echo}", B))[0] == 200
        assert (await connect_status(port, f"site-b.test:{echo}", B))[0] == 403

        with pytest.raises(policy.PolicyError):
            registry.update_allow("b", ["*"])          # a bad pattern changes nothing
        assert (await connect_status(port, f"site-a.test:{echo}", B))[0] == 200
        with pytest.raises(ClientSpecError):
            registry.add(make_client("b", TOKEN_B, []))  # duplicate name

        assert registry.remove("b") is True
        assert (await connect_status(port, f"site-a.test:{echo}", B))[0] == 407

        st = proxy.status()
        assert st.listening == (host, port) and st.clients == ["a"]
        assert st.policy.error is None and st.decisions["allow"] >= 3
        assert TOKEN_A not in repr(st) and TOKEN_A not in repr(registry.get("a"))
    finally:
        await proxy.stop()
    with pytest.raises(OSError):
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)


async def test_status_reports_kept_policy_after_invalid_edit(tmp_path, echo):
    pol = write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, echo),
                       allow_always=["site-a.test"])
    proxy = GuardProxy(GuardConfig(policy_path=pol, resolve={"site-a.test": ["127.0.0.1"]}),
                       [make_client("a", TOKEN_A, [])])
    _, port = await proxy.start()
    try:
        pol.write_text("version: 1\nmode: sometimes\n")
        deadline = time.monotonic() + 3
        while proxy.status().policy.error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        snap = proxy.status().policy
        assert snap.error and "mode" in snap.error and str(pol) in snap.error
        assert snap.describe().startswith("last good policy kept since ")
        status, _ = await connect_status(port, f"site-a.test:{echo}", basic("a", TOKEN_A))
        assert status == 200  # the last good policy still allows site-a.test
    finally:
        await proxy.stop()


async def test_open_tunnel_is_cut_when_the_proxy_stops(tmp_path, echo):
    pol = write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, echo))
    proxy = GuardProxy(GuardConfig(policy_path=pol, resolve={"site-a.test": ["127.0.0.1"]}),
                       [make_client("a", TOKEN_A, ["site-a.test"])])
    _, port = await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT site-a.test:{echo} HTTP/1.1\r\nHost: site-a.test:{echo}\r\nProxy-Authorization: "
                 f"{basic('a', TOKEN_A)}\r\n\r\n".encode())
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.write(b"x")
    assert await asyncio.wait_for(reader.readexactly(1), 5) == b"x"
    await proxy.stop()
    assert await asyncio.wait_for(reader.read(10), 5) == b""  # closed: no direct route left
    writer.close()


@pytest.mark.parametrize("host,public", [("0.0.0.0", False), ("192.0.2.1", False),
                                         ("localhost", True)])
def test_listen_address_checks(host, public):
    with pytest.raises(GuardStartError):
        GuardProxy(GuardConfig(listen_host=host, listen_public=public), [])


async def test_plain_requests_answer_on_keep_alive_and_raise_requestheaders_for_each(tmp_path):
    """Plain requests on one connection are answered in turn on the same upstream connection,
    and each raises the `requestheaders` hook (the guard's decision) for every addon, also
    for one added later; no `response` hook is raised (the plain-HTTP relay has none)."""
    accepted = []

    async def handle(reader, writer):
        accepted.append(1)
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port_up = server.sockets[0].getsockname()[1]
    pol = write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, port_up))
    proxy = GuardProxy(GuardConfig(policy_path=pol, resolve={"site-a.test": ["127.0.0.1"]}),
                       ClientRegistry([make_client("a", TOKEN_A, ["site-a.test"])]))
    _, port = await proxy.start()
    seen: list[str] = []

    class Recorder:
        def requestheaders(self, flow):
            seen.append(flow.request.path)

        def response(self, flow):
            seen.append("response")

    async def three_on_one_connection() -> list[bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        got = []
        for i in range(3):
            writer.write(f"GET http://site-a.test:{port_up}/{i} HTTP/1.1\r\nHost: site-a.test:{port_up}\r\n"
                         f"Proxy-Authorization: {basic('a', TOKEN_A)}\r\n\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            got.append(head.split(b"\r\n", 1)[0] + b" " + await asyncio.wait_for(reader.readexactly(2), 5))
        writer.close()
        return got

    try:
        assert await three_on_one_connection() == [b"HTTP/1.1 200 OK ok"] * 3
        assert accepted == [1]
        proxy._master.addons.add(Recorder())
        assert await three_on_one_connection() == [b"HTTP/1.1 200 OK ok"] * 3
        assert seen == ["/0", "/1", "/2"]
        assert accepted == [1, 1]
    finally:
        await proxy.stop()
        server.close()


BODIES = [
    # (case, response head fields, body): every body must arrive whole and unchanged
    ("small, announced", "Content-Length: 10", b"0123456789"),
    ("64 KiB, announced", f"Content-Length: {64 * 1024}", b"a" * (64 * 1024)),
    ("64 KiB + 1, announced", f"Content-Length: {64 * 1024 + 1}", b"b" * (64 * 1024 + 1)),
    ("1 MiB, announced", f"Content-Length: {1 << 20}", bytes(range(256)) * 4096),
    ("300 KiB, chunked", "Transfer-Encoding: chunked", b"c" * (300 * 1024)),
]


@pytest.fixture
async def plain_guard(tmp_path):
    """A guard for plain requests to site-a.test, and an upstream that answers `/N` with
    BODIES[N]; `/stall` sends the head and 1 KiB of a 1 MiB body, then waits for `release`."""
    release = asyncio.Event()

    async def handle(reader, writer):
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                path = head.split(b" ", 2)[1].decode()
                if path == "/stall":
                    writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {1 << 20}\r\n\r\n".encode() + b"s" * 1024)
                    await writer.drain()
                    await release.wait()
                    writer.write(b"s" * ((1 << 20) - 1024))
                    await writer.drain()
                    continue
                _, fields, body = BODIES[int(path[1:])]
                wire = body
                if "chunked" in fields:
                    wire = b"".join(f"{len(body[i:i + 50000]):x}\r\n".encode() + body[i:i + 50000] + b"\r\n"
                                    for i in range(0, len(body), 50000)) + b"0\r\n\r\n"
                writer.write(f"HTTP/1.1 200 OK\r\n{fields}\r\n\r\n".encode() + wire)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port_up = server.sockets[0].getsockname()[1]
    pol = write_policy(tmp_path / "p.yaml", private_allow=["127.0.0.1/32"], ports=(80, 443, port_up))
    proxy = GuardProxy(GuardConfig(policy_path=pol, resolve={"site-a.test": ["127.0.0.1"]}),
                       ClientRegistry([make_client("a", TOKEN_A, ["site-a.test"])]))
    _, port = await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send(path: str) -> bytes:
        writer.write(f"GET http://site-a.test:{port_up}{path} HTTP/1.1\r\nHost: site-a.test:{port_up}\r\n"
                     f"Proxy-Authorization: {basic('a', TOKEN_A)}\r\n\r\n".encode())
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)

    yield send, reader, release
    writer.close()
    await proxy.stop()
    server.close()


async def read_body(reader, head: bytes) -> bytes:
    fields = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if ": " in line)
    if "Content-Length" in fields:
        return await asyncio.wait_for(reader.readexactly(int(fields["Content-Length"])), 10)
    body = b""
    while size := int((await asyncio.wait_for(reader.readline(), 10)).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return body


async def test_response_bodies_small_and_large_arrive_whole_on_one_keep_alive_connection(plain_guard):
    send, reader, _ = plain_guard
    for i, (_case, _fields, body) in enumerate(BODIES):
        head = await send(f"/{i}")
        assert head.startswith(b"HTTP/1.1 200")
        assert await read_body(reader, head) == body


async def test_a_large_response_is_streamed_not_buffered(plain_guard):
    send, reader, release = plain_guard
    head = await send("/stall")
    # the upstream holds the rest back until the client has the first KiB: only a streamed
    # body gets there (a buffered one would wait for all 1 MiB)
    assert await asyncio.wait_for(reader.readexactly(1024), 10) == b"s" * 1024
    release.set()
    assert await asyncio.wait_for(reader.readexactly((1 << 20) - 1024), 10) == b"s" * ((1 << 20) - 1024)
    assert head.startswith(b"HTTP/1.1 200")
