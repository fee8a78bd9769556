"""`sfguard status`: what the running guard holds (the same data as GET /v1/status)."""
from __future__ import annotations

import json

from sfguard.cli.main import CliError


def register(sub) -> None:
    p = sub.add_parser("status", help="show runs, leases, queues, browsers, proxies and policy state",
                       description=("Ask the running guard what it holds: runs and their stages, "
                                    "profile leases and queues, browsers, run proxies and the site "
                                    "policy's state (the same data as GET /v1/status). Exit 3 when "
                                    "no guard runs on this home."))
    p.add_argument("--home", metavar="DIR", help="guard home (default $SFGUARD_HOME or ~/.stageflow/guard)")
    p.add_argument("--json", action="store_true", help="print the /v1/status answer as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from sfguard.cli.guardhint import no_guard
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.home import resolve_home
    home = resolve_home(args.home)
    try:
        status, body = GuardClient(home, timeout=10).call("GET", "/v1/status")
    except GuardUnavailable:
        raise no_guard(home, args.home) from None
    if status != 200:
        raise CliError(f"the guard answered {status}: {body}", 1)
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    g, pol = body["guard"], body["policy"]
    print(f"guard   pid {g['pid']} since {g['since']}, home {g['home']}, keys: {g['key_provider']}")
    if g.get("store"):
        print(f"store   {g['store']}" + (f"  UNREACHABLE ({g['store_error']}): leases and "
                                         "queues unknown" if g.get("store_error") else ""))
    line = f"policy  {pol['file']} mode {pol['mode']}"
    if pol["state"] != "ok":
        line += f"  INVALID EDIT, last good policy kept: {pol['error']}"
    print(line)
    console = body.get("console")
    print(f"console {console['url']} (sign in: sfguard console)" if console else "console off")
    for disk in body.get("disk", []):
        free = disk["free_bytes"]
        shown = f"{free / 2**20:.0f} MiB free" if free is not None else "free space unknown"
        print(f"disk    {disk['folder']} {disk['path']}: {shown}"
              + ("  DISK LOW: allowed requests are refused when nothing can be logged" if disk["low"] else ""))
    for line in body.get("pending", []):
        print(f"pending {line}")
    for r in body["runs"]:
        proxy = r["proxy"]
        print(f"run     {r['run_id']} {r['state']}" + (f" ({r['outcome']})" if r["outcome"] else "")
              + (f", proxy :{proxy['port']} {'up' if proxy['alive'] else 'DOWN'}" if proxy else ""))
        for s in r["stages"]:
            extra = f" waiting for run {s['holder_run']}" if s["holder_run"] else ""
            print(f"  stage {s['stage_id']} attempt {s['attempt']} {s['state']}"
                  f" profile={s['profile'] or '-'}{extra}")
        for b in r["browsers"]:
            print(f"  browser {'profile ' + b['profile'] if b['profile'] else 'throw-away'}"
                  f" {'headed' if b['headed'] else 'headless'} stages={','.join(b['stages']) or '-'}")
    for lease in body["leases"]:
        if lease["holder_run"] or lease["queue"]:
            q = ", ".join(x["run"] for x in lease["queue"]) or "-"
            where = (f" (host {lease['holder_host']}, guard {lease['holder_guard']})"
                     if lease.get("holder_guard") else "")
            print(f"lease   {lease['profile']} held by {lease['holder_run'] or '-'}{where}; queue: {q}")
    if not body["runs"]:
        print("runs    none")
    return 0
