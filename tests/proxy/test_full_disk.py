"""A full disk under the decision log: the proxy fails closed. An allowed request whose
decision cannot be written is refused (403, reason decision_log_unwritable, the site sees
nothing), on a new connection, on a kept-alive one and for a CONNECT; when space returns the
same requests pass again by themselves. The log is on a small tmpfs made for the test."""
from __future__ import annotations

import asyncio
import os

import pytest

from tests.disk import fill, small_tmpfs

from .conftest import TOKEN_A, basic, in_process_guard
from .test_plain_decision_reuse import Conn, Site, connect

A = basic("a", TOKEN_A)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


async def connect_tunnel(port: int, up: int) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT site-a.test:{up} HTTP/1.1\r\nHost: site-a.test:{up}\r\n"
                 f"Proxy-Authorization: {A}\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    return int(head.split(b" ", 2)[1]), head


async def test_decisions_that_cannot_be_logged_are_refused_until_space_returns(tmp_path):
    site = Site()
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        async with in_process_guard(disk, site.handle, site=site) as g:
            kept: Conn = await connect(g)
            assert (await kept.get())[0] == 200
            assert site.requests == 1
            filler = fill(disk)
            # the log's last page may still hold a few lines; then every write fails
            for passed in range(100):  # noqa: B007 (how many passed is checked below)
                fresh = await connect(g)
                status, body = await fresh.get()
                fresh.close()
                if status != 200:
                    break
            assert status == 403 and b"could not record" in body, (status, body)
            assert site.requests == 1 + passed
            status, _ = await kept.get()            # the kept-alive decision is not reused
            assert status == 403
            status, head = await connect_tunnel(g.port, g.up)
            assert status == 403 and b"reason=decision_log_unwritable" in head
            assert site.requests == 1 + passed        # nothing more reached the site
            filler.unlink()                           # space returns
            again = await connect(g)
            assert (await again.get())[0] == 200
            again.close()
            assert (await connect_tunnel(g.port, g.up))[0] == 200
            assert site.requests == 2 + passed
            kept.close()
            # every request that reached the site has its line in the log
            allowed = [x for x in g.log.read_text().splitlines() if '"decision":"allow"' in x]
            assert len(allowed) == site.requests + 1      # + the CONNECT's own line
