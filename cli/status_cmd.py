"""`sfguard status`: what the running guard holds (the same data as GET /v1/status)."""
from __future__ import annotations

import json
import sys

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home

#: `status --check` alerts on an approval or a login handoff waiting longer than this
DEFAULT_MAX_WAIT = 300.0


def register(sub) -> None:
    p = sub.add_parser("status", help="show runs, leases, queues, browsers, proxies and policy state",
                       description=("Ask the running guard what it holds: runs and their stages, "
                                    "profile leases and queues, browsers, run proxies and the site "
                                    "policy's state (the same data as GET /v1/status): every run "
                                    "not yet ended and the most recently ended ones. Exit 3 when "
                                    "no guard runs on this home; with --check, exit 1 when "
                                    "something needs the operator (see --check)."))
    add_home(p)
    p.add_argument("--json", action="store_true", help="print the /v1/status answer as JSON")
    p.add_argument("--check", action="store_true",
                   help="for monitors: exit 1 when something needs the operator (an invalid "
                        "policy edit, the shared store unreachable, a proxy of an active run "
                        "down, a broken audit chain, an approval or login handoff waiting longer "
                        "than --max-wait, a webhook whose last delivery failed), each named on an "
                        "ALERT line (on stderr with --json)")
    p.add_argument("--max-wait", metavar="SECONDS", type=float, default=DEFAULT_MAX_WAIT,
                   help=f"with --check: alert on an approval or handoff waiting longer than this "
                        f"(default {DEFAULT_MAX_WAIT:.0f})")
    p.set_defaults(func=run)


def run(args) -> int:
    from sfguard.cli.guardhint import no_guard
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.home import resolve_home
    home = resolve_home(args.home)
    if not 0 <= args.max_wait <= 10 * 86400:    # also refuses nan
        raise CliError("--max-wait: seconds from 0 to 864000", 2)
    try:
        status, body = GuardClient(home, timeout=10).call("GET", "/v1/status")
    except GuardUnavailable:
        raise no_guard(home, args.home) from None
    if status != 200:
        raise CliError(f"the guard answered {status}: {body}", 1)
    found = alerts(body, args.max_wait)
    if args.json:
        print(json.dumps(body, indent=2))
        for a in found if args.check else []:
            print(f"ALERT {a}", file=sys.stderr)
        return 1 if args.check and found else 0
    g, pol = body["guard"], body["policy"]
    print(f"guard   pid {g['pid']} since {g['since']}, home {g['home']}, keys: {g['key_provider']}"
          + (f", API also on http://127.0.0.1:{g['tcp_port']}" if g.get("tcp_port") else "")
          + (f", version {g['version']}" if g.get("version") else ""))
    if g.get("store"):
        print(f"store   {g['store']}" + (f"  UNREACHABLE ({g['store_error']}): leases and "
                                         "queues unknown" if g.get("store_error") else ""))
    line = f"policy  {pol['file']} mode {pol['mode']}"
    if pol["state"] != "ok":
        line += f"  INVALID EDIT, last good policy kept: {pol['error']}"
    print(line)
    for ca in body.get("trusted_cas", []):
        print(f"ca      browsers also trust {ca['subject']} (sha256 {ca['sha256'][:16]}..., "
              f"until {ca['not_after']}, from {ca['source']})")
    console = body.get("console")
    print(f"console {console['url']} (sign in: sfguard console)" if console else "console off")
    for disk in body.get("disk", []):
        free = disk["free_bytes"]
        shown = f"{free / 2**20:.0f} MiB free" if free is not None else "free space unknown"
        print(f"disk    {disk['folder']} {disk['path']}: {shown}"
              + ("  DISK LOW: allowed requests are refused when nothing can be logged" if disk["low"] else ""))
    for line in body.get("pending", []):
        print(f"pending {line}")
    _print_waiting(body)
    for r in body["runs"]:
        proxy = r["proxy"]
        if proxy and r["state"] != "active":
            shown = "stopped"          # a run that ended stopped its proxy: no alert
        else:
            shown = "up" if proxy and proxy["alive"] else "DOWN"
        print(f"run     {r['run_id']} {r['state']}" + (f" ({r['outcome']})" if r["outcome"] else "")
              + (f" at {r['ended']}" if r.get("ended") else "")
              + (f", proxy :{proxy['port']} {shown}" if proxy else ""))
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
    summary = body.get("runs_summary")
    if summary:
        print(f"runs    {summary['active']} active; {summary['ended_shown']} of "
              f"{summary['ended_in_memory']} ended run(s) in memory shown; {summary['retired']} "
              f"retired (kept: the newest {summary['keep_ended_runs']}, at most "
              f"{summary['keep_ended_hours']:g} h; GET /v1/runs/ID answers a retired run's "
              "record from disk)")
    for a in found if args.check else []:
        print(f"ALERT   {a}")
    return 1 if args.check and found else 0


def _print_waiting(body: dict) -> None:
    """What waits for a person, the audit chain, the webhooks."""
    for a in body.get("approvals", []):
        print(f"approval {a['id']} {a['method']} {a['host']}{a['path']} run {a['run']} stage "
              f"{a['stage'] or '-'}: waiting {_age(a['age_s'])} (sfguard approvals show {a['id']})")
    for h in body.get("handoffs", []):
        print(f"handoff {h['kind']} run {h['run']} stage {h['stage'] or '-'} profile {h['profile']} "
              f"site {h['site']}: waiting {_age(h['age_s'])}")
    audit = body.get("audit")
    if audit:
        state = {True: "verifies", False: f"BROKEN: {audit['problem']}", None: "unknown"}[audit["ok"]]
        print(f"audit   chain {state} (checked {audit['checked'] or 'never'}, every {audit['interval_s']:g} s)")
    notes = body.get("notifications")
    for w in (notes or {}).get("webhooks", []):
        last = w.get("last")
        told = (f"; last {last['event']} {last['result']} at {last['at']}"
                + (f" ({last['error']})" if last.get("error") else "")) if last else ""
        print(f"webhook {w['url']}: {w['delivered']} delivered, {w['failed']} failed, {w['queued']} "
              f"queued{told}")


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def alerts(body: dict, max_wait: float = DEFAULT_MAX_WAIT) -> list[str]:
    """What needs the operator in a status answer (`status --check` exits 1 on any)."""
    out = []
    pol, g = body["policy"], body["guard"]
    if pol["state"] != "ok":
        out.append(f"invalid policy edit of {pol['file']}, the last good policy is kept: "
                   f"{pol['error']}")
    if g.get("store_error"):
        out.append(f"the store does not answer: {g['store_error']}")
    for r in body["runs"]:
        if r["state"] == "active" and r["proxy"] and not r["proxy"]["alive"]:
            out.append(f"the proxy of active run {r['run_id']} is down")
    if (body.get("audit") or {}).get("ok") is False:
        out.append(f"the audit chain does not verify: {body['audit']['problem']}")
    for a in body.get("approvals", []):
        if a["age_s"] > max_wait:
            out.append(f"approval {a['id']} ({a['method']} {a['host']}{a['path']}, run {a['run']}) has "
                       f"waited {_age(a['age_s'])} for a person")
    for h in body.get("handoffs", []):
        if h["age_s"] > max_wait:
            out.append(f"the {h['kind']} login handoff of run {h['run']} (profile {h['profile']}) has "
                       f"waited {_age(h['age_s'])} for a person")
    for w in (body.get("notifications") or {}).get("webhooks", []):
        if (w.get("last") or {}).get("result") == "failed":
            out.append(f"the last notification to {w['url']} was not delivered: {w['last']['error']}")
    return out
