"""`sfguard start`: the guard daemon in the foreground."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys

from aiohttp import web

from cli.main import CliError


def register(sub) -> None:
    p = sub.add_parser("start", help="run the guard daemon in the foreground",
                       description="Run the guard: control API on a unix socket in the home.")
    p.add_argument("--home", help="guard home (default $SFGUARD_HOME or ~/.stageflow/guard)")
    p.add_argument("--policy", metavar="FILE", help="site policy (default: the shipped policy/sites.yaml)")
    p.add_argument("--tcp", metavar="PORT", type=int,
                   help="also listen on 127.0.0.1:PORT with a bearer token (printed once)")
    p.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                   help="DNS override for the run proxies, like curl's --resolve (tests, demos)")
    p.set_defaults(func=run)


def _parse_resolve(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        host, sep, ip = v.partition("=")
        if not sep or not host or not ip:
            raise CliError(f"--resolve wants HOST=IP, got {v!r}")
        out[host] = ip
    return out


def run(args) -> int:
    from supervisor import redaction
    from supervisor.daemon import Guard, GuardAlreadyRunning
    from supervisor.home import HomeError, resolve_home
    from supervisor.protocols import ProfileError
    import policy

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redaction.install()
    try:
        guard = Guard(resolve_home(args.home), args.policy, resolve=_parse_resolve(args.resolve))
    except policy.PolicyError as exc:
        raise CliError(f"the site policy is invalid:\n{exc}", 2) from None
    except HomeError as exc:
        raise CliError(str(exc), 2) from None
    try:
        return asyncio.run(_serve(guard, args.tcp))
    except GuardAlreadyRunning as exc:
        raise CliError(str(exc), 3) from None
    except ProfileError as exc:  # e.g. a damaged lease file: named, left untouched
        raise CliError(str(exc), 2) from None


async def _serve(guard, tcp_port: int | None) -> int:
    from supervisor.api import build_app
    from supervisor.client import socket_path

    report = await guard.start()
    sock = socket_path(guard.home)
    if sock.exists() or sock.is_symlink():
        sock.unlink()  # we hold the instance lock, so this socket is stale
    runners = []
    app_runner = web.AppRunner(build_app(guard), access_log=None, handle_signals=False,
                               max_line_size=65536, max_field_size=65536)
    await app_runner.setup()
    old_umask = os.umask(0o177)
    try:
        await web.UnixSite(app_runner, str(sock)).start()
    finally:
        os.umask(old_umask)
    os.chmod(sock, 0o600)
    runners.append(app_runner)
    lines = [f"sfguard: API on unix:{sock}"]
    if tcp_port is not None:
        token = secrets.token_urlsafe(32)
        tcp_runner = web.AppRunner(build_app(guard, token=token), access_log=None,
                                   handle_signals=False, max_line_size=65536, max_field_size=65536)
        await tcp_runner.setup()
        await web.TCPSite(tcp_runner, "127.0.0.1", tcp_port).start()
        runners.append(tcp_runner)
        lines.append(f"sfguard: API on http://127.0.0.1:{tcp_port} (bearer token: {token})")
    ab, br = guard.host_tool_report()
    lines += [f"sfguard: home {guard.home} (runtime {guard.runtime})",
              f"sfguard: agent-browser {ab}", f"sfguard: browser {br}",
              f"sfguard: keys {guard.keys.describe()}",
              f"sfguard: policy {guard.policy_path} (mode {guard.site_policy.mode})",
              f"sfguard: start-up sweep: {len(report['runs'])} dead run(s), {report['processes'] + report['orphans']} "
              f"process(es) ended, {len(report['resealed'])} profile(s) resealed, "
              f"{len(report['leases'])} lease(s) released",
              "sfguard: ready"]
    if report.get("audit"):
        lines.insert(-1, f"sfguard: WARNING the audit log does not verify: {report['audit']}")
    if report.get("damaged_profiles"):
        lines.insert(-1, "sfguard: WARNING sealed profile(s) refused (kept as they are): "
                     + ", ".join(report["damaged_profiles"]))
    # the handlers go in before "ready": a signal right after it must still stop cleanly
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("\n".join(lines), flush=True)
    await stop.wait()
    print("sfguard: stopping; every run is torn down as abandoned", flush=True)
    for r in runners:
        await r.cleanup()
    await guard.stop()
    if sock.exists():
        sock.unlink()
    return 0
