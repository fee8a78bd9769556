"""The guard's runs by id, and ended runs: kept in memory for a while (status, the console, GET),
then only on disk.

An ended run stays in the guard's runs while it is among the newest `keep_runs` ended runs and
for at most `keep_seconds` (`sfguard start --keep-ended-runs/--keep-ended-hours`); then its
record (runs/ended/<id>.json) and the audit log keep it. `Retention` owns that bookkeeping and
the lookups that must tell a retired run from an unknown one (`run_of`, `active_run`): the
daemon calls `run_ended(run)` at every run's end and `retire()` before a new run."""
from __future__ import annotations

import collections
import logging
import time

from sfguard.supervisor.daemon.crash import RunRecords
from sfguard.supervisor.daemon.runs import Run, RunState, Stage
from sfguard.supervisor.errors import Conflict, NotFound

log = logging.getLogger("sfguard.guard")


class Retention:
    """The ended runs still in memory, oldest end first, and how many have left it."""

    def __init__(self, *, runs: dict[str, Run], records: RunRecords, keep_runs: int, keep_seconds: float):
        self.runs, self.records = runs, records
        self.keep_runs, self.keep_seconds = keep_runs, keep_seconds
        #: run id -> end time, oldest end first
        self.ended: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.retired = 0

    def text(self) -> str:
        return (f"ended runs leave the guard's memory after the newest {self.keep_runs} "
                f"or {self.keep_seconds / 3600:g} h")

    def run_ended(self, run: Run) -> None:
        """A run has ended: its record goes to disk, its place in memory is kept a while."""
        run.ended_at = time.time()
        try:
            self.records.save_ended(run)
        except OSError as exc:
            log.error("the record of ended run %s could not be written: %s", run.run_id, exc)
        self.ended[run.run_id] = run.ended_at
        self.retire()

    def retire(self, now: float | None = None) -> None:
        """Drop ended runs beyond the retention (count and age) from memory."""
        now = time.time() if now is None else now
        while self.ended:
            run_id, ended_at = next(iter(self.ended.items()))
            if len(self.ended) <= self.keep_runs and now - ended_at < self.keep_seconds:
                break
            self.ended.popitem(last=False)
            run = self.runs.get(run_id)
            if run is not None and run.state == RunState.ENDED:
                del self.runs[run_id]
                self.retired += 1

    def retired_error(self, run_id: str) -> NotFound:
        kept = self.records.ended_record(run_id) is not None
        return NotFound("run_not_found", f"run {run_id!r} has ended and left this guard's memory ("
                        f"{self.text()}); " + (
                            f"GET /v1/runs/{run_id} answers its record" if kept else
                            "no record of it is kept on disk either (see `sfguard audit show "
                            f"--run {run_id}`)"), "run_id")

    def run_of(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            if self.records.ended_record(run_id) is not None:
                raise self.retired_error(run_id)
            raise NotFound("run_not_found", f"no run {run_id!r} on this guard (or it ended "
                           f"before the guard's last start, or {self.text()} and its "
                           "record is not kept)", "run_id")
        return run

    def active_run(self, run_id: str) -> Run:
        if run_id not in self.runs and self.records.ended_record(run_id) is not None:
            raise Conflict("run_ended", f"run {run_id!r} has ended (and left this guard's memory)",
                           "run_id")
        run = self.run_of(run_id)
        if run.state != RunState.ACTIVE:
            raise Conflict("run_ended", f"run {run_id!r} has ended ({run.outcome})", "run_id")
        return run

    @staticmethod
    def stage_of(run: Run, stage_id: str) -> Stage:
        stage = run.stages.get(stage_id)
        if stage is None:
            raise NotFound("stage_not_found", f"no stage {stage_id!r} in run {run.run_id!r}", "stage_id")
        return stage

    def summary(self) -> dict[str, float | int]:
        """Status's figures of it."""
        return {"ended_in_memory": len(self.ended), "retired": self.retired,
                "keep_ended_runs": self.keep_runs, "keep_ended_hours": self.keep_seconds / 3600}
