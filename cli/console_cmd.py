"""`sfguard console`: a one-time login link to the running guard's operator console."""
from __future__ import annotations

import json

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home


def register(sub) -> None:
    p = sub.add_parser("console", help="print a one-time login link to the guard's web console",
                       description=("Ask the running guard for a one-time link to its operator "
                                    "console (overview, decisions, profiles, audit, live-view "
                                    "logins, approvals). The link works once, until it expires; "
                                    "opening it gives this browser a session cookie. With --as "
                                    "NAME, what that session decides is audited as console:NAME. "
                                    "Exit 3 when no guard runs, 1 when it runs without a console, "
                                    "2 for a bad option."))
    add_home(p)
    p.add_argument("--ttl", metavar="SECONDS", type=int, default=600,
                   help="how long the link stays good if unused (1-86400, default 600)")
    p.add_argument("--as", metavar="NAME", dest="person",
                   help="the person the link is for (1-32 of a-z 0-9 . _ -, starting with a "
                        "letter, not s-); the audit names them as the decider of what their "
                        "session approves or denies")
    p.add_argument("--json", action="store_true", help="print {url, expires} as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from sfguard.cli.guardhint import no_guard
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.home import resolve_home
    from sfguard.supervisor.models import PERSON_NAME

    if not 1 <= args.ttl <= 86400:
        raise CliError("--ttl wants 1 to 86400 seconds", 2)
    request: dict = {"ttl_s": args.ttl}
    if args.person is not None:
        if not PERSON_NAME.fullmatch(args.person):
            raise CliError(f"--as {args.person[:40]!r}: a name is 1-32 of a-z 0-9 . _ -, starting "
                           "with a letter and not with s- (e.g. alice, j.doe)", 2)
        request["person"] = args.person
    home = resolve_home(args.home)
    try:
        status, body = GuardClient(home, timeout=10).call("POST", "/v1/console/link", request)
    except GuardUnavailable:
        raise no_guard(home, args.home) from None
    if status != 200:
        err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
        raise CliError(err.get("message") or f"the guard answered {status}", 1)
    if args.json:
        print(json.dumps(body))
    else:
        print(body["url"])
        who = f" for {args.person}" if args.person else ""
        print(f"(one-time link{who}, good until {body['expires']}; do not share it)")
    return 0
