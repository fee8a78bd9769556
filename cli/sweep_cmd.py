"""`sfguard sweep`: clean up after a crashed guard (the same sweep `sfguard start` runs)."""
from __future__ import annotations

import json

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home


def register(sub) -> None:
    p = sub.add_parser("sweep", help="end processes, reseal profiles and release leases left by dead runs",
                       description=("Clean up after a crashed guard: end the browsers, proxies and "
                                    "agent-browser daemons its runs left (by recorded pid and start "
                                    "time), reseal unsealed profiles and release their leases. "
                                    "`sfguard start` does the same at start. Exit 3 when a guard is "
                                    "running on this home (it owns its runs)."))
    add_home(p)
    p.add_argument("--policy", metavar="FILE", help="site policy (default: HOME/sites.yaml)")
    p.add_argument("--json", action="store_true", help="print the sweep report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from sfguard import policy
    from sfguard.supervisor.daemon.crash import release_runtime, sweep
    from sfguard.supervisor.daemon.guard import Guard, GuardAlreadyRunning
    from sfguard.supervisor.home import existing_home
    try:
        guard = Guard(existing_home(args.home), args.policy)
    except policy.PolicyError as exc:
        raise CliError(f"the site policy is invalid:\n{exc}", 2) from None
    try:
        guard.acquire_instance_lock()
    except GuardAlreadyRunning:
        raise CliError("a guard is running on this home; it swept at start and owns its runs", 3) from None
    from sfguard.supervisor.protocols import ProfileError
    try:
        report = sweep(guard)
    except ProfileError as exc:   # e.g. a damaged keys.json: nothing can be recorded, so stop
        raise CliError(f"the sweep stopped: {exc}; what it had not reached (unsealed profiles "
                       "among it) is left as it is", 2) from None
    report["runtime_removed"] = release_runtime(guard)  # nothing of the guard left in memory fs
    report["bridges_removed"] = guard.bridges.remove()  # nor its stages' bridge sockets
    if args.json:
        print(json.dumps(report))
    else:
        print(f"swept {len(report['runs'])} dead run(s): {report['processes'] + report['orphans']} process(es) "
              f"ended, {len(report['resealed'])} profile(s) resealed, {len(report['leases'])} lease(s) released")
    return 0
