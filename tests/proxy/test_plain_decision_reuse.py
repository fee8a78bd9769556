"""A kept-alive plain-HTTP connection uses its last allowed decision again only while nothing
it depends on changed (proxy_addons/connect_guard.py, `requestheaders`). Each case opens one
connection, gets one request allowed, changes one thing (the policy file, the client's
allowlist, the client set, the Host header, the URL's host) and checks what the next request
on the same connection gets, what reached the site and what the decision log says."""
from __future__ import annotations

import asyncio

import pytest

from .conftest import TOKEN_A, InProcessGuard, basic, in_process_guard, write_policy

A = basic("a", TOKEN_A)


class Site:
    """Answers every request with `200 ok`, keeps the connection, counts requests."""

    def __init__(self) -> None:
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def guard(tmp_path):
    """The in-process guard (tests/proxy/conftest.py) with the site's request count beside it:
    client `a` may reach site-a.test and site-b.test."""
    site = Site()
    names = ("site-a.test", "site-b.test")
    async with in_process_guard(tmp_path, site.handle, allow=names, names=names, site=site,
                                policy_poll_interval=0.05) as g:
        yield g


class Conn:
    """One kept-alive client connection to the guard."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: int) -> None:
        self.reader, self.writer, self.up = reader, writer, up

    async def get(self, host: str = "site-a.test", host_header: str | None = None) -> tuple[int, bytes]:
        hh = host_header if host_header is not None else f"{host}:{self.up}"
        self.writer.write(f"GET http://{host}:{self.up}/x HTTP/1.1\r\nHost: {hh}\r\n"
                          f"Proxy-Authorization: {A}\r\n\r\n".encode())
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        body = await asyncio.wait_for(self.reader.readexactly(length), 5)
        return int(head.split(b" ", 2)[1]), body

    def close(self) -> None:
        self.writer.close()


async def connect(g: InProcessGuard) -> Conn:
    reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
    return Conn(reader, writer, g.up)


async def block_site_a(g: InProcessGuard) -> None:
    """Edit the policy file to block site-a.test and wait (bounded) until a new connection
    is refused, i.e. the guard reloaded it."""
    write_policy(g.policy, private_allow=["127.0.0.1/32"], ports=(80, 443, g.up), block=["site-a.test"])
    for _ in range(100):
        probe = await connect(g)
        try:
            status, _ = await probe.get()
        except asyncio.IncompleteReadError:
            status = 0
        probe.close()
        if status == 403:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the policy edit was not loaded in 5 s")


async def narrow_allowlist(g: InProcessGuard) -> None:
    g.registry.update_allow("a", ["site-b.test"])


async def remove_client(g: InProcessGuard) -> None:
    g.registry.remove("a")


# (case, the change, the second request's (URL host, Host header), its status, its reason)
CHANGES = [
    ("policy-reloaded", block_site_a, ("site-a.test", None), 403, "blocked_by_policy"),
    ("allowlist-narrowed", narrow_allowlist, ("site-a.test", None), 403, "not_allowed"),
    ("client-removed", remove_client, ("site-a.test", None), 407, None),
    ("other-host-header", None, ("site-a.test", "site-b.test"), 400, "host_header_mismatch"),
]


@pytest.mark.parametrize("change,second,status,reason", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
async def test_a_change_is_judged_afresh_on_a_kept_alive_connection(guard, change, second, status, reason):
    conn = await connect(guard)
    assert await conn.get() == (200, b"ok")
    if change is not None:
        await change(guard)
    before = guard.site.requests
    host, host_header = second
    hh = f"{host_header}:{guard.up}" if host_header else None
    got, _ = await conn.get(host, hh)
    conn.close()
    assert got == status
    assert guard.site.requests == before  # nothing of the refused request reached the site
    if reason is not None:
        last = guard.lines()[-1]
        assert (last["decision"], last["reason"], last["host"]) == ("deny", reason, "site-a.test")


async def test_every_request_on_a_kept_alive_connection_is_logged_with_its_decision(guard):
    conn = await connect(guard)
    got = [await conn.get(h) for h in ("site-a.test", "site-a.test", "site-b.test", "site-a.test")]
    conn.close()
    assert got == [(200, b"ok")] * 4
    assert guard.site.requests == 4
    lines = [(x["method"], x["host"], x["decision"], x["reason"], x["rule"], x["addr"]) for x in guard.lines()]
    assert lines == [("GET", h, "allow", "allowed_by_run", f"--allow {h}", "127.0.0.1")
                     for h in ("site-a.test", "site-a.test", "site-b.test", "site-a.test")]
