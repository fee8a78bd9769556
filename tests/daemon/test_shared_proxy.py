"""One proxy process for every run (`sfguard start --proxies shared`,
supervisor/daemon/shared_proxy.py): each run keeps its own listener, its own credentials (bound
to that listener), its own decision lines; a run's end closes its listener and cuts its open
connections; a killed process fails every run closed and comes back once on the same ports.
Real proxies forked from the zygote, a real HTTP server on 127.0.0.1, requests as a browser
sends them; the last test drives a real guard with real Chromium and agent-browser."""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.daemon import shared_proxy
from sfguard.supervisor.daemon.shared_proxy import SharedPool
from sfguard.supervisor.errors import BrowserStartError
from tests.daemon.test_proxy_zygote import Site, afetch, site, wait_until  # noqa: F401 (fixture)

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def pool(tmp_path: Path, site: int):  # noqa: F811 - the fixture imported above
    policy = tmp_path / "sites.yaml"
    policy.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                      "private_networks:\n  allow: [127.0.0.1/32]\n")
    log = tmp_path / "decisions.log"
    p = SharedPool(policy, log, {"site.test": "127.0.0.1", "other.test": "127.0.0.1"})
    yield p, log
    await p.stop()


def listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def tunnel(port: int, cred: str, host: str, to: int) -> socket.socket:
    """An open CONNECT tunnel through the listener on `port` (as a browser opens for https)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    auth = base64.b64encode(cred.encode()).decode()
    s.sendall(f"CONNECT {host}:{to} HTTP/1.1\r\nHost: {host}:{to}\r\n"
              f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


def cred_of(url: str) -> str:
    return url.split("//", 1)[1].rsplit("@", 1)[0]


async def test_runs_share_one_process_each_with_its_own_listener_and_credentials(pool, site):  # noqa: F811
    p, log = pool
    a, b = await p.take("run-a"), await p.take("run-b")
    assert a.proc is b.proc and a.proc is not None and a.port != b.port
    assert {a.port, b.port} <= listening_ports(a.proc.pid)
    ca = await a.add_client([f"site.test:{site}"])
    cb = await b.add_client([f"other.test:{site}"])
    assert await afetch(a.url_for(ca), f"http://site.test:{site}/a") == 200
    assert await afetch(b.url_for(cb), f"http://other.test:{site}/b") == 200
    # each run's allowlist is its own
    assert await afetch(a.url_for(ca), f"http://other.test:{site}/x") == 403
    # run a's credential is nothing on run b's listener, though one process holds both
    stolen = a.url_for(ca).replace(f":{a.port}", f":{b.port}")
    assert await afetch(stolen, f"http://site.test:{site}/y") == 407
    # nor on the process's own first listener, which no run's client is bound to
    assert p.host.port not in (a.port, b.port)
    assert await afetch(a.url_for(ca).replace(f":{a.port}", f":{p.host.port}"), f"http://site.test:{site}/h") == 407
    # and no credential at all is nothing on a run's own listener
    assert await afetch(f"http://127.0.0.1:{a.port}", f"http://site.test:{site}/n") == 407
    assert Site.hits == ["/a", "/b"]
    seen = [(d["run"], d["host"], d["decision"]) for d in map(json.loads, log.read_text().splitlines())]
    assert seen == [("run-a", "site.test", "allow"), ("run-b", "other.test", "allow"),
                    ("run-a", "other.test", "deny"), (None, "site.test", "deny"),   # on b's port
                    (None, "site.test", "deny")], seen          # on the first listener; none: no line
    # a client removed from run a is refused on its listener at once
    url_a = a.url_for(ca)
    await a.remove_client(ca)
    assert await afetch(url_a, f"http://site.test:{site}/z") == 407


async def test_a_runs_end_closes_its_listener_and_cuts_its_open_tunnels(pool, site):  # noqa: F811
    p, _ = pool
    a, b = await p.take("run-a"), await p.take("run-b")
    ca = await a.add_client([f"site.test:{site}"])
    cb = await b.add_client([f"site.test:{site}"])
    ta = tunnel(a.port, cred_of(a.url_for(ca)), "site.test", site)
    tb = tunnel(b.port, cred_of(b.url_for(cb)), "site.test", site)
    port_a = a.port
    await a.stop()                       # what the run's teardown does
    ta.settimeout(10)
    assert ta.recv(1) == b""             # run a's open tunnel was cut
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port_a), timeout=5).close()
    # run b's tunnel and listener are untouched
    tb.sendall(b"GET /still HTTP/1.1\r\nHost: site.test\r\nConnection: close\r\n\r\n")
    tb.settimeout(10)
    assert tb.recv(4096).startswith(b"HTTP/1.0 200") and Site.hits[-1] == "/still"
    assert await afetch(b.url_for(cb), f"http://site.test:{site}/b") == 200
    ta.close()
    tb.close()


async def test_a_killed_shared_process_fails_every_run_closed_and_comes_back_once(pool, site):  # noqa: F811
    p, _ = pool
    a, b = await p.take("run-a"), await p.take("run-b")
    ca = await a.add_client([f"site.test:{site}"])
    cb = await b.add_client([f"site.test:{site}"])
    urls = (a.url_for(ca), b.url_for(cb))
    old = a.proc.pid
    os.kill(old, signal.SIGKILL)
    await wait_until(lambda: not a.alive() and not b.alive(), "the guard did not see the proxy die")
    assert await afetch(urls[0], f"http://site.test:{site}/down") is None   # fail closed
    assert await afetch(urls[1], f"http://site.test:{site}/down") is None
    for run in (a, b):                   # what the watchdog does for each active run
        if not run.alive():
            run.restarts += 1
            await run.stop()
            await run.start()
    assert a.proc.pid != old and a.proc is b.proc
    assert (a.url_for(ca), b.url_for(cb)) == urls          # the same ports, the same credentials
    assert a.restarts == b.restarts == 1
    assert await afetch(urls[0], f"http://site.test:{site}/up-a") == 200
    assert await afetch(urls[1], f"http://site.test:{site}/up-b") == 200
    assert Site.hits == ["/up-a", "/up-b"]


async def test_a_port_taken_meanwhile_is_replaced_and_no_port_at_all_is_an_error(pool, site, monkeypatch):  # noqa: F811
    p, _ = pool
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    real = shared_proxy.free_port
    picks = iter([taken])
    monkeypatch.setattr(shared_proxy, "free_port", lambda: next(picks, None) or real())
    a = await p.take("run-a")
    assert a.port != taken and a.alive()
    ca = await a.add_client([f"site.test:{site}"])
    assert await afetch(a.url_for(ca), f"http://site.test:{site}/a") == 200
    monkeypatch.setattr(shared_proxy, "free_port", lambda: taken)
    with pytest.raises(BrowserStartError):
        await p.take("run-b")
    assert a.alive() and await afetch(a.url_for(ca), f"http://site.test:{site}/a2") == 200
    busy.close()
