"""`sfguard audit verify|show`: check and read the hash-chained audit log."""
from __future__ import annotations

import argparse
import json
import time

from cli.main import CliError
from supervisor.audit import LocalAuditSink
from supervisor.home import ensure_home
from supervisor.protocols import validate_name, validate_run_id


def register(sub) -> None:
    home = argparse.ArgumentParser(add_help=False)
    home.add_argument("--home", metavar="DIR", help="guard home (default $SFGUARD_HOME or ~/.stageflow/guard)")
    p = sub.add_parser("audit", help="verify and show the audit log")
    asub = p.add_subparsers(dest="audit_command", metavar="ACTION")
    asub.required = True
    a = asub.add_parser("verify", parents=[home], help="check the hash chain (exit 0 when intact)")
    a.set_defaults(func=cmd_verify)
    a = asub.add_parser("show", parents=[home], help="print audit records")
    a.add_argument("--profile", metavar="NAME")
    a.add_argument("--run", metavar="ID")
    a.add_argument("--json", action="store_true", help="one JSON record per line")
    a.set_defaults(func=cmd_show)


def cmd_verify(args) -> int:
    result = LocalAuditSink(ensure_home(args.home)).verify()
    if result.ok:
        print(str(result))
        return 0
    raise CliError(str(result), 1)


def cmd_show(args) -> int:
    try:
        if args.profile is not None:
            validate_name(args.profile)
        if args.run is not None:
            validate_run_id(args.run)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    recs = LocalAuditSink(ensure_home(args.home)).records(profile=args.profile, run=args.run)
    for r in recs:
        if args.json:
            print(json.dumps(r, sort_keys=True))
        else:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.get("ts", 0)))
            fields = " ".join(f"{k}={v}" for k, v in sorted((r.get("fields") or {}).items()))
            print(f"{r.get('seq'):>6} {when} {r.get('event'):<20} {fields}")
    return 0
