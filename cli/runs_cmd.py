"""`sfguard runs list|show|export|verify`: the guard's record of each run (supervisor/record),
read from the home (or, with a shared store, from any host of the fleet). Read-only: these
commands need no running guard and change nothing. Exit 0, 1 (no such record, or verify found a
problem), 2 usage."""
from __future__ import annotations

import argparse
import calendar
import json
import tempfile
import time
from pathlib import Path

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home


def register(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    add_home(common)
    common.add_argument("--store", metavar="URL", help="'local' (this home, default) or the shared "
                        "postgresql://... store: every host's records (default $SFGUARD_STORE)")
    p = sub.add_parser("runs", help="the record of each run: list, show, export, verify",
                       description="What each run's stages did with their browser, beside the guard's "
                                   "decisions: commands, pages, screenshots, refusals, writes and approvals "
                                   "(docs/operator-guide.md, Run records).")
    acts = p.add_subparsers(dest="runs_command", required=True, metavar="SUBCOMMAND")
    ls = acts.add_parser("list", parents=[common], help="records, newest first (searchable)",
                         description="Records, newest first. Filters combine.")
    ls.add_argument("--search", metavar="WORDS", default="", help="words anywhere (run, pipeline, profile, outcome)")
    ls.add_argument("--pipeline", default="", help="the pipeline file's name contains this")
    ls.add_argument("--profile", default="", help="a stage used this profile")
    ls.add_argument("--outcome", default="", help="succeeded, failed, cancelled, abandoned, or active")
    ls.add_argument("--since", metavar="DATE", help="started on or after (YYYY-MM-DD or YYYY-MM-DDTHH:MM, UTC)")
    ls.add_argument("--until", metavar="DATE", help="started before (same forms)")
    ls.add_argument("--json", action="store_true", help="one JSON object per record and line")
    show = acts.add_parser("show", parents=[common], help="one run's timeline",
                           description="One run's timeline in the order things happened; RUN is a run id "
                                       "(its newest record) or a record's name.")
    show.add_argument("run", metavar="RUN")
    show.add_argument("--stage", help="only this stage's entries")
    show.add_argument("--kind", help="only entries of this kind (command, navigated, loaded, screenshot, proxy, "
                                     "write, stage, login_check, handoff, console, lease, run)")
    show.add_argument("--refused", action="store_true", help="only what the guard refused")
    show.add_argument("--json", action="store_true", help="the entries as JSON lines (as kept)")
    ex = acts.add_parser("export", parents=[common], help="a self-contained archive of one run's record",
                         description="A zip: the timeline (JSON lines), the screenshots and a static HTML page "
                                     "that shows them in any browser, without the guard.")
    ex.add_argument("run", metavar="RUN")
    ex.add_argument("--out", metavar="FILE", required=True, help="the zip to write (0600, replaced whole)")
    ve = acts.add_parser("verify", parents=[common], help="check records against the audit chain",
                         description="Each record's timeline chain, screenshots and index against the digest "
                                     "the audit chain keeps; a sealed record gone without the retention is a "
                                     "problem too. Exit 0 intact, 1 a problem.")
    ve.add_argument("run", metavar="RUN", nargs="?")
    ve.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _epoch(text: str | None, flag: str) -> float | None:
    if not text:
        return None
    for fmt in ("%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"):
        try:
            return float(calendar.timegm(time.strptime(text.rstrip("Z"), fmt)))
        except ValueError:
            continue
    raise CliError(f"{flag}: a date YYYY-MM-DD or YYYY-MM-DDTHH:MM (UTC), got {text!r}", 2)


def _where(args):
    """(records folder, shared backend or None, audit sink)."""
    from sfguard.cli.audit_cmd import _sink
    from sfguard.supervisor.home import existing_home
    from sfguard.supervisor.record.files import RECORDS
    home = existing_home(args.home)
    sink = _sink(args)
    return home / RECORDS, getattr(sink, "backend", None), sink


def run(args) -> int:
    from sfguard.supervisor.record import catalog, files, view
    root, backend, sink = _where(args)
    if args.runs_command == "list":
        since, until = _epoch(args.since, "--since"), _epoch(args.until, "--until")
        lines = [x for x in catalog.listing(root, backend) if view.matches(
            x, text=args.search, pipeline=args.pipeline, profile=args.profile, outcome=args.outcome,
            since=since, until=until)]
        for x in lines:
            if args.json:
                print(json.dumps({k: v for k, v in x.items() if k != "started_epoch"}, sort_keys=True))
            else:
                print(f"{x['record']:<28} {x['started']:<21} {x['outcome'] or x['state']:<10} "
                      f"pipeline={x['pipeline'] or '-'} profiles={','.join(x['profiles']) or '-'} "
                      f"stages={len(x['stages'])} entries={x['entries'] if x['entries'] is not None else '-'}"
                      + (f" host={x['host']}" if backend is not None else ""))
        if not lines and not args.json:
            print("no run records" + (" match" if any((args.search, args.pipeline, args.profile, args.outcome,
                                                      since, until)) else " yet") + f" (in {root})")
        return 0
    with tempfile.TemporaryDirectory(prefix="sfguard-runs-") as tmp:
        found = catalog.find(root, args.run, backend, Path(tmp)) if args.run else None
        if args.runs_command == "verify":
            return _verify(args, root, sink, found)
        if found is None:
            raise CliError(f"no record of run {args.run!r} (see `sfguard runs list`)", 1)
        folder: Path = found
        if args.runs_command == "export":
            from sfguard.supervisor.record.export import export
            out = export(folder, Path(args.out).expanduser().absolute())
            print(f"wrote {out['out']}: {out['entries']} entries, {out['screenshots']} screenshots "
                  f"({out['bytes']} bytes); open {folder.name}/index.html from it in any browser")
            return 0
        entries, _head, problems = files.read_entries(folder)
        if args.json:
            for e in entries:
                if (not args.stage or e.get("stage") == args.stage) and (
                        not args.kind or view.kind_of(e) == args.kind) and (not args.refused or view.refused(e)):
                    print(json.dumps(e, sort_keys=True))
            return 0
        index = files.read_index(folder) or {}
        print(f"run {index.get('run_id')} (record {folder.name} on {index.get('host')}): "
              f"{index.get('outcome') or index.get('state')}, pipeline {index.get('pipeline') or '-'}, "
              f"profiles {', '.join(index.get('profiles') or []) or '-'}")
        for r in view.rows(entries, stage=args.stage, kind=args.kind, only_refused=args.refused):
            shots = f"  [screenshot {', '.join(r['shots'])}]" if r["shots"] else ""
            mark = "!" if r["refused"] else " "
            print(f"{r['seq']:>5} {r['ts']} {mark} {r['stage'] or '-':<12} {r['text']}{shots}")
        for p in problems:
            print(f"note: {p}")
        return 0


def _verify(args, root: Path, sink, folder: Path | None) -> int:
    from sfguard.supervisor.record import catalog
    chain = sink.verify()
    results = catalog.verify(root, sink.records(), args.run, folder if args.run else None)
    bad = [r for r in results if not r["ok"]] + ([] if chain.ok else [{"record": "(audit chain)"}])
    if args.json:
        print(json.dumps({"ok": not bad, "audit": str(chain), "records": results}, sort_keys=True))
    else:
        if not chain.ok:
            print(f"the audit chain is damaged: {chain}")
        for r in results:
            state = "ok" if r["ok"] else "PROBLEM"
            print(f"{state:<8} {r['record']} ({r['state']})" + (f": {r['note']}" if r.get("note") else ""))
            for p in r["problems"]:
                print(f"         {p}")
        if not results:
            print(f"no run records (in {root})")
    return 1 if bad else 0
