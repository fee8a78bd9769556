"""`sfguard audit verify|show`: check and read the hash-chained audit log."""
from __future__ import annotations

import argparse
import json
import time

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home
from sfguard.supervisor.home import existing_home
from sfguard.supervisor.profiles.audit import LocalAuditSink
from sfguard.supervisor.protocols import ProfileNameError, validate_name, validate_run_id


def register(sub) -> None:
    home = argparse.ArgumentParser(add_help=False)
    add_home(home)
    home.add_argument("--store", metavar="URL", help="'local' (the home's audit.log, default) or the "
                      "shared postgresql://... store (default $SFGUARD_STORE)")
    p = sub.add_parser("audit", help="verify and show the audit log",
                       description=("The guard's append-only, hash-chained audit log "
                                    "(<home>/audit.log): verify finds any edit, cut or reorder; show "
                                    "prints records. Both only read: they create nothing."))
    asub = p.add_subparsers(dest="audit_command", metavar="SUBCOMMAND")
    asub.required = True
    a = asub.add_parser("verify", parents=[home], help="check the hash chain (exit 0 when intact)",
                        description="Check every record's hash, sequence and link and the tail "
                                    "against the head file. Exit 0 intact, 1 damaged, 2 no such home.")
    a.add_argument("--json", action="store_true",
                   help="print one JSON object: {ok, records, line, problem, message}")
    a.set_defaults(func=cmd_verify)
    a = asub.add_parser("show", parents=[home], help="print audit records",
                        description="Print audit records, oldest first, filtered by profile and/or run.")
    a.add_argument("--profile", metavar="NAME", help="only records about this profile")
    a.add_argument("--run", metavar="ID", help="only records about this run")
    a.add_argument("--json", action="store_true", help="one JSON record per line")
    a.set_defaults(func=cmd_show)
    a = asub.add_parser("archive", help="move old closed segments of the local log away, with an anchor",
                        description=("Move the closed segments (<home>/audit.d/) whose records all come "
                                     "before record --keep-from into --to (default <home>/audit.archive/), "
                                     "record `audit_archived` in the chain and write the keyed anchor "
                                     "(<home>/audit.anchor) that lets `verify` start after them. The "
                                     "chain must verify first. Local store only; needs the audit key. "
                                     "Exit 0 (also when nothing was old enough), 1 damaged, 2 usage."))
    add_home(a)
    a.add_argument("--keep-from", metavar="SEQ", type=int, required=True,
                   help="the first record to keep in the home")
    a.add_argument("--to", metavar="DIR", help="where the segments go (default <home>/audit.archive)")
    a.set_defaults(func=cmd_archive)


def _sink(args):
    """The audit sink of the store setting: the home's log, or the shared database's chain."""
    from sfguard.supervisor.profiles.stores import StoreError, open_stores, store_url
    try:
        shared = store_url(args.store) is not None
    except StoreError as exc:
        raise CliError(str(exc), 2) from None
    if not shared:
        return LocalAuditSink(existing_home(args.home), read_only=True)
    import atexit

    from sfguard.supervisor.home import resolve_home
    from sfguard.supervisor.protocols import ProfileError
    try:   # read-only: migrates nothing; a database without sfguard tables is exit 2
        stores = open_stores(resolve_home(args.home), None, args.store, heartbeat=False,
                             read_only=True)
    except ProfileError as exc:
        raise CliError(f"the store cannot be used: {exc}", 2) from None
    atexit.register(stores.close)
    return stores.audit


def _where(args) -> str:
    from sfguard.supervisor.profiles.stores import store_url
    if store_url(args.store) is not None:
        return "the shared store's audit table"
    return str(existing_home(args.home) / "audit.log")


def cmd_verify(args) -> int:
    result = _sink(args).verify()
    if getattr(args, "json", False):
        print(json.dumps({"ok": result.ok, "records": result.records, "line": result.line,
                          "problem": result.reason, "message": str(result)}))
        return 0 if result.ok else 1
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
    except (ProfileNameError, ValueError) as exc:     # a bad profile name, a bad run id
        raise CliError(str(exc)) from None
    recs = _sink(args).records(profile=args.profile, run=args.run)
    if not recs and not args.json:
        which = " ".join(f"--{k} {v}" for k, v in (("profile", args.profile), ("run", args.run)) if v)
        print(f"no audit records{' match ' + which if which else ' yet'} (the log: {_where(args)})")
    for r in recs:
        if args.json:
            print(json.dumps(r, sort_keys=True))
        else:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.get("ts", 0)))
            fields = " ".join(f"{k}={v}" for k, v in sorted((r.get("fields") or {}).items()))
            print(f"{r.get('seq'):>6} {when} {r.get('event'):<20} {fields}")
    return 0


def cmd_archive(args) -> int:
    from pathlib import Path

    from sfguard.supervisor.profiles.audit import AuditFieldError
    from sfguard.supervisor.profiles.keys import KeyMissing
    if args.keep_from < 1:
        raise CliError("--keep-from: a record number from 1", 2)
    sink = LocalAuditSink(existing_home(args.home))
    try:
        moved = sink.archive(args.keep_from, Path(args.to).absolute() if args.to else None)
    except (AuditFieldError, KeyMissing) as exc:
        raise CliError(str(exc), 1) from None
    if not moved:
        print("nothing archived: no closed segment ends before that record")
        return 0
    print(f"archived {len(moved)} segment(s) into {moved[0].parent}; the chain now starts after "
          f"the anchor in {sink.anchor_path}")
    return 0
