"""`sfguard service`: run the guard as a systemd service (docs/operator-guide.md)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home


def register(sub) -> None:
    p = sub.add_parser("service", help="run the guard as a systemd service",
                       description=("The guard as a system service: `print` writes a hardened "
                                    "systemd unit for this installation to stdout, `ensure-users` "
                                    "creates the unprivileged browser users (one per running "
                                    "browser) and the stage user (the unit "
                                    "runs it before the guard starts, as /etc is read-only for "
                                    "the guard itself)."))
    ss = p.add_subparsers(dest="service_command", metavar="SUBCOMMAND")
    ss.required = True
    pr = ss.add_parser("print", help="print the systemd unit",
                       description=("Print a systemd unit (Type=notify with a watchdog, restart on "
                                    "failure, read-only system, six capabilities, task and file "
                                    "limits) that runs `sfguard start` on --home with the options "
                                    "below. Install it as /etc/systemd/system/sfguard.service. "
                                    "Exit 2 for an option the unit cannot take, or an installation "
                                    "or file under a folder it hides (/tmp, /var/tmp, the homes). "
                                    "Webhooks are configured in the home (notify.yaml)."))
    add_home(pr, "the guard home of the service (default /var/lib/sfguard)")
    pr.add_argument("--exec", metavar="PATH", dest="exe", default=None,
                    help="the sfguard executable (default: the one running this command)")
    pr.add_argument("--policy", metavar="FILE", help="a site policy file for `start --policy`")
    pr.add_argument("--api-group", metavar="GROUP", help="for `start --api-group`")
    pr.add_argument("--browser-users", "--browser-user", dest="browser_users", metavar="PREFIX",
                    help="for `start --browser-users`")
    pr.add_argument("--browser-pool-size", metavar="N", type=int, help="for `start --browser-pool-size`")
    pr.add_argument("--stage-user", metavar="USER", help="for `start --stage-user`")
    pr.add_argument("--ca-file", action="append", default=[], metavar="PEM",
                    help="for `start --ca-file` (repeatable)")
    pr.add_argument("--tcp", metavar="PORT", type=int,
                    help="for `start --tcp`; the bearer token goes to --token-file")
    pr.add_argument("--token-file", metavar="FILE",
                    help="with --tcp: where the token is written, in the home (default HOME/api.token)")
    pr.add_argument("--console", metavar="[HOST][:PORT]", help="for `start --console`")
    pr.add_argument("--console-public", action="store_true", help="for `start --console-public`")
    pr.add_argument("--console-url", metavar="URL", help="for `start --console-url`")
    pr.add_argument("--console-tls-cert", metavar="PEM", help="for `start --console-tls-cert`")
    pr.add_argument("--console-tls-key", metavar="PEM", help="for `start --console-tls-key`")
    pr.add_argument("--console-trusted-proxy", metavar="ADDRESS", help="for `start --console-trusted-proxy`")
    pr.add_argument("--console-plain-http", action="store_true", help="for `start --console-plain-http`")
    pr.add_argument("--no-console", action="store_true", help="for `start --no-console`")
    pr.add_argument("--log-format", choices=("text", "json"), help="for `start --log-format`")
    pr.add_argument("--memory-max", metavar="SIZE",
                    help="MemoryMax= of the unit (e.g. 8G, 50%%); unset by default: about 250 MB "
                         "per open run")
    pr.set_defaults(func=run_print)
    eu = ss.add_parser("ensure-users", help="create the browser users and the stage user when missing",
                       description=("Create the unprivileged system users a root guard runs its "
                                    "browsers (PREFIX1..PREFIXN, one per running browser) and "
                                    "stages as (each its own group, no other group, no home, no "
                                    "shell), when missing, and check them. Needs root. Exit 0 when "
                                    "all exist afterwards and may be used."))
    eu.add_argument("--browser-users", "--browser-user", dest="browser_users", metavar="PREFIX",
                    help="default sfguard-browser (users sfguard-browser1, ...)")
    eu.add_argument("--browser-pool-size", metavar="N", type=int, help="default 16")
    eu.add_argument("--stage-user", metavar="USER", help="default sfguard-stage")
    eu.set_defaults(func=run_ensure_users)


def _this_executable() -> Path:
    """The `sfguard` script of this installation (its venv's bin/, or the one on PATH)."""
    beside = Path(sys.executable).parent / "sfguard"
    if beside.is_file():
        return beside.absolute()
    found = shutil.which("sfguard")
    if found:
        return Path(found).absolute()
    raise CliError("cannot tell where the sfguard executable is: give --exec PATH", 2)


def _install_paths(exe: Path) -> tuple[Path, ...]:
    """The folders this installation runs from: the script's, its venv's, the Python it was
    made from (a venv links to it), the package's source (an editable install)."""
    import os

    import sfguard
    paths = [exe.parent, Path(sys.prefix), Path(sys.base_prefix),
             Path(os.path.realpath(sys.executable)).parent.parent,
             Path(os.path.realpath(sfguard.__file__)).parent.parent]
    return tuple(p.absolute() for p in paths)


def run_print(args) -> int:
    from sfguard.supervisor.daemon.service_unit import DEFAULT_HOME, ServiceUnitError, unit_text
    this = _this_executable() if not args.exe else None
    exe = Path(args.exe).absolute() if args.exe else this
    assert exe is not None
    # this installation's folders matter when the unit runs it (not another one's --exec)
    installed = _install_paths(exe) if this is not None else (exe.parent,)

    def path(value: str | None) -> Path | None:
        return None if value is None else Path(value).absolute()
    try:
        text = unit_text(
            exe, Path(args.home) if args.home else DEFAULT_HOME, installed,
            memory_max=args.memory_max, policy=path(args.policy), api_group=args.api_group,
            browser_users=args.browser_users, browser_pool_size=args.browser_pool_size,
            stage_user=args.stage_user,
            ca_files=tuple(Path(c).absolute() for c in args.ca_file), tcp=args.tcp,
            token_file=path(args.token_file), console=args.console,
            console_public=args.console_public, console_url=args.console_url,
            console_tls_cert=path(args.console_tls_cert), console_tls_key=path(args.console_tls_key),
            console_trusted_proxy=args.console_trusted_proxy,
            console_plain_http=args.console_plain_http, no_console=args.no_console,
            log_format=args.log_format)
    except ServiceUnitError as exc:
        raise CliError(str(exc), 2) from None
    sys.stdout.write(text)
    return 0


def run_ensure_users(args) -> int:
    import os

    from sfguard.supervisor.browsers import browser_pool
    from sfguard.supervisor.stage import sandbox
    if os.geteuid() != 0:
        raise CliError("needs root: a guard that is not root runs its browsers and stages as itself", 2)
    config = browser_pool.PoolConfig(args.browser_users or browser_pool.DEFAULT_PREFIX,
                                     args.browser_pool_size or browser_pool.DEFAULT_SIZE)
    stage_name = args.stage_user or sandbox.DEFAULT_STAGE_USER
    try:
        config.check()
        existed = sandbox.lookup_user(stage_name) is not None
        stage = sandbox.ensure_system_user(stage_name, "stage")
        before = sum(1 for n in config.names() if sandbox.lookup_user(n) is not None)
        users = browser_pool.ensure_users(config, stage)
    except (sandbox.SandboxError, browser_pool.PoolError) as exc:
        raise CliError(str(exc), 1) from None
    print(f"stage user {stage.name} (uid {stage.uid}){'' if existed else ': created'}")
    print(f"browser users {users[0].name}..{users[-1].name} (uids {users[0].uid}..{users[-1].uid}, "
          f"each its own group){f': {len(users) - before} created' if before < len(users) else ''}")
    return 0
