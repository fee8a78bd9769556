"""Guard proxy benchmark: direct vs bare mitmdump (passthrough) vs squid (if installed) vs guard.

    ./dev bench proxy_bench [--setup N] [--tunnels N] [--concurrency N] [--mb N] [--rounds N]

Everything runs on 127.0.0.1 in this one command, and the baseline is measured in the same run:
- CONNECT set-up latency: open a TCP connection to the proxy, CONNECT, read the 200, send one
  byte through the tunnel and read it back from the echo server (p50, p99; sequential).
- Throughput: MB/s downloaded through one tunnel (median of 3 transfers).
- Tunnels per second with `--concurrency` clients opening tunnels in a loop (each carrying one
  echoed byte), and the proxy process's CPU time per tunnel (psutil user+system delta / tunnels).
- RSS of the proxy process: idle after start, and the peak sampled under the concurrent load.
- Plain HTTP (absolute-form GETs of a 2 KB answer on kept-alive connections, as browsers send
  http:// URLs to a proxy): p50 latency of one request at a time, and the proxy's CPU time per
  request with 6 clients sending `--requests` requests in all (direct: origin-form GETs to the
  same site, for the latency only).
`guard-paced` is guard-run with pacing on (issue 49): its policy paces the bench host with limits
it never reaches (every request and tunnel still counted in the pace folder's files, the
connection cap held), and its client counts on a profile's pace; `paced / run` per round is the
cost of pacing what is under its limits (target <= 1.05x).
Every proxy is measured once per round, in turn, for `--rounds` rounds (interleaved, so a
noisy spell of the machine hits all of them); ratios against bare mitmdump are taken per round
and printed as median [min-max]. Targets: CPU/tunnel <= 0.5x (issue 14), set-up p50 <= 0.7x,
throughput >= 0.8x, RSS < 120 MB. `guard-run` is the process the daemon really runs per run
(`python -O -m sfguard.supervisor.daemon.proxy_child`, argv from run_proxy.child_argv, the one
proxy entry point: `sfguard proxy` calls the same `serve()`), so this measures what the daemon runs.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from sfguard.supervisor.daemon.run_proxy import child_argv

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
TOKEN = "bench-token-0123456789abcdef"
HOST = "bench.test"

UPSTREAM_CODE = r"""
import asyncio, sys
CHUNK = b"\0" * 65536
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2048\r\n\r\n" + b"x" * 2048
async def handle(reader, writer):
    try:
        first = await reader.read(65536)
        if first.startswith(b"GET "):  # plain HTTP: one answer (one write) per request head
            buf = first
            while buf:
                n = buf.count(b"\r\n\r\n")
                if n:
                    writer.write(ANSWER * n)
                    buf = buf[buf.rfind(b"\r\n\r\n") + 4:]
                more = await reader.read(65536)
                if not more:
                    break
                buf += more
        elif first.startswith(b"SEND "):
            n = int(first.split()[1])
            while n > 0:
                writer.write(CHUNK[:min(n, len(CHUNK))]); n -= len(CHUNK)
                await writer.drain()
        else:
            data = first
            while data:
                writer.write(data); await writer.drain()
                data = await reader.read(65536)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""

MITM_ADDON = """
from mitmproxy import http
ALLOWED = {"bench.test", "127.0.0.1"}
def http_connect(flow):
    if flow.request.host not in ALLOWED:
        flow.response = http.Response.make(403, b"denied")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout} s")


@dataclass
class Target:
    name: str
    proc: subprocess.Popen | None       # the proxy process (None: direct)
    port: int | None                    # proxy port (None: direct)
    auth: str | None                    # Proxy-Authorization value
    connect_host: str                   # host named in CONNECT


async def open_tunnel(t: Target, upstream_port: int):
    if t.port is None:
        return await asyncio.open_connection("127.0.0.1", upstream_port)
    reader, writer = await asyncio.open_connection("127.0.0.1", t.port)
    head = f"CONNECT {t.connect_host}:{upstream_port} HTTP/1.1\r\nHost: {t.connect_host}:{upstream_port}\r\n"
    if t.auth:
        head += f"Proxy-Authorization: {t.auth}\r\n"
    writer.write(head.encode() + b"\r\n")
    status = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in status.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"{t.name}: CONNECT failed: {status[:80]!r}")
    return reader, writer


async def one_echo_tunnel(t: Target, upstream_port: int) -> float:
    start = time.perf_counter()
    reader, writer = await open_tunnel(t, upstream_port)
    writer.write(b"x")
    got = await reader.readexactly(1)
    elapsed = time.perf_counter() - start
    assert got == b"x"
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return elapsed


async def measure_setup(t: Target, upstream_port: int, n: int) -> tuple[float, float]:
    for _ in range(20):  # warm-up
        await one_echo_tunnel(t, upstream_port)
    samples = sorted([await one_echo_tunnel(t, upstream_port) for _ in range(n)])
    return samples[len(samples) // 2] * 1000, samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1000


async def measure_throughput(t: Target, upstream_port: int, mb: int) -> float:
    total = mb * 1024 * 1024
    reader, writer = await open_tunnel(t, upstream_port)
    start = time.perf_counter()
    writer.write(f"SEND {total}\n".encode())
    got = 0
    while got < total:
        chunk = await reader.read(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    elapsed = time.perf_counter() - start
    writer.close()
    return got / elapsed / 1e6


def proc_cpu(p: psutil.Process) -> float:
    ct = p.cpu_times()
    return ct.user + ct.system


async def measure_concurrent(t: Target, upstream_port: int, tunnels: int, concurrency: int):
    proc = psutil.Process(t.proc.pid) if t.proc else None
    peak_rss = [proc.memory_info().rss if proc else 0]
    stop = threading.Event()

    def sample():
        while not stop.is_set() and proc:
            try:
                peak_rss[0] = max(peak_rss[0], proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    remaining = [tunnels]

    async def worker():
        while remaining[0] > 0:
            remaining[0] -= 1
            await one_echo_tunnel(t, upstream_port)

    cpu0 = proc_cpu(proc) if proc else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    cpu1 = proc_cpu(proc) if proc else 0.0
    stop.set()
    sampler.join(2)
    return tunnels / elapsed, (cpu1 - cpu0) / tunnels * 1e6, peak_rss[0] / 1e6


async def plain_client(t: Target, upstream_port: int, n: int, lat: list[float] | None = None) -> None:
    """`n` GETs one after another on one kept-alive connection (through the proxy: absolute
    form with the proxy credential; direct: origin form to the site)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", t.port or upstream_port)
    host = f"{t.connect_host or '127.0.0.1'}:{upstream_port}"
    head = f"GET {'http://' + host if t.port else ''}/p HTTP/1.1\r\nHost: {host}\r\n"
    if t.auth:
        head += f"Proxy-Authorization: {t.auth}\r\n"
    data = head.encode() + b"\r\n"
    for _ in range(n):
        start = time.perf_counter()
        writer.write(data)
        status = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in status.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"{t.name}: plain GET failed: {status[:80]!r}")
        await reader.readexactly(2048)
        if lat is not None:
            lat.append(time.perf_counter() - start)
    writer.close()


async def measure_plain(t: Target, upstream_port: int, requests: int) -> tuple[float, float]:
    """(p50 ms of one request at a time, proxy CPU us per request with 6 clients)."""
    await plain_client(t, upstream_port, 50)  # warm-up
    lat: list[float] = []
    await plain_client(t, upstream_port, 300, lat)
    p50 = sorted(lat)[len(lat) // 2] * 1000
    if t.proc is None:
        return p50, 0.0
    proc = psutil.Process(t.proc.pid)
    each = max(1, requests // 6)
    cpu0 = proc_cpu(proc)
    await asyncio.gather(*(plain_client(t, upstream_port, each) for _ in range(6)))
    return p50, (proc_cpu(proc) - cpu0) / (each * 6) * 1e6


#: a pace the bench never reaches (pacing on, nothing waits): every request counted all the same
PACE = """\
pace:
  - pattern: bench.test
    reason: "the bench's host, paced above anything it sends"
    requests_per_minute: 10000000
    page_loads_per_minute: 10000000
    connections: 1000
    burst: 1000
"""


def _bench_policy(tmp: Path, upstream_port: int, paced: bool = False) -> Path:
    policy = tmp / ("bench-sites-paced.yaml" if paced else "bench-sites.yaml")
    policy.write_text(textwrap.dedent(f"""\
        version: 1
        mode: enforce
        ports: [80, 443, {upstream_port}]
        allow_always: []
        block: []
        private_networks:
          allow: ["127.0.0.1/32"]
        """) + (PACE if paced else ""))
    return policy


def start_guard_run(upstream_port: int, tmp: Path, paced: bool = False) -> Target:
    """The guard proxy exactly as the daemon starts it for a run: `python -m
    sfguard.supervisor.daemon.proxy_child` (the one proxy entry point; `sfguard proxy` runs the same
    `serve()`), its client set over stdin, decisions appended to a log file; `paced`: with the
    pace above and its counters in a folder, as the daemon runs it (`--pace-dir`, `pace_key`)."""
    policy = _bench_policy(tmp, upstream_port, paced)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    pace_dir = tmp / "pace" if paced else None
    proc = subprocess.Popen(
        child_argv(port, policy, tmp / "run-decisions.log", {HOST: "127.0.0.1"}, run="bench-run",
                   pace_dir=pace_dir),
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError(f"run proxy did not start: {line!r}")
    client = {"name": "bench", "token": TOKEN, "allow": [HOST], "run": "bench-run"}
    if paced:
        client["pace_key"] = "p:local/bench"
    proc.stdin.write(json.dumps({"id": 1, "clients": [client]}) + "\n")
    proc.stdin.flush()
    ack = proc.stdout.readline()
    if json.loads(ack).get("ack") != 1:
        proc.kill()
        raise RuntimeError(f"run proxy refused its clients: {ack!r}")
    auth = "Basic " + base64.b64encode(f"bench:{TOKEN}".encode()).decode()
    return Target("guard-paced" if paced else "guard-run", proc, port, auth, HOST)


def start_mitmdump(tmp: Path) -> Target | None:
    exe = VENV_BIN / "mitmdump"
    if not exe.exists():
        return None
    addon = tmp / "allow_addon.py"
    addon.write_text(MITM_ADDON)
    port = free_port()
    proc = subprocess.Popen(
        [str(exe), "--mode", "regular", "--listen-host", "127.0.0.1", "-p", str(port),
         "--ignore-hosts", ".*", "-s", str(addon), "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return Target("mitmdump", proc, port, None, "127.0.0.1")


def start_squid(tmp: Path) -> tuple[Target | None, str]:
    exe = shutil.which("squid")
    if not exe:
        return None, "squid not installed: skipped"
    port = free_port()
    conf = tmp / "squid.conf"
    conf.write_text(textwrap.dedent(f"""\
        http_port 127.0.0.1:{port}
        acl all_ports port 1-65535
        http_access allow all
        cache deny all
        pid_filename {tmp}/squid.pid
        access_log none
        cache_log {tmp}/cache.log
        """))
    proc = subprocess.Popen([exe, "-N", "-f", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 15)
    except RuntimeError:
        proc.kill()
        return None, "squid did not start: skipped"
    return Target("squid", proc, port, None, "127.0.0.1"), ""


def stop(t: Target) -> None:
    if t.proc and t.proc.poll() is None:
        t.proc.terminate()
        try:
            t.proc.wait(10)
        except subprocess.TimeoutExpired:
            t.proc.kill()
            t.proc.wait(10)


async def bench_one(t: Target, upstream_port: int, args) -> dict:
    await asyncio.sleep(0.5)
    idle = psutil.Process(t.proc.pid).memory_info().rss / 1e6 if t.proc else 0.0
    p50, p99 = await measure_setup(t, upstream_port, args.setup)
    # median of 3 transfers: one transfer is at the mercy of whatever else the machine runs
    mbps = sorted([await measure_throughput(t, upstream_port, args.mb) for _ in range(3)])[1]
    rate, cpu_us, peak = await measure_concurrent(t, upstream_port, args.tunnels, args.concurrency)
    req_p50, req_cpu = await measure_plain(t, upstream_port, args.requests)
    return {"p50": p50, "p99": p99, "mbps": mbps, "rate": rate, "cpu": cpu_us, "idle": idle,
            "peak": peak, "req_p50": req_p50, "req_cpu": req_cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup", type=int, default=300, help="sequential tunnels for latency")
    ap.add_argument("--tunnels", type=int, default=2000, help="tunnels in the concurrent phase")
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--mb", type=int, default=256, help="MB downloaded through one tunnel")
    ap.add_argument("--requests", type=int, default=3000,
                    help="plain-HTTP requests in the concurrent plain phase (6 clients)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds; each measures every proxy once, in turn (interleaved)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="sfg-bench-"))
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM_CODE], stdout=subprocess.PIPE,
                                text=True)
    assert upstream.stdout is not None
    upstream_port = int(upstream.stdout.readline())
    notes: list[str] = []
    rounds: list[dict[str, dict]] = []
    starters = [("direct", lambda: Target("direct", None, None, None, "")),
                ("mitmdump", lambda: start_mitmdump(tmp)),
                ("squid", lambda: start_squid(tmp)),
                ("guard-run", lambda: start_guard_run(upstream_port, tmp)),
                ("guard-paced", lambda: start_guard_run(upstream_port, tmp, paced=True))]
    try:
        for _ in range(max(1, args.rounds)):
            results: dict[str, dict] = {}
            for name, starter in starters:
                got = starter()
                if isinstance(got, tuple):
                    got, note = got
                    if note and note not in notes:
                        notes.append(note)
                if got is None:
                    if name == "mitmdump" and not rounds:
                        notes.append("mitmdump not found next to this python: no baseline ratios")
                    continue
                try:
                    results[name] = asyncio.run(bench_one(got, upstream_port, args))
                finally:
                    stop(got)
            rounds.append(results)
    finally:
        upstream.terminate()
        upstream.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds if name in r)

    names = [n for n, _ in starters if any(n in r for r in rounds)]
    print(f"\nproxy benchmark: {len(rounds)} interleaved round(s); each: {args.setup} sequential "
          f"tunnels, {args.mb} MB through one tunnel, {args.tunnels} tunnels at "
          f"{args.concurrency} concurrent clients; plain HTTP: 300 sequential GETs, "
          f"{args.requests} GETs on 6 kept-alive connections. Medians over the rounds:\n")
    header = (f"{'':11}{'setup p50 ms':>13}{'p99 ms':>9}{'MB/s':>9}{'tunnels/s':>11}"
              f"{'CPU us/tun':>12}{'RSS idle MB':>13}{'RSS load MB':>13}"
              f"{'GET p50 ms':>12}{'CPU us/GET':>12}")
    print(header)
    print("-" * len(header))
    for name in names:
        proxy = name != "direct"
        cpu = f"{med(name, 'cpu'):.0f}" if proxy else "-"
        idle = f"{med(name, 'idle'):.1f}" if proxy else "-"
        peak = f"{med(name, 'peak'):.1f}" if proxy else "-"
        req_cpu = f"{med(name, 'req_cpu'):.0f}" if proxy else "-"
        print(f"{name:11}{med(name, 'p50'):13.2f}{med(name, 'p99'):9.2f}{med(name, 'mbps'):9.0f}"
              f"{med(name, 'rate'):11.0f}{cpu:>12}{idle:>13}{peak:>13}"
              f"{med(name, 'req_p50'):12.2f}{req_cpu:>12}")
    if "mitmdump" in names:
        print("\nratios vs bare mitmdump, per round (median [min-max]; targets of issues 3 and 14):")

        def ratio(name: str, key: str) -> str:
            vals = sorted(r[name][key] / r["mitmdump"][key] for r in rounds
                          if name in r and "mitmdump" in r)
            return f"{statistics.median(vals):.2f}x [{vals[0]:.2f}-{vals[-1]:.2f}]"
        for name in ("squid", "guard-run", "guard-paced"):
            if name not in names:
                continue
            print(f"  {name:9} CPU/tunnel {ratio(name, 'cpu')} (<= 0.5)   "
                  f"setup p50 {ratio(name, 'p50')} (<= 0.7)   "
                  f"throughput {ratio(name, 'mbps')} (>= 0.8)   tunnels/s {ratio(name, 'rate')}")
            print(f"  {name:9} plain HTTP: CPU/GET {ratio(name, 'req_cpu')}   GET p50 {ratio(name, 'req_p50')}")
    for name in ("guard-run",):
        if name in names:
            print(f"  {name} RSS under load {med(name, 'peak'):.1f} MB (target < 120)")
    if "guard-run" in names and "guard-paced" in names:
        def paced(key: str) -> str:
            vals = sorted(r["guard-paced"][key] / r["guard-run"][key] for r in rounds
                          if "guard-paced" in r and "guard-run" in r)
            return f"{statistics.median(vals):.2f}x [{vals[0]:.2f}-{vals[-1]:.2f}]"
        print(f"\npacing on / off (guard-paced / guard-run, per round; issue 49, target <= 1.05): "
              f"CPU/tunnel {paced('cpu')}   CPU/GET {paced('req_cpu')}   setup p50 {paced('p50')}   "
              f"GET p50 {paced('req_p50')}")
    print("guard-run = `python -O -m sfguard.supervisor.daemon.proxy_child`, the proxy process the daemon starts per "
          "run (clients over stdin, decision log on disk); `sfguard proxy` runs the same serve()")
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
