"""`sfguard demo`: the example login pipeline, for real, against the local fixture site.

Starts the fixture login site and a guard of its own (a demo site policy that lets the guarded
browser reach the fixture on 127.0.0.1), then plays the pipeline runner's part for
supervisor/demo/login-pipeline.yaml twice: run 1 needs the login, run 2 skips it. The logic lives
in sfguard.supervisor.demo (run.py, runner.py); this module parses, calls and prints.
"""
from __future__ import annotations

import sys

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the example login pipeline against the local fixture site",
                       description=("Run supervisor/demo/login-pipeline.yaml for real: start the "
                                    "fixture login site and a guard of its own, then play the "
                                    "pipeline runner's part twice (run 1 logs in, run 2 finds the "
                                    "login and skips it). Exit 0 when both runs behave as expected."))
    add_home(p, "guard home for the demo (default: a temporary one, deleted at the end)")
    p.add_argument("--keep", action="store_true",
                   help="keep the demo's temporary files (guard home, demo policy, logs)")
    p.add_argument("--auto-login", action="store_true",
                   help="where the guard has no display: a scripted person logs in through the "
                        "live view from a separate headless browser (for tests and CI); without "
                        "it the demo prints the live-view link and waits for you")
    p.set_defaults(func=run)


def run(args) -> int:
    from sfguard.supervisor.browsers import tools
    from sfguard.supervisor.demo import run as demo
    from sfguard.supervisor.home import resolve_home

    home = resolve_home(args.home) if args.home else None
    # With a display and a person at the terminal, the person logs in in the window.
    interactive = bool(tools.display_available()) and sys.stdin.isatty()

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        result = demo.run_demo(home, args.keep, say, interactive=interactive,
                               auto_login=args.auto_login)
    except demo.DemoError as exc:
        raise CliError(str(exc), 1) from None
    if not result.ok:
        print("sfguard demo: the runs did not behave as expected (see above)", file=sys.stderr)
        return 1
    print("sfguard demo: ok")
    return 0
