"""`sfguard console`: a one-time login link to the running guard's operator console."""
from __future__ import annotations

import json

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home


def register(sub) -> None:
    p = sub.add_parser("console", help="print a one-time login link to the guard's web console",
                       description=("Ask the running guard for a one-time link to its operator "
                                    "console (overview, decisions, profiles, audit, live-view "
                                    "logins). The link works once, until it expires; opening it "
                                    "gives this browser a session cookie. Exit 3 when no guard "
                                    "runs, 1 when it runs without a console."))
    add_home(p)
    p.add_argument("--ttl", metavar="SECONDS", type=int, default=600,
                   help="how long the link stays good if unused (1-86400, default 600)")
    p.add_argument("--json", action="store_true", help="print {url, expires} as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from sfguard.cli.guardhint import no_guard
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.home import resolve_home

    if not 1 <= args.ttl <= 86400:
        raise CliError("--ttl wants 1 to 86400 seconds", 2)
    home = resolve_home(args.home)
    try:
        status, body = GuardClient(home, timeout=10).call("POST", "/v1/console/link", {"ttl_s": args.ttl})
    except GuardUnavailable:
        raise no_guard(home, args.home) from None
    if status != 200:
        err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
        raise CliError(err.get("message") or f"the guard answered {status}", 1)
    if args.json:
        print(json.dumps(body))
    else:
        print(body["url"])
        print(f"(one-time link, good until {body['expires']}; do not share it)")
    return 0
