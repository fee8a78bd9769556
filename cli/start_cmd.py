"""`sfguard start`: the guard daemon in the foreground."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
from pathlib import Path

from aiohttp import web

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home

log = logging.getLogger("sfguard.start")


def register(sub) -> None:
    p = sub.add_parser("start", help="run the guard daemon in the foreground",
                       description=("Run the guard in the foreground: the control API on a unix "
                                    "socket in the home (guard.sock, 0600) and, with --tcp, on "
                                    "127.0.0.1 with a bearer token. Stop it with Ctrl-C or SIGTERM: "
                                    "every run is torn down. Exit 3 when a guard already runs on "
                                    "this home, 2 for an unusable home or policy."))
    add_home(p)
    p.add_argument("--policy", metavar="FILE",
                   help="site policy (default: HOME/sites.yaml, made 0600 from the shipped "
                        "template policy/sites.yaml on first start; edits apply live)")
    p.add_argument("--store", metavar="URL",
                   help="where profiles, leases and audit live: 'local' (the home, default) or "
                        "postgresql://... shared by several guard hosts (default $SFGUARD_STORE; "
                        "needs the shared key $SFGUARD_KEY_FILE, see docs/deployment.md)")
    p.add_argument("--tcp", metavar="PORT", type=int,
                   help="also listen on 127.0.0.1:PORT with a bearer token (printed once, "
                        "or written to --token-file)")
    p.add_argument("--token-file", metavar="FILE",
                   help="with --tcp: write the bearer token to FILE (created 0600, replaced "
                        "atomically) instead of printing it")
    p.add_argument("--metrics-token-file", metavar="FILE",
                   help="with --tcp: a second bearer token, read from FILE (yours: at least 32 "
                        "characters, not readable by everyone), that GET /metrics and the health "
                        "routes accept and every other route refuses (403): give it to Prometheus")
    p.add_argument("--audit-check", metavar="SECONDS", type=float, default=300.0,
                   help="how often the running guard verifies the audit chain again (default 300; "
                        "a broken chain: ERROR line, webhook, status --check alert, metric)")
    p.add_argument("--keep-ended-runs", metavar="N", type=int, default=None,
                   help="ended runs kept in memory for status, the console and GET (default 200); "
                        "older ones leave memory, their record stays in <home>/runs/ended/")
    p.add_argument("--keep-ended-hours", metavar="H", type=float, default=None,
                   help="ended runs leave memory after H hours at most (default 24)")
    p.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                   help="DNS override for the run proxies, like curl's --resolve (tests, demos)")
    p.add_argument("--write-gate-timeout", metavar="SECONDS", type=float, default=600.0,
                   help="how long a write held for a person waits before it is denied (default 600)")
    p.add_argument("--ca-file", action="append", default=[], metavar="PEM",
                   help="certificate authorities (PEM) the guard's browsers, and only they, trust "
                        "besides the system's (intranet sites, a TLS-inspecting network); repeatable")
    _user_options(p)
    p.add_argument("--proxies", choices=("per-run", "shared"), default=None,
                   help="per-run (default): a guard proxy process per run; shared: one proxy "
                        "process for every run, each run with its own listener and credentials "
                        "(less memory per run, one process for all: docs/design.md 4.2); the "
                        "environment variable SFGUARD_PROXIES sets the default")
    p.add_argument("--console", metavar="[HOST][:PORT]", default="127.0.0.1",
                   help="the operator console's address (default 127.0.0.1 with the port of the "
                        "last start, recorded in HOME/console.json; a free one the first time; "
                        ":0 a new one each start); sign in with `sfguard console`")
    p.add_argument("--console-public", action="store_true",
                   help="allow a console address that is not loopback (then with TLS, or "
                        "--console-plain-http)")
    from sfguard.cli import console_options, record_options
    console_options.add(p)
    record_options.add(p)
    p.add_argument("--log-max-mb", metavar="MB", type=float, default=64,
                   help="rotate the decision log at this size (default 64)")
    p.add_argument("--log-max-age", metavar="HOURS", type=float, default=24,
                   help="rotate the decision log when its first line is this old (default 24)")
    p.add_argument("--log-keep", metavar="N", type=int, default=14,
                   help="rotated decision logs kept (decisions.log.1 ... .N; default 14)")
    p.add_argument("--no-console", action="store_true",
                   help="no operator console (and so no live_view login handoff)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="the log on stderr: text lines (default) or one JSON object per line "
                        "(ts, level, logger, event, pid, ids); masked either way")
    p.add_argument("--console-session", metavar="SECONDS", type=int, default=8 * 3600,
                   help="how long a console sign-in lasts, from 1 to 28800 seconds (default "
                        "28800, 8 hours); open pages and their update streams end with it")
    p.set_defaults(func=run)


def _logging(kind: str) -> None:
    """The guard's log on stderr, text or json, masked; the run proxies (and the lines the
    guard prints itself: redaction.log_line) read the format from the environment."""
    from sfguard.supervisor import redaction
    if kind == "json":
        os.environ[redaction.LOG_FORMAT_ENV] = "json"
    else:
        os.environ.pop(redaction.LOG_FORMAT_ENV, None)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(redaction.formatter(kind))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    redaction.install()


def _proxies(flag: str | None) -> str:
    """--proxies, else SFGUARD_PROXIES, else per-run (checked like the flag)."""
    from sfguard.supervisor.daemon.settings import PROXIES_CHOICES, PROXIES_DEFAULT
    value = flag or os.environ.get("SFGUARD_PROXIES") or PROXIES_DEFAULT
    if value not in PROXIES_CHOICES:
        raise CliError(f"SFGUARD_PROXIES={value[:20]!r}: use one of {', '.join(PROXIES_CHOICES)}", 2)
    return value


def _parse_resolve(values: list[str]) -> dict[str, str]:
    """The guard's table: host -> "IP[,IP...]" (checked by policy.parse_resolve, the one parser)."""
    from sfguard import policy
    try:
        return {host: ",".join(ips) for host, ips in policy.parse_resolve(values).items()}
    except ValueError as exc:
        raise CliError(f"--resolve {exc}", 2) from None


def _browser_host(ca_files: list[str]):
    """The guard's browser host, trusting the --ca-file authorities (supervisor/browsers/trust.py)."""
    from sfguard.supervisor.browsers import trust
    from sfguard.supervisor.browsers.host import LocalBrowserHost
    try:
        ca = trust.CaBundle.load(ca_files)
    except trust.TrustError as exc:
        raise CliError(str(exc), 2) from None
    if ca and trust.certutil() is None:
        raise CliError("--ca-file needs certutil (Debian: apt-get install libnss3-tools)", 2)
    return LocalBrowserHost(ca=ca)


def run(args) -> int:
    from sfguard import policy
    from sfguard.supervisor.browsers.browser_user import BrowserUserError
    from sfguard.supervisor.daemon.guard import Guard, GuardAlreadyRunning
    from sfguard.supervisor.home import HomeError, resolve_home
    from sfguard.supervisor.protocols import ProfileError

    _logging(args.log_format)
    from sfguard.cli import record_options
    from sfguard.supervisor.daemon.log_rotation import Retention
    from sfguard.supervisor.daemon.settings import KEEP_ENDED_RUNS, KEEP_ENDED_SECONDS, GuardSettings
    from sfguard.supervisor.profiles.stores import StoreError
    keep_runs = KEEP_ENDED_RUNS if args.keep_ended_runs is None else args.keep_ended_runs
    keep_hours = KEEP_ENDED_SECONDS / 3600 if args.keep_ended_hours is None else args.keep_ended_hours
    from sfguard.proxy_addons import versions
    untested = versions.untested()
    if untested is not None:       # every run proxy would refuse to start: say it now
        raise CliError(f"cannot start: {untested}", 2)
    if not 0 <= keep_runs <= 1_000_000:
        raise CliError("--keep-ended-runs: a number of runs from 0 to 1000000", 2)
    if not 0 < keep_hours <= 24 * 366:    # also refuses nan and inf
        raise CliError("--keep-ended-hours: hours above 0, at most a year (8784)", 2)
    if not 1 <= args.write_gate_timeout <= 86400:   # also refuses nan
        raise CliError("--write-gate-timeout: seconds from 1 to 86400", 2)
    retention = Retention(int(args.log_max_mb * 1024 * 1024), args.log_max_age * 3600, args.log_keep)
    try:
        retention.check()
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    if args.token_file and args.tcp is None:
        raise CliError("--token-file needs --tcp PORT (the unix socket needs no token)", 2)
    token_file = _token_path(args.token_file) if args.token_file else None
    scrape_token = _oversight_options(args)
    api_gid = None
    if args.api_group:
        from sfguard.supervisor.stage.sandbox import SandboxError, group_id
        try:
            api_gid = group_id(args.api_group)
        except SandboxError as exc:
            raise CliError(f"--api-group: {exc}", 2) from None
        if os.geteuid() != 0 and api_gid not in (os.getgid(), *os.getgroups()):
            raise CliError(f"--api-group: this user is not in group {args.api_group!r}, so it "
                           "cannot give the control socket to it", 2)
    defaults = GuardSettings()
    settings = GuardSettings(
        keep_ended_runs=keep_runs, keep_ended_seconds=keep_hours * 3600,
        write_gate_timeout=args.write_gate_timeout, log_retention=retention, api_gid=api_gid,
        stage_user_name=args.stage_user or defaults.stage_user_name,
        browser_pool=_pool_config(args, defaults),
        proxies=_proxies(args.proxies), audit_check_seconds=args.audit_check, record=record_options.settings(args))
    try:
        guard = Guard(resolve_home(args.home), args.policy, resolve=_parse_resolve(args.resolve),
                      store=args.store, browser_host=_browser_host(args.ca_file), settings=settings)
    except StoreError as exc:
        raise CliError(str(exc), 2) from None
    except ProfileError as exc:  # shared store: unreachable, schema too new, key missing or wrong
        raise CliError(f"the store cannot be used: {exc}", 2) from None
    except policy.PolicyError as exc:
        raise CliError(f"the site policy is invalid:\n{exc}", 2) from None
    except HomeError as exc:     # also an invalid notify.yaml (webhooks)
        raise CliError(str(exc), 2) from None
    console_at = None
    if not args.no_console:
        from sfguard.cli import console_options
        console_at = console_options.config(args)
    try:
        return asyncio.run(_serve(guard, args.tcp, token_file, console_at, scrape_token))
    except GuardAlreadyRunning as exc:
        raise CliError(str(exc), 3) from None
    except BrowserUserError as exc:
        raise CliError(f"--browser-users: {exc}", 2) from None
    except ProfileError as exc:  # e.g. a damaged lease file: named, left untouched
        raise CliError(str(exc), 2) from None


def _user_options(p) -> None:
    """Who may call the API (--api-group), and who stages and browsers run as under root."""
    p.add_argument("--api-group", metavar="GROUP",
                   help="make the control socket 0660 with this group (and the home 0710), for "
                        "a pipeline runner under another user in GROUP; default: 0600, owner only")
    p.add_argument("--stage-user", metavar="USER", default=None,
                   help="when the guard runs as root: the unprivileged user `sfguard stage-exec` "
                        "runs stages as (default sfguard-stage, created when missing)")
    p.add_argument("--browser-users", "--browser-user", dest="browser_users", metavar="PREFIX", default=None,
                   help="when the guard runs as root: each browser runs as an unprivileged user "
                        "of its own, PREFIX1..PREFIXN, with Chromium's sandbox on (default "
                        "sfguard-browser: sfguard-browser1, ...; created when missing); never the "
                        "stage user")
    p.add_argument("--browser-pool-size", metavar="N", type=int, default=None,
                   help="how many browser users (default 16): at most that many browsers run at "
                        "once; a stage that needs another waits (reason browser_pool_full)")


def _pool_config(args, defaults):
    """--browser-users and --browser-pool-size, checked before the guard starts."""
    from sfguard.supervisor.browsers.browser_pool import PoolConfig, PoolError
    pool = PoolConfig(args.browser_users or defaults.browser_pool.prefix,
                      defaults.browser_pool.size if args.browser_pool_size is None else args.browser_pool_size)
    try:
        pool.check()
    except PoolError as exc:
        raise CliError(str(exc), 2) from None
    return pool


def _token_path(path: str) -> Path:
    """--token-file checked before the guard starts (a bad path must not leave a half-started guard)."""
    target = Path(path).expanduser().absolute()
    if not target.parent.is_dir():
        raise CliError(f"--token-file: the folder {target.parent} does not exist", 2)
    if target.is_dir():
        raise CliError(f"--token-file: {target} is a folder", 2)
    if not os.access(target.parent, os.W_OK):
        raise CliError(f"--token-file: cannot write in {target.parent}", 2)
    return target


def _oversight_options(args) -> str | None:
    """--audit-check checked; the --metrics-token-file token (None without one)."""
    if not 1 <= args.audit_check <= 86400:   # also refuses nan
        raise CliError("--audit-check: seconds from 1 to 86400", 2)
    if args.metrics_token_file and args.tcp is None:
        raise CliError("--metrics-token-file needs --tcp PORT (the unix socket needs no token)", 2)
    return _read_scrape_token(args.metrics_token_file) if args.metrics_token_file else None


def _read_scrape_token(path: str) -> str:
    """--metrics-token-file: the operator's own token file (Prometheus reads the same file), read
    once at start; refused when anyone may read it, or when it is short."""
    import stat
    target = Path(path).expanduser()
    try:
        st = target.stat()
        token = target.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--metrics-token-file: cannot read {target}: {getattr(exc, 'strerror', None) or exc} "
                       "(make it with: openssl rand -hex 32 > FILE; chmod 640 FILE)", 2) from None
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise CliError(f"--metrics-token-file: {target} is readable or writable by others (mode "
                       f"{stat.S_IMODE(st.st_mode):04o}); chmod 600, or 640 with Prometheus's group", 2)
    if len(token) < 32 or any(c.isspace() for c in token) or not token.isprintable():
        raise CliError(f"--metrics-token-file: {target} must hold one token of at least 32 characters "
                       "(openssl rand -hex 32 > FILE)", 2)
    from sfguard.supervisor import redaction
    redaction.register_secret(token)
    return token


def _write_token(target: Path, token: str) -> Path:
    """The TCP token in a 0600 file, replaced atomically (never a half-written token)."""
    from sfguard.supervisor.home import atomic_write
    atomic_write(target, token.encode() + b"\n", 0o600)
    return target


async def _serve(guard, tcp_port: int | None, token_file: Path | None = None,
                 console_at=None, scrape_token: str | None = None) -> int:
    from sfguard.supervisor.client.guard_client import socket_path
    from sfguard.supervisor.daemon import sd_notify
    from sfguard.supervisor.errors import swallowed

    pinger = sd_notify.start_keep_alive()   # WatchdogSec=: WATCHDOG=1 while this loop runs
    report = await guard.start()
    sock = socket_path(guard.home)
    runners: list = []
    token_path: list[Path] = []       # set once the token file is written
    try:
        return await _serve_started(guard, report, sock, runners, token_path, tcp_port,
                                    token_file, console_at, scrape_token)
    finally:
        # every way out (a signal, a port that cannot be bound, an error) stops the guard: its
        # runs, browsers, proxies, bridge and runtime folders go with it. Console sessions end
        # first, so that their open pages and update streams stop at once.
        if guard.console is not None:
            guard.console.end_sessions()
        for r in runners:
            with swallowed(log, "closing an API listener"):
                await r.cleanup()
        if guard.console is not None:
            with swallowed(log, "stopping the console"):
                await guard.console.stop()
        await guard.stop()
        if sock.exists():
            sock.unlink()
        for t in token_path:
            with contextlib.suppress(FileNotFoundError):
                t.unlink()   # the token dies with this guard
        if pinger is not None:
            pinger.cancel()


async def _serve_started(guard, report: dict, sock: Path, runners: list, token_paths: list[Path],
                         tcp_port: int | None, token_file: Path | None,
                         console_at, scrape_token: str | None = None) -> int:
    from sfguard.supervisor.daemon import sd_notify
    from sfguard.supervisor.daemon.api import build_app
    from sfguard.supervisor.errors import swallowed

    if sock.exists() or sock.is_symlink():
        sock.unlink()  # we hold the instance lock, so this socket is stale
    app_runner = web.AppRunner(build_app(guard), access_log=None, handle_signals=False,
                               max_line_size=65536, max_field_size=65536)
    await app_runner.setup()
    runners.append(app_runner)
    old_umask = os.umask(0o177)
    try:
        await web.UnixSite(app_runner, str(sock)).start()
    finally:
        os.umask(old_umask)
    if guard.settings.api_gid is not None:  # a runner under another user, in the API group
        os.chown(sock, -1, guard.settings.api_gid)
        os.chown(guard.home, -1, guard.settings.api_gid)
        os.chmod(guard.home, 0o710)  # traverse only: everything in it stays 0600/0700
        os.chmod(sock, 0o660)
    else:
        os.chmod(sock, 0o600)
        os.chmod(guard.home, 0o700)   # no API group (any more): the home is the owner's only
    lines = [f"sfguard: API on unix:{sock}"]
    token_path: Path | None = None
    if tcp_port is not None:
        token = secrets.token_urlsafe(32)
        if token_file:
            token_path = _write_token(token_file, token)
            token_paths.append(token_path)
        tcp_runner = web.AppRunner(build_app(guard, token=token, scrape_token=scrape_token), access_log=None,
                                   handle_signals=False, max_line_size=65536, max_field_size=65536)
        await tcp_runner.setup()
        runners.append(tcp_runner)
        site = web.TCPSite(tcp_runner, "127.0.0.1", tcp_port)
        await site.start()
        # the port it listens on (--tcp 0: one the system chose), for the banner and status
        port = int(tcp_runner.addresses[0][1]) if tcp_runner.addresses else tcp_port
        guard.listening(api_tcp_port=port)
        lines.append(f"sfguard: API on http://127.0.0.1:{port} (bearer token in {token_path})"
                     if token_path else f"sfguard: API on http://127.0.0.1:{port} (bearer token: {token})")
        if scrape_token is not None:
            lines.append("sfguard: metrics token (--metrics-token-file): GET /metrics and the health "
                         "routes only")
    if console_at is not None:
        from sfguard.supervisor.console.server import ConsoleServer
        from sfguard.supervisor.daemon.console_view import console_view
        console = ConsoleServer(console_view(guard), console_at)
        try:
            await console.start()
        except OSError as exc:
            with swallowed(log, "stopping the console that could not listen"):
                await console.stop()
            raise CliError(f"the console could not listen on {console_at.host}:{console.port}: "
                           f"{exc.strerror or exc}", 2) from None
        guard.listening(console=console)
        lines.append(f"sfguard: console on {console.describe()} (sign in: `sfguard console`)")
        lines += [f"sfguard: WARNING {w}" for w in console_at.warnings]
    lines += _banner(guard, report)
    # the handlers go in before "ready": a signal right after it must still stop cleanly
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _say(lines)
    sd_notify.notify("READY=1")    # Type=notify units (sfguard service print)
    await stop.wait()
    guard.health.stopping = True   # not ready from now on (GET /v1/health/ready)
    sd_notify.notify("STOPPING=1")
    _say(["sfguard: stopping; every run is torn down as abandoned"])
    return 0


def _banner(guard, report: dict) -> list[str]:
    """The start banner after the listeners: tools, users, trust, store, policy, webhooks,
    sandbox, the sweep's report, warnings, and "ready" last."""
    from sfguard.supervisor.browsers import tools
    from sfguard.supervisor.browsers.browser_user import describe as describe_browser_user
    ab, br = tools.find_agent_browser().describe(), guard.stages.supply.browser_tool.describe()
    lines = [f"sfguard: home {guard.home} (runtime {guard.runtime})",
              f"sfguard: agent-browser {ab}", f"sfguard: browser {br}",
              f"sfguard: browsers run {describe_browser_user(guard.pool)}",
              "sfguard: browsers trust the system's certificate authorities"
              + (f" and --ca-file {guard.host.ca.describe()}" if getattr(guard.host, "ca", None) else ""),
              f"sfguard: version {guard.metrics.version}",
              f"sfguard: store {guard.stores.shown}",
              f"sfguard: keys {guard.stores.keys.describe()}",
              f"sfguard: policy {guard.policy_path} (mode {guard.site_policy.mode})",
              f"sfguard: notifications {_notify_line(guard)}",
              f"sfguard: stage sandbox (stage-exec): {'ok' if guard.exec_service.sandbox.ok else 'UNAVAILABLE'}: "
              f"{guard.exec_service.sandbox.detail}",
              f"sfguard: start-up sweep: {len(report['runs'])} dead run(s), {report['processes'] + report['orphans']} "
              f"process(es) ended, {len(report['resealed'])} profile(s) resealed, "
              f"{len(report['leases'])} lease(s) released"
              + (f", {len(report['browser_users'])} browser user(s) returned to the pool"
                 if report.get("browser_users") else ""),
              "sfguard: ready"]
    if report.get("audit"):
        lines.insert(-1, f"sfguard: WARNING the audit log does not verify: {report['audit']}")
    if report.get("damaged_profiles"):
        lines.insert(-1, "sfguard: WARNING sealed profile(s) refused (kept as they are): "
                     + ", ".join(report["damaged_profiles"]))
    return lines


def _notify_line(guard) -> str:
    state = guard.notifier.status()
    if state is None:
        return f"off (no {guard.home / 'notify.yaml'})"
    return f"to {len(state['webhooks'])} webhook(s): " + ", ".join(h["url"] for h in state["webhooks"])


def _say(lines: list[str]) -> None:
    """The banner and the stop line on stdout: as they are, or with --log-format json one JSON
    object each (`event` without the `sfguard: ` prefix; the last banner line is "ready")."""
    from sfguard.supervisor import redaction
    if os.environ.get(redaction.LOG_FORMAT_ENV) == "json":
        lines = [redaction.log_line(line.removeprefix("sfguard: ").removeprefix("WARNING "),
                                    level="WARNING" if line.startswith("sfguard: WARNING") else "INFO")
                 for line in lines]
    print("\n".join(lines), flush=True)
