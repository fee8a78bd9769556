"""Entry point of the `sfguard` console script.

Each command lives in its own module with a `register(subparsers)` function that adds its
parser and sets `func(args) -> int`. Errors that a user can act on are raised as `CliError`
(cli/errors.py) and printed as one line; nothing else prints a traceback unless SFGUARD_DEBUG=1.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys

from sfguard.cli.errors import CliError

# Order is the order in `sfguard --help`.
COMMAND_MODULES = (
    "sfguard.cli.start_cmd",
    "sfguard.cli.status_cmd",
    "sfguard.cli.approvals_cmd",
    "sfguard.cli.console_cmd",
    "sfguard.cli.proxy_cmd",
    "sfguard.cli.policy_cmd",
    "sfguard.cli.profiles_cmd",
    "sfguard.cli.audit_cmd",
    "sfguard.cli.runs_cmd",
    "sfguard.cli.keys_cmd",
    "sfguard.cli.sweep_cmd",
    "sfguard.cli.validate_cmd",
    "sfguard.cli.demo_cmd",
    "sfguard.cli.doctor_cmd",
    "sfguard.cli.service_cmd",
    "sfguard.cli.completion_cmd",
    "sfguard.cli.stage_exec_cmd",
)

#: One exit-code table for every command (docs/reference.md, "Exit codes").
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GUARD = 0, 1, 2, 3


def _modules_for(argv: list[str]) -> tuple[str, ...]:
    """Only the chosen command's module (imports stay cheap: `proxy` pulls in mitmproxy);
    none for `--version` alone; every module when no known command is given (help, errors)."""
    for arg in argv:
        if arg.startswith("-"):
            continue
        name = f"sfguard.cli.{arg.replace('-', '_')}_cmd"
        return (name,) if name in COMMAND_MODULES else COMMAND_MODULES
    if "--version" in argv and not {"-h", "--help"} & set(argv):
        return ()
    return COMMAND_MODULES


def version() -> str:
    try:
        return importlib.metadata.version("sfguard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: run ./dev setup)"


EPILOG = ("exit codes: 0 ok, 1 the check failed (denied, invalid, not logged in, ...), "
          "2 usage or input error, 3 the guard is not running (or already running, for start)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sfguard",
        description="Lend pipeline stages a guarded, logged-in browser.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"sfguard {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _modules_for(sys.argv[1:] if argv is None else argv):
        if importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name).register(sub)
    return parser


def _command_name(args: argparse.Namespace) -> str:
    """`policy test`, `profiles list`, ...: the command and its subcommand, as typed."""
    words = [args.command]
    sub = getattr(args, f"{args.command}_command", None)
    if isinstance(sub, str):
        words.append(sub)
    return " ".join(words)


def _error_line(text: str) -> str:
    """An error as the command prints it: one JSON object under `sfguard start --log-format
    json` (which sets $SFGUARD_LOG_FORMAT), so a log collector reads every line the guard writes."""
    if os.environ.get("SFGUARD_LOG_FORMAT") != "json":
        return text
    from sfguard.supervisor.redaction import log_line
    return log_line(text, logger="sfguard.cli", level="ERROR")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    from sfguard.supervisor.home import HomeError
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(_error_line(f"sfguard {_command_name(args)}: error: {exc}"), file=sys.stderr)
        return exc.exit_code
    except HomeError as exc:
        print(_error_line(f"sfguard {_command_name(args)}: error: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # never a traceback for a user, unless asked for
        if os.environ.get("SFGUARD_DEBUG") == "1":
            raise
        print(
            f"sfguard {_command_name(args)}: internal error: {type(exc).__name__}: {exc} "
            "(set SFGUARD_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    # Run through the importable module, not this __main__ copy: the commands import
    # `sfguard.cli.main` (its exit codes, its parser), and one copy of each module is loaded.
    from sfguard.cli.main import main as _main
    sys.exit(_main())
