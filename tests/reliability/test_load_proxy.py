"""Load on one guard proxy (`sfguard proxy`, real mitmproxy): many concurrent CONNECT tunnels
moving data both ways. Checks: no tunnel fails, none stalls, the proxy's memory stays bounded.
CI runs 100 tunnels for 5 s; `-m slow` runs 500 tunnels for 30 s."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import free_port
from tests.daemon.conftest import ROOT

pytestmark = pytest.mark.reliability
RESULTS = os.environ.get("SFGUARD_RELIABILITY_RESULTS", "/tmp/sfguard-reliability-results.jsonl")
CHUNK = 16 * 1024
STALL = 20.0          # a round trip slower than this counts as a stall (liveness, not speed)


def record_result(case: str, **numbers) -> None:
    with open(RESULTS, "a") as fh:
        fh.write(json.dumps({"case": case, "ts": time.time(), **numbers}) + "\n")


async def echo_server(port: int):
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter):
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()
    return await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)


async def tunnel(proxy_port: int, target_port: int, auth: str, until: float, stats: dict) -> None:
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy_port), STALL)
    try:
        w.write(f"CONNECT 127.0.0.1:{target_port} HTTP/1.1\r\nHost: 127.0.0.1:{target_port}\r\n"
                f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), STALL)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"CONNECT refused: {head[:60]!r}")
        # A binary protocol on an explicitly allowed port. Its first byte is fixed: a tunnel
        # whose first byte is 0x16 is judged as a TLS ClientHello (random bytes are not a valid
        # one: `tls_hello_invalid`, closed), and one starting with a capital as an HTTP request.
        payload = b"\x00" + os.urandom(CHUNK - 1)
        while time.monotonic() < until:
            t0 = time.monotonic()
            w.write(payload)
            await w.drain()
            back = await asyncio.wait_for(r.readexactly(CHUNK), STALL)
            if back != payload:
                raise RuntimeError("tunnel corrupted the data")
            stats["bytes"] += 2 * CHUNK
            stats["max_rtt"] = max(stats["max_rtt"], time.monotonic() - t0)
    finally:
        w.close()


async def load(proxy_port: int, target: int, tunnels: int, seconds: float,
               proc: psutil.Process) -> dict:
    server = await echo_server(target)
    auth = base64.b64encode(b"load:load-token-0123456789").decode()
    stats = {"bytes": 0, "max_rtt": 0.0}
    rss = [proc.memory_info().rss]
    until = time.monotonic() + seconds
    # ramp up in batches so the accept backlog is never the thing under test
    tasks = []
    for i in range(tunnels):
        tasks.append(asyncio.ensure_future(tunnel(proxy_port, target, auth, until, stats)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)

    async def sample():
        while time.monotonic() < until:
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(0.5)
    sampler = asyncio.ensure_future(sample())
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await sampler
    rss.append(proc.memory_info().rss)
    server.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    return {"errors": errors, "bytes": stats["bytes"], "max_rtt": stats["max_rtt"],
            "rss_start": rss[0], "rss_peak": max(rss), "rss_end": rss[-1]}


def run_load(tmp_path, tunnels: int, seconds: float) -> dict:
    """Start `sfguard proxy` (allowing only the echo server), push the load, stop it."""
    port, echo_port = free_port(), free_port()
    pol = tmp_path / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {echo_port}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sfguard.cli.main", "proxy", "--allow", "127.0.0.1", "--policy", str(pol),
         "--listen", f"127.0.0.1:{port}", "--client", "load:load-token-0123456789",
         "--decision-log", str(tmp_path / "decisions.log")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=open(tmp_path / "proxy.err", "wb"))
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("ready "), line + (tmp_path / "proxy.err").read_text()
        out = asyncio.run(load(port, echo_port, tunnels, seconds, psutil.Process(proc.pid)))
        out["proxy_alive"] = proc.poll() is None
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def check(case: str, out: dict, tunnels: int, seconds: float) -> None:
    mb = 1024 * 1024
    record_result(case, tunnels=tunnels, seconds=seconds, errors=len(out["errors"]),
                  mbytes=round(out["bytes"] / mb, 1), max_rtt_s=round(out["max_rtt"], 3),
                  rss_start_mb=round(out["rss_start"] / mb, 1), rss_peak_mb=round(out["rss_peak"] / mb, 1),
                  rss_end_mb=round(out["rss_end"] / mb, 1))
    print(f"\n{case}: {tunnels} tunnels x {seconds}s: {out['bytes'] / mb:.0f} MiB moved, max round "
          f"trip {out['max_rtt']:.2f}s, proxy RSS {out['rss_start'] / mb:.0f} -> peak "
          f"{out['rss_peak'] / mb:.0f} MiB, errors {len(out['errors'])}")
    assert out["errors"] == [], [repr(e) for e in out["errors"][:5]]
    assert out["proxy_alive"]
    assert out["bytes"] >= tunnels * 2 * CHUNK          # every tunnel moved data
    # bounded memory: a fixed budget per tunnel (buffers) over the idle proxy, not growth with time
    assert out["rss_peak"] - out["rss_start"] < 150 * mb + tunnels * 512 * 1024, out


def test_proxy_100_tunnels_5s(tmp_path):
    out = run_load(tmp_path, 100, 5)
    check("proxy_100x5s", out, 100, 5)


@pytest.mark.slow
def test_proxy_500_tunnels_30s(tmp_path):
    out = run_load(tmp_path, 500, 30)
    check("proxy_500x30s", out, 500, 30)
