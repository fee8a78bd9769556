"""`sfguard start` options of the run records (supervisor/record): how much is kept, how long,
how big."""
from __future__ import annotations

import argparse

from sfguard.cli.errors import CliError


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record", metavar="LEVEL", choices=("full", "decisions", "off"), default="full",
                   help="what the guard keeps of each run (`sfguard runs`, the console's run page): full "
                        "(default: commands, pages, screenshots and decisions), decisions (only the "
                        "guard's decisions and the stages' lifecycle) or off (no run record); each "
                        "site's `recording` level in sites.yaml can only lower it")
    p.add_argument("--record-keep-days", metavar="DAYS", type=float, default=14.0,
                   help="ended runs' records are removed after this many days (default 14)")
    p.add_argument("--record-max-mb", metavar="MB", type=float, default=256.0,
                   help="size cap of one run's record; beyond it only decisions are kept (default 256)")
    p.add_argument("--record-max-total-mb", metavar="MB", type=float, default=10240.0,
                   help="all records together; beyond it the oldest ended ones go first (default 10240)")
    p.add_argument("--record-shot-interval", metavar="SECONDS", type=float, default=15.0,
                   help="a screenshot of a stage's tab at most this often while the stage is busy, "
                        "besides those at each page load, held or refused write and login handoff "
                        "(default 15; 0: none between those)")


def settings(args: argparse.Namespace):
    """The RecordSettings of the options, checked (exit 2 with the option named)."""
    from sfguard.supervisor.record.recorder import RecordSettings
    out = RecordSettings(level=args.record, keep_days=args.record_keep_days, max_run_mb=args.record_max_mb,
                         max_total_mb=args.record_max_total_mb, shot_interval=args.record_shot_interval)
    try:
        out.check()
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    return out
