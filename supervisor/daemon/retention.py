"""Ended runs: kept in memory for a while (status, the console, GET), then only on disk.

An ended run stays in `Guard.runs` while it is among the newest `keep_ended_runs` ended runs
and for at most `keep_ended_seconds` (`sfguard start --keep-ended-runs/--keep-ended-hours`);
then its record (runs/ended/<id>.json) and the audit log keep it."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sfguard.supervisor.daemon.runs import Run, RunState
from sfguard.supervisor.errors import NotFound

if TYPE_CHECKING:
    from sfguard.supervisor.daemon.guard import Guard

log = logging.getLogger("sfguard.guard")


def text(g: Guard) -> str:
    return (f"ended runs leave the guard's memory after the newest {g.keep_ended_runs} "
            f"or {g.keep_ended_seconds / 3600:g} h")


def run_ended(g: Guard, run: Run) -> None:
    """A run has ended: its record goes to disk, its place in memory is kept a while."""
    run.ended_at = time.time()
    try:
        g.records.save_ended(run)
    except OSError as exc:
        log.error("the record of ended run %s could not be written: %s", run.run_id, exc)
    g.ended[run.run_id] = run.ended_at
    retire(g)


def retire(g: Guard, now: float | None = None) -> None:
    """Drop ended runs beyond the retention (count and age) from memory."""
    now = time.time() if now is None else now
    while g.ended:
        run_id, ended_at = next(iter(g.ended.items()))
        if len(g.ended) <= g.keep_ended_runs and now - ended_at < g.keep_ended_seconds:
            break
        g.ended.popitem(last=False)
        run = g.runs.get(run_id)
        if run is not None and run.state == RunState.ENDED:
            del g.runs[run_id]
            g.retired += 1


def retired_error(g: Guard, run_id: str) -> NotFound:
    kept = g.records.ended_record(run_id) is not None
    return NotFound("run_not_found", f"run {run_id!r} has ended and left this guard's memory ("
                    f"{text(g)}); " + (
                        f"GET /v1/runs/{run_id} answers its record" if kept else
                        "no record of it is kept on disk either (see `sfguard audit show "
                        f"--run {run_id}`)"), "run_id")
