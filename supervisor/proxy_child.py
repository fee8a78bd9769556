"""The per-run guard proxy process the daemon starts: `python -m supervisor.proxy_child`.

The same guard proxy as `sfguard proxy` (proxy_addons.server.GuardProxy), but its clients come
from the daemon over stdin, so no token is ever in argv or in a file:

  daemon -> child   one JSON object per line: {"id": N, "clients": [{"name", "token", "allow", "run"}]}
                    (the complete client set; it replaces the previous one atomically)
  child -> daemon   `ready http://127.0.0.1:PORT` once, then {"ack": N} after each update is live

When stdin closes (the daemon ended or was killed) the proxy stops: a run's proxy never
outlives its guard, and its browsers get connection errors, never a direct route.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

import policy
from proxy_addons.clients import ClientRegistry, make_client
from proxy_addons.server import GuardConfig, GuardProxy
from supervisor import redaction

log = logging.getLogger("sfguard.proxy.child")
MAX_LINE = 4 * 1024 * 1024


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sfguard-run-proxy")
    p.add_argument("--listen-port", type=int, default=0)
    p.add_argument("--policy", required=True)
    p.add_argument("--decision-log", required=True)
    p.add_argument("--run", default=None, help="run id for log lines of clients without one")
    p.add_argument("--resolve", action="append", default=[], metavar="HOST=IP")
    return p.parse_args(argv)


async def _control(registry: ClientRegistry, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            stop.set()  # the daemon is gone
            return
        try:
            msg = json.loads(line)
            clients = [make_client(c["name"], c["token"], c.get("allow", []), run=c.get("run"))
                       for c in msg["clients"]]
            for c in clients:
                redaction.register_secret(c.token)
            registry.replace_all(clients)
            out = {"ack": msg.get("id")}
        except (ValueError, KeyError, TypeError, policy.PolicyError) as exc:
            out = {"error": type(exc).__name__, "id": None}
            log.error("bad control message from the daemon: %s", type(exc).__name__)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


async def main_async(args: argparse.Namespace) -> int:
    resolve: dict[str, list[str]] = {}
    for item in args.resolve:
        host, _, ip = item.partition("=")
        resolve.setdefault(policy.normalize_host(host), []).append(ip)
    config = GuardConfig(listen_port=args.listen_port, policy_path=args.policy, resolve=resolve,
                         decision_log=args.decision_log, run=args.run)
    registry = ClientRegistry()
    proxy = GuardProxy(config, registry)
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(f"ready {proxy.url}\n")
    sys.stdout.flush()
    control = loop.create_task(_control(registry, stop))
    try:
        await stop.wait()
    finally:
        control.cancel()
        await proxy.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redaction.install()
    return asyncio.run(main_async(parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
