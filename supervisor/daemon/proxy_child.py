"""The guard proxy process: the one entry point of every guard proxy process.

Two ways in, one process:

- the daemon starts one per run: `python -m sfguard.supervisor.daemon.proxy_child --policy FILE
  --decision-log FILE [--listen-port N] [--run ID] [--resolve HOST=IP ...]`, and gives it its
  clients over stdin, so no token is ever in argv or in a file;
- `sfguard proxy` (cli/proxy_cmd.py) parses the operator's flags, builds a `GuardConfig` and
  its clients, and calls `serve()` here: the same function, the same loop, the same logging.

So the benchmark (`./dev bench proxy_bench`, which starts `python -m sfguard.supervisor.daemon.proxy_child`
exactly as the daemon does) measures the process the daemon runs.

Control protocol (with `control=True`, the daemon's way):

  daemon -> child   one JSON object per line: {"id": N, "clients": [{"name", "token", "allow", "run",
                    "writes"?, "port"?, "held"?, "pace_key"?, "budgets"?}], "listeners"?: [PORT, ...],
                    "pace_store"?: URL}
                    (the complete client set; it replaces the previous one atomically). A proxy
                    shared by many runs (run_proxy.SharedProxy) also gets the complete set of
                    its runs' listener ports; each client is bound to its run's port.
  child -> daemon   `ready http://127.0.0.1:PORT` once, then {"ack": N} after each update is
                    live ({"ack": N, "failed": [PORT, ...]} names listeners that could not open)

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
from collections.abc import Iterable
from urllib.parse import urlsplit

from sfguard import policy
from sfguard.errors import SfguardError
from sfguard.proxy_addons.clients import Client, ClientRegistry, ClientSpecError, make_client, parse_budgets
from sfguard.proxy_addons.server import GuardConfig, GuardProxy, GuardStartError
from sfguard.supervisor import redaction

log = logging.getLogger("sfguard.proxy.child")
MAX_LINE = 4 * 1024 * 1024


class ProxyProcessError(SfguardError):
    """The proxy could not start; the message is one line, without secrets."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sfguard-run-proxy")
    p.add_argument("--listen-port", type=int, default=0)
    p.add_argument("--policy", required=True)
    p.add_argument("--decision-log", required=True)
    p.add_argument("--run", default=None, help="run id for log lines of clients without one")
    p.add_argument("--resolve", action="append", default=[], metavar="HOST=IP")
    p.add_argument("--pace-dir", default=None, help="the pace counters of this host (proxy_addons/pacing.py)")
    return p.parse_args(argv)


def install_logging(run_proxy: bool = True) -> None:
    """Logging of every guard proxy process: to stderr; the guard's own lines from INFO,
    mitmproxy's from WARNING (it logs every connection at INFO); every record masked."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(redaction.formatter())   # text, or json under --log-format json
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("sfguard").setLevel(logging.INFO)
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    # the daemon reports its policy file's reloads and refused edits itself, once (every run
    # proxy watching the same file would repeat them in the same log)
    if run_proxy:   # a standalone `sfguard proxy` reports its own policy edits
        logging.getLogger("sfguard.proxy.policy").setLevel(logging.CRITICAL)
    # Every record of every logger (ours and mitmproxy's) is masked before a handler sees it.
    redaction.install()


async def _control(registry: ClientRegistry, stop: asyncio.Event, proxy: GuardProxy) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # a line over MAX_LINE: the daemon would never send one
            line = b""
        if not line:
            stop.set()  # the daemon is gone
            return
        try:
            msg = json.loads(line)
            clients = [make_client(c["name"], c["token"], c.get("allow", []), run=c.get("run"),
                                   writes=c.get("writes"), port=c.get("port"), held=c.get("held", False),
                                   pace_key=c.get("pace_key"), budgets=parse_budgets(c.get("budgets")))
                       for c in msg["clients"]]
            _shared_pace(proxy, msg.get("pace_store"))
            listeners = msg.get("listeners")
            if listeners is not None and not all(type(p) is int and 0 < p <= 65535 for p in listeners):
                raise ValueError("listeners")
            for c in clients:
                redaction.register_secret(c.token)
            registry.replace_all(clients)
            out = {"ack": msg.get("id")}
            if listeners is not None:
                out["failed"] = await proxy.set_listeners(listeners)
        except (ValueError, KeyError, TypeError, ClientSpecError, policy.PolicyError) as exc:
            out = {"error": type(exc).__name__, "id": None}
            log.error("bad control message from the daemon: %s", type(exc).__name__)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def _shared_pace(proxy: GuardProxy, url: object) -> None:
    """The shared store's connection string, once (the daemon sends it with every client set):
    the sites' pace is counted there from now on, for every guard host alike."""
    if url is None or proxy.shared_pace == url:
        return
    if not isinstance(url, str) or not url.startswith(("postgresql://", "postgres://")):
        raise ValueError("pace_store")
    from sfguard.supervisor.profiles.pg_backend import redact_url  # noqa: PLC0415
    from sfguard.supervisor.profiles.pg_pace import PgPaceStore  # noqa: PLC0415 (only with a shared store)
    password = urlsplit(url).password
    if password:
        redaction.register_secret(password)
    proxy.use_shared_pace(PgPaceStore(url), url)
    log.info("the sites' pace is counted on the shared store %s", redact_url(url))


async def _serve(config: GuardConfig, clients: Iterable[Client], control: bool,
                 credential: str | None) -> int:
    registry = ClientRegistry(clients, loaded=not control)  # control: clients come over stdin
    try:
        proxy = GuardProxy(config, registry)
    except policy.PolicyError as exc:
        raise ProxyProcessError(str(exc).replace("\n", "; ")) from None
    except OSError as exc:
        raise ProxyProcessError(f"{exc.filename or ''}: {exc.strerror}") from None
    try:
        address = await proxy.start()
    except GuardStartError as exc:
        raise ProxyProcessError(str(exc)) from None
    except OSError as exc:  # e.g. the decision log file cannot be opened
        raise ProxyProcessError(f"{exc.filename or 'decision log'}: {exc.strerror}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(f"ready {proxy.url}\n")
    if credential is not None:
        # The one place a secret is printed: the operator's own stdout (`sfguard proxy`
        # without any client made one).
        sys.stdout.write(f"http://{credential}@{policy.join_host_port(*address)}\n")
    sys.stdout.flush()
    control_task = loop.create_task(_control(registry, stop, proxy)) if control else None
    try:
        await stop.wait()
    finally:
        if control_task is not None:
            control_task.cancel()
        await proxy.stop()
    return 0


def serve(config: GuardConfig, clients: Iterable[Client] = (), *, control: bool = False,
          credential: str | None = None) -> int:
    """Run one guard proxy in this process until SIGINT/SIGTERM (or, with `control`, until
    stdin closes). Prints `ready http://HOST:PORT` once it accepts connections, then
    `http://NAME:TOKEN@HOST:PORT` when `credential` ("NAME:TOKEN") is given. Call
    `install_logging()` first. Raises ProxyProcessError when it cannot start."""
    config.check()
    clients = list(clients)     # read twice below: a generator would give the proxy none
    for client in clients:
        redaction.register_secret(client.token)
    return asyncio.run(_serve(config, clients, control, credential))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    install_logging()
    redaction.bind_log_ids(run=args.run)   # every line of a run's own proxy names its run
    try:
        try:
            resolve = policy.parse_resolve(args.resolve)
        except ValueError as exc:
            raise ProxyProcessError(f"--resolve {exc}") from None
        config = GuardConfig(listen_port=args.listen_port, policy_path=args.policy,
                             resolve=resolve, decision_log=args.decision_log, run=args.run,
                             pace_dir=args.pace_dir)
        return serve(config, control=True)
    except (ProxyProcessError, GuardStartError, policy.PolicyError) as exc:
        print(redaction.log_line(f"sfguard-run-proxy: error: {exc}", logger="sfguard.proxy",
                                 level="ERROR"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
