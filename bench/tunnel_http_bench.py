"""What judging every request inside a plain-HTTP tunnel costs (issue 30), against the other way
to close that hole: a tunnel per request (the tunnel closed after its first exchange).

    ./dev bench tunnel_http_bench [--requests N] [--rounds N]

On 127.0.0.1, the run proxy exactly as the daemon starts it (proxy_bench.start_guard_run) in
front of proxy_bench's upstream (a 2 KB answer per GET head). Two workloads, each `--requests`
GETs one after another, measured in turn for `--rounds` rounds; printed: the proxy process's
CPU per request (psutil user+system) and the client's p50 latency per request, medians over the
rounds:
- `keep-alive`: one CONNECT, then every GET on that tunnel (each judged, re-assembled).
- `tunnel-per-request`: a CONNECT for each GET, closed after its answer (what closing a
  plain-HTTP tunnel after its first exchange costs a client that sends several requests).
- `raw-passthrough`: the same GETs in a tunnel relayed unjudged (its first message a lone LF),
  the cost of a later request in a plain-HTTP tunnel before issue 30.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_bench import Target, open_tunnel, proc_cpu, start_guard_run, stop  # noqa: E402

ANSWER_BODY = 2048
#: A site that answers every request head (whatever came before it) with a 2 KB body.
UPSTREAM_CODE = r"""
import asyncio
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2048\r\n\r\n" + b"x" * 2048
async def handle(reader, writer):
    buf = b""
    try:
        while data := await reader.read(65536):
            buf += data
            n = buf.count(b"\r\n\r\n")
            if n:
                writer.write(ANSWER * n)
                buf = buf[buf.rfind(b"\r\n\r\n") + 4:]
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


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    status = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in status.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"GET in tunnel failed: {status[:80]!r}")
    await reader.readexactly(ANSWER_BODY)


async def keep_alive(t: Target, up: int, n: int, lat: list[float]) -> None:
    reader, writer = await open_tunnel(t, up)
    data = f"GET /p HTTP/1.1\r\nHost: {t.connect_host}:{up}\r\n\r\n".encode()
    for _ in range(n):
        start = time.perf_counter()
        await _get(reader, writer, data)
        lat.append(time.perf_counter() - start)
    writer.close()


async def raw(t: Target, up: int, n: int, lat: list[float]) -> None:
    """The same GETs in a tunnel whose first message is not HTTP (a lone LF): raw passthrough,
    as every request after the first of a plain-HTTP tunnel went before issue 30."""
    reader, writer = await open_tunnel(t, up)
    writer.write(b"\n")
    data = f"GET /p HTTP/1.1\r\nHost: {t.connect_host}:{up}\r\n\r\n".encode()
    for _ in range(n):
        start = time.perf_counter()
        await _get(reader, writer, data)
        lat.append(time.perf_counter() - start)
    writer.close()


async def per_request(t: Target, up: int, n: int, lat: list[float]) -> None:
    data = f"GET /p HTTP/1.1\r\nHost: {t.connect_host}:{up}\r\nConnection: close\r\n\r\n".encode()
    for _ in range(n):
        start = time.perf_counter()
        reader, writer = await open_tunnel(t, up)
        await _get(reader, writer, data)
        writer.close()
        lat.append(time.perf_counter() - start)


async def run(args: argparse.Namespace) -> None:
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM_CODE], stdout=subprocess.PIPE, text=True)
    assert upstream.stdout is not None
    up = int(upstream.stdout.readline())
    with tempfile.TemporaryDirectory() as tmp:
        t = start_guard_run(up, Path(tmp))
        try:
            assert t.proc is not None
            proc = psutil.Process(t.proc.pid)
            workloads = (("keep-alive", keep_alive), ("tunnel-per-request", per_request),
                         ("raw-passthrough", raw))
            results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in workloads}
            for _, fn in workloads:  # warm-up
                await fn(t, up, 100, [])
            for _ in range(args.rounds):
                for name, fn in workloads:
                    lat: list[float] = []
                    cpu0 = proc_cpu(proc)
                    await fn(t, up, args.requests, lat)
                    cpu = (proc_cpu(proc) - cpu0) / args.requests * 1e6
                    results[name].append((cpu, sorted(lat)[len(lat) // 2] * 1e6))
        finally:
            stop(t)
            upstream.terminate()
            upstream.wait(10)
    for name, rows in results.items():
        cpus = [r[0] for r in rows]
        p50s = [r[1] for r in rows]
        print(f"{name:20s} CPU/request {statistics.median(cpus):7.0f} us [{min(cpus):.0f}-{max(cpus):.0f}]"
              f"   p50 {statistics.median(p50s):7.0f} us [{min(p50s):.0f}-{max(p50s):.0f}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(run(ap.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
