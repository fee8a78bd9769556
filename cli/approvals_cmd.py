"""`sfguard approvals list|show|approve|deny`: writes held for a person (write gates), decided
over the control API (GET/POST /v1/approvals). Exit 3 when no guard runs on the home, 1 for an
approval that is unknown or already decided."""
from __future__ import annotations

import json

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home


def register(sub) -> None:
    p = sub.add_parser("approvals", help="list, show, approve or deny writes held for a person",
                       description="Writes a stage's browser sent to a host whose write mode is `gate` "
                                   "wait here for a person. Approving sends exactly that request once; "
                                   "denying fails it in the page.")
    acts = p.add_subparsers(dest="action", required=True, metavar="SUBCOMMAND")
    ls = acts.add_parser("list", help="held writes (pending first)",
                         description="Writes held for a person: pending ones, or with --all decided ones too.")
    add_home(ls)
    ls.add_argument("--run", metavar="RUN_ID")
    ls.add_argument("--all", action="store_true", help="also decided ones (default: pending only)")
    ls.add_argument("--json", action="store_true")
    show = acts.add_parser("show", help="one held write: request, form fields, earlier writes",
                           description="One held write: the request, why it is held, the headers that "
                                       "change its meaning, its form fields or body (secret values masked), "
                                       "the earlier writes of a retry, its state, who decided and why.")
    add_home(show)
    show.add_argument("id", metavar="ID")
    show.add_argument("--json", action="store_true")
    for name, what in (("approve", "send it, once"), ("deny", "fail it in the page")):
        a = acts.add_parser(name, help=f"{name} a held write ({what})",
                            description=f"{name.capitalize()} the held write ID: {what}. Exit 1 when it "
                                        "is unknown or already decided.")
        add_home(a)
        a.add_argument("id", metavar="ID")
        a.add_argument("--reason", default="", help="why: shown with the approval and kept in the audit chain")
    p.set_defaults(func=run)


def _call(args, method: str, route: str, body=None):
    from sfguard.cli.guardhint import no_guard
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.home import resolve_home
    home = resolve_home(args.home)
    try:
        status, answer = GuardClient(home, timeout=30).call(method, route, body)
    except GuardUnavailable:
        raise no_guard(home, args.home) from None
    if status != 200:
        err = (answer or {}).get("error", {}) if isinstance(answer, dict) else {}
        raise CliError(err.get("message") or f"the guard answered {status}", 1 if status in (404, 409) else 2)
    return answer


def _line(a: dict) -> str:
    return (f"{a['id']}  {a['state']:<9} run {a['run_id']} stage {a['stage_id']} (attempt {a['attempt']})  "
            f"{a['method']} {a['host']}{a['path']}" + ("  [retry of a stage that wrote]"
                                                      if a["why"] == "replay_unsafe_retry" else ""))


def run(args) -> int:
    if args.action == "list":
        q = [f"run={args.run}"] if args.run else []
        if not args.all:
            q.append("state=pending")
        answer = _call(args, "GET", "/v1/approvals" + ("?" + "&".join(q) if q else ""))
        if args.json:
            print(json.dumps(answer, indent=2))
        else:
            items = answer["approvals"]
            print("\n".join(_line(a) for a in items) if items else "no held writes")
        return 0
    if args.action == "show":
        a = _call(args, "GET", f"/v1/approvals/{args.id}")
        if args.json:
            print(json.dumps(a, indent=2))
            return 0
        print(_line(a))
        print(f"url      {a['url']}")
        print(f"why      {a['why']}" + (f" ({a['rule']})" if a.get("rule") else ""))
        print(f"tab      {a['tab_url'] or '-'}")
        print(f"body     {a['body_size']} bytes {a['body_type'] or ''}")
        for name, value in a.get("headers") or []:
            print(f"header   {name}: {value}")
        for name, value in a["form"] or []:
            print(f"field    {name} = {value}")
        if a.get("body_text"):
            print("text     " + a["body_text"].replace("\n", "\n         "))
        for e in a["earlier"]:
            print(f"earlier  {e.get('method')} {e.get('url')} (sent at {e.get('at')})")
        pending = a["state"] == "pending"
        print(f"expires  {a['expires']}" if pending else f"decided  {a['decided_by']} {a['decided_at']}")
        if a.get("reason"):
            print(f"reason   {a['reason']}")
        return 0
    a = _call(args, "POST", f"/v1/approvals/{args.id}",
              {"decision": "approve" if args.action == "approve" else "deny", "reason": args.reason})
    print(f"{a['id']} {a['state']}")
    return 0
