"""The runs' proxies forked from the zygote (supervisor/daemon/proxy_zygote.py): each one is a
process of its own, in its own session, that serves only its own run's clients; a dead proxy is
seen through its pidfd and restarted on its port; a dead zygote harms no running proxy and is
replaced on the next start; the zygote ends with the guard's end of the socket. Real proxies,
a real HTTP server on 127.0.0.1, requests as a browser sends them (urllib through the proxy)."""
from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.daemon.proxy_zygote import ENV_SWITCH, ForkedProxy, Zygote
from sfguard.supervisor.daemon.run_proxy import RunProxy

pytestmark = pytest.mark.asyncio


class Site(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        Site.hits.append(self.path)
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def site():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    Site.hits = []
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
async def rig(tmp_path: Path, site: int):
    policy = tmp_path / "sites.yaml"
    policy.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                      "private_networks:\n  allow: [127.0.0.1/32]\n")
    log = tmp_path / "decisions.log"
    zygote = Zygote(policy, log)
    made: list[RunProxy] = []

    async def proxy(run: str) -> RunProxy:
        p = RunProxy(run, policy, log, {"site.test": "127.0.0.1", "other.test": "127.0.0.1"}, zygote)
        made.append(p)
        await p.start()
        return p
    yield zygote, proxy, log
    for p in made:
        await p.stop()
    await zygote.stop()


def fetch(proxy_url: str, url: str) -> int | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy_url}))
    try:
        with opener.open(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


async def afetch(proxy_url: str, url: str) -> int | None:
    return await asyncio.to_thread(fetch, proxy_url, url)


async def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.05)


async def test_each_runs_proxy_is_its_own_forked_process_serving_only_its_clients(rig, site):
    zygote, proxy, log = rig
    a, b = await proxy("run-a"), await proxy("run-b")
    assert isinstance(a.proc, ForkedProxy) and isinstance(b.proc, ForkedProxy)
    za = psutil.Process(zygote.proc.pid)
    pa, pb = psutil.Process(a.proc.pid), psutil.Process(b.proc.pid)
    # children of the zygote, each in a session of its own, none the zygote itself
    assert {pa.ppid(), pb.ppid()} == {za.pid} and len({pa.pid, pb.pid, za.pid}) == 3
    assert os.getsid(pa.pid) == pa.pid and os.getsid(pb.pid) == pb.pid
    ca = await a.add_client([f"site.test:{site}"])
    cb = await b.add_client([f"other.test:{site}"])
    assert await afetch(a.url_for(ca), f"http://site.test:{site}/a") == 200
    assert await afetch(b.url_for(cb), f"http://other.test:{site}/b") == 200
    # each run's allowlist is its own: a's client may not reach b's host, and the site never sees it
    assert await afetch(a.url_for(ca), f"http://other.test:{site}/x") == 403
    # a credential of run a is nothing to run b's proxy (b never had it)
    stolen = a.url_for(ca).replace(f":{a.port}", f":{b.port}")
    assert await afetch(stolen, f"http://site.test:{site}/y") == 407
    assert Site.hits == ["/a", "/b"]
    # each decision is logged by the proxy that made it, under its run (the stolen credential
    # names none: it is no client of b's)
    seen = [(d["run"], d["host"], d["decision"]) for d in map(json.loads, log.read_text().splitlines())]
    assert seen == [("run-a", "site.test", "allow"), ("run-b", "other.test", "allow"),
                    ("run-a", "other.test", "deny"), (None, "site.test", "deny")], seen


async def test_a_killed_proxy_is_seen_dead_and_restarts_on_its_port(rig, site):
    zygote, proxy, _ = rig
    a = await proxy("run-a")
    ca = await a.add_client([f"site.test:{site}"])
    url = a.url_for(ca)
    old = a.proc.pid
    os.kill(old, signal.SIGKILL)
    await wait_until(lambda: not a.alive(), "the guard did not see its proxy die")
    # alive() can see the process gone (its record) a moment before the pidfd's exit status
    # lands (seen once in a clean-clone run): the pidfd must report it too, within the bound
    await wait_until(lambda: a.proc.returncode is not None, "the proxy's pidfd did not report its end")
    assert await afetch(url, f"http://site.test:{site}/down") is None   # fail closed
    await a.start()                                # what the watchdog does
    assert a.proc.pid != old and url == a.url_for(ca)
    assert await afetch(url, f"http://site.test:{site}/up") == 200
    assert Site.hits == ["/up"]


async def test_a_dead_zygote_harms_no_running_proxy_and_is_replaced(rig, site):
    zygote, proxy, _ = rig
    a = await proxy("run-a")
    ca = await a.add_client([f"site.test:{site}"])
    first = zygote.proc.pid
    os.kill(first, signal.SIGKILL)
    await wait_until(lambda: not zygote.alive(), "the zygote's end was not seen")
    assert a.alive()
    assert await afetch(a.url_for(ca), f"http://site.test:{site}/still") == 200
    b = await proxy("run-b")                       # forked from a new zygote
    assert zygote.proc.pid != first and psutil.Process(b.proc.pid).ppid() == zygote.proc.pid
    cb = await b.add_client([f"site.test:{site}"])
    assert await afetch(b.url_for(cb), f"http://site.test:{site}/new") == 200


async def test_the_zygote_and_its_proxies_end_with_the_guards_pipes(rig, site):
    zygote, proxy, _ = rig
    a = await proxy("run-a")
    za, pa = psutil.Process(zygote.proc.pid), psutil.Process(a.proc.pid)
    await zygote.stop()            # the guard's end of the socket closes
    await asyncio.to_thread(za.wait, 10)
    assert pa.is_running() and a.alive()       # a run's proxy lives on its own pipes
    a.proc.stdin.close()           # the guard is gone: its proxy stops
    await asyncio.to_thread(pa.wait, 10)
    await wait_until(lambda: not a.alive(), "the proxy's end was not seen")


async def test_the_switch_starts_proxies_as_processes_of_their_own(rig, site, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    zygote, proxy, _ = rig
    a = await proxy("run-a")
    assert not isinstance(a.proc, ForkedProxy) and zygote.proc is None
    assert "sfguard.supervisor.daemon.proxy_child" in psutil.Process(a.proc.pid).cmdline()


async def test_a_forked_proxy_survives_a_broken_pipe_as_a_started_one_does(rig, site):
    """A write to a connection the browser already closed raises SIGPIPE: a proxy must ignore
    it (as Python sets it up at start) or every closed tab could end the whole run's proxy.
    Found when forked proxies died with signal 13 under a real guard."""
    zygote, proxy, _ = rig
    a = await proxy("run-a")
    ca = await a.add_client([f"site.test:{site}"])
    status = dict(line.split(":", 1) for line in open(f"/proc/{a.proc.pid}/status").read().splitlines())
    assert int(status["SigIgn"], 16) & (1 << (signal.SIGPIPE - 1)), "SIGPIPE is not ignored"
    os.kill(a.proc.pid, signal.SIGPIPE)
    await asyncio.sleep(0.3)
    assert a.alive() and await afetch(a.url_for(ca), f"http://site.test:{site}/after") == 200
