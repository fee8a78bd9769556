"""Pacing's added latency per request (issue 49): the counters on the shared PostgreSQL store.

    ./dev bench pace_bench [--requests N] [--rounds N]

A real PostgreSQL (tests/pgserver.py, the server the tests use: unix socket, fsync off) and a
run proxy started as the daemon starts one (`python -O -m sfguard.supervisor.daemon.proxy_child`),
its client on a profile's pace, a plain-HTTP site on 127.0.0.1 paced far above what is sent:
- the store call alone: `PgPaceStore.take` one after another (p50, p90, p99), and the local
  file store's (`FilePaceStore`) for comparison;
- one GET at a time through the proxy, keep-alive: with the pace on the shared store, on the
  local folder, and without a pace, in interleaved rounds; the added latency is the difference
  of the p50s (target: p50 under 2 ms for the shared store).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.policy.pace import Rate  # noqa: E402
from sfguard.proxy_addons.pacing import FilePaceStore  # noqa: E402
from sfguard.supervisor.daemon.run_proxy import child_argv  # noqa: E402
from sfguard.supervisor.profiles.pg_pace import PgPaceStore  # noqa: E402
from sfguard.supervisor.profiles.pg_schema import migrate  # noqa: E402

TOKEN = "bench-pace-token-0123456789"
SITE = r"""
import asyncio
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
async def handle(reader, writer):
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(ANSWER)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()
async def main():
    s = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(s.sockets[0].getsockname()[1], flush=True)
    await s.serve_forever()
asyncio.run(main())
"""
FAST = Rate("requests", "bench", 60.0 / 10_000_000, 1000, "wait", 5.0, "bench")


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * p))] * 1000


async def store_calls(store, n: int) -> list[float]:
    out = []
    for _ in range(20):
        await store.take([("p:local/bench|requests|bench", FAST)])
    for _ in range(n):
        t0 = time.perf_counter()
        result = await store.take([("p:local/bench|requests|bench", FAST)])
        out.append(time.perf_counter() - t0)
        assert result.ok
    return out


def start_proxy(tmp: Path, site: int, mode: str, url: str) -> tuple[subprocess.Popen, int]:
    pace = "" if mode == "off" else ('pace:\n  - pattern: shop.test\n    reason: "bench"\n'
                                      '    requests_per_minute: 10000000\n    burst: 1000\n')
    policy = tmp / f"sites-{mode}.yaml"
    policy.write_text(f"version: 1\nports: [80, 443, {site}]\nprivate_networks:\n  allow: [\"127.0.0.1/32\"]\n"
                      + pace)
    argv = child_argv(0, policy, tmp / "decisions.log", {"shop.test": "127.0.0.1"}, pace_dir=tmp / f"pace-{mode}")
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    port = int(proc.stdout.readline().rsplit(":", 1)[1])
    msg = {"id": 1, "clients": [{"name": "b-1", "token": TOKEN, "allow": ["shop.test"], "run": "r-bench",
                                 "pace_key": "p:local/bench"}]}
    if mode == "shared":
        msg["pace_store"] = url
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"ack": 1}
    return proc, port


async def gets(port: int, site: int, n: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = base64.b64encode(f"b-1:{TOKEN}".encode()).decode()
    head = (f"GET http://shop.test:{site}/ HTTP/1.1\r\nHost: shop.test:{site}\r\n"
            f"Proxy-Authorization: Basic {auth}\r\n\r\n").encode()
    out = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        writer.write(head)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        if i >= 20:
            out.append(time.perf_counter() - t0)
    writer.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import psycopg

    from tests.pgserver import PgServer
    server = PgServer().start()
    tmp = Path(tempfile.mkdtemp(prefix="sfg-pace-bench-"))
    site = subprocess.Popen([sys.executable, "-c", SITE], stdout=subprocess.PIPE, text=True)
    try:
        url = server.create_db()
        with psycopg.connect(url) as conn:
            migrate(conn)
        pg, local = PgPaceStore(url), FilePaceStore(tmp / "calls")
        pg_calls = asyncio.run(store_calls(pg, args.requests))
        file_calls = asyncio.run(store_calls(local, args.requests))
        asyncio.run(pg.close())
        print(f"store call, {args.requests} one after another (ms):")
        for name, s in (("PostgreSQL", pg_calls), ("file", file_calls)):
            print(f"  {name:11} p50 {pct(s, 0.5):.3f}  p90 {pct(s, 0.9):.3f}  p99 {pct(s, 0.99):.3f}")
        assert site.stdout is not None
        site_port = int(site.stdout.readline())
        p50s: dict[str, list[float]] = {"off": [], "local": [], "shared": []}
        for _ in range(args.rounds):
            for mode in p50s:
                proc, port = start_proxy(tmp, site_port, mode, url)
                try:
                    p50s[mode].append(pct(asyncio.run(gets(port, site_port, args.requests)), 0.5))
                finally:
                    proc.stdin.close()
                    proc.wait(20)
        print(f"\nGET through the run proxy, keep-alive, {args.requests} one after another, p50 ms per round:")
        for mode, vals in p50s.items():
            print(f"  pace {mode:7} {' '.join(f'{v:.3f}' for v in vals)}   median {statistics.median(vals):.3f}")
        for mode in ("local", "shared"):
            added = [a - b for a, b in zip(p50s[mode], p50s["off"], strict=True)]
            print(f"  added by the pace ({mode}): median {statistics.median(added):.3f} ms "
                  f"[{min(added):.3f} .. {max(added):.3f}]" + ("   (target < 2 ms)" if mode == "shared" else ""))
    finally:
        site.terminate()
        site.wait(10)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
