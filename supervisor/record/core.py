"""The recorder's core: one timeline per run, kept as the run goes (issue 48).

Every entry comes from the guard's side, never from the stage: the CDP gate's relay (each
command, forwarded or refused), the guard's own session on each browser's pipe (navigations,
loads, screenshots: supervisor/record/tabs.py), the write gate and the approvals store, the
audit chain's records that name a run (login checks, handoffs, console actions), the decision
log's lines of the run's proxy (supervisor/record/tail.py) and the guard's own stage and run
lifecycle. The sources are in supervisor/record/sources.py and the whole, `Recorder`, in
recorder.py; this module keeps the runs, the levels, the size cap, the screenshots and the seal.

Each entry: `seq` (the order written), `t` (monotonic seconds, the order things happened in),
`ts` (wall clock, UTC, ms), `kind`, the stage and attempt where one did it, what happened, and
`links` to entries it belongs with (seq numbers, a screenshot's name, an approval's id).

Levels: the guard's (`sfguard start --record full|decisions|off`) is a ceiling over each site's
(sites.yaml `recording`, policy/recording.py). `decisions` keeps only what the guard decided
and the lifecycle; `off` at the guard records no run; a site `off` leaves nothing of it.
Bounded: at `max_run_mb` a run's record keeps only decisions (10% more), then nothing; records
ended longer ago than `keep_days` are removed, the oldest first beyond `max_total_mb`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sfguard.policy.recording import LEVELS, stricter
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.record import files, shared, summary
from sfguard.supervisor.record.runrec import RunRec, StageRec, site
from sfguard.supervisor.record.tabs import TabWatcher

log = logging.getLogger("sfguard.record")

MB = 1024 * 1024
#: how often written entries are fsynced, interval screenshots looked at, old records pruned
SYNC_S = 1.0
PRUNE_S = 3600.0
#: a load's or an interval's picture waits until the stage has been quiet this long (at most QUIET_MAX_S)
QUIET_S = 0.3
QUIET_MAX_S = 3.0


@dataclass(frozen=True)
class RecordSettings:
    """`sfguard start --record LEVEL --record-keep-days N --record-max-mb N --record-max-total-mb N
    --record-shot-interval S`."""
    level: str = "full"
    keep_days: float = 14.0
    max_run_mb: float = 256.0
    max_total_mb: float = 10240.0
    shot_interval: float = 15.0
    shot_quality: int = 50

    def check(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"--record: one of {', '.join(LEVELS)}")
        if not (self.keep_days > 0 and self.max_run_mb >= 1 and self.max_total_mb >= self.max_run_mb):
            raise ValueError("record retention: keep days > 0, at least 1 MB a run, a total at least that")
        if not (self.shot_interval == 0 or self.shot_interval >= 1) or not 10 <= self.shot_quality <= 95:
            raise ValueError("--record-shot-interval: 0 (none) or at least 1 second")


def now_ts() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


class RecordCore:
    """Built by the guard with its home, settings, the live site policy, the audit sink (the
    seal), the gate (whose tabs a stage owns) and, on a shared store, its backend."""

    def __init__(self, root: Path, settings: RecordSettings, *, policy: Any, audit: Any = None,
                 gate: Any = None, backend: Any = None, host: str | None = None) -> None:
        self.root, self.settings, self.policy = root, settings, policy
        self.audit, self.gate, self.backend = audit, gate, backend
        self.host = host or os.uname().nodename
        self.runs: dict[str, RunRec] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._spawned: set[asyncio.Task] = set()
        self._levels_of: Any = None
        self._levels: dict[tuple, str] = {}

    @property
    def on(self) -> bool:
        return self.settings.level != "off"

    # -- lifecycle of the recorder ----------------------------------------------------------
    async def stop(self) -> None:
        for run_id in list(self.runs):
            await self.run_ended(run_id, "abandoned", ["the guard stopped"])
        for task in self._tasks + list(self._spawned):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._spawned, return_exceptions=True)

    def spawn(self, coro: Any) -> None:
        if self.loop is None or self.loop.is_closed():
            coro.close()
            return
        task = self.loop.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(SYNC_S)
            with swallowed(log, "syncing the run records", (OSError,)):
                await asyncio.to_thread(self._sync_all)
            self._interval_shots()

    def _sync_all(self) -> None:
        for run in list(self.runs.values()):
            run.writer.sync()

    async def _prune_loop(self) -> None:
        while True:
            with swallowed(log, "pruning old run records", (OSError,)):
                await asyncio.to_thread(self.prune)
            await asyncio.sleep(PRUNE_S)

    def prune(self) -> list[str]:
        s = self.settings
        gone = files.prune(self.root, s.keep_days * 86400, int(s.max_total_mb * MB),
                           active=frozenset(r.writer.folder.name for r in self.runs.values()))
        for name in gone:
            log.info("run record %s removed (retention)", name)
            self._audit("run_record_removed", record=name, reason="retention")
        return gone

    # -- runs ---------------------------------------------------------------------------------
    def run_started(self, run_id: str, pipeline: str | None) -> None:
        if not self.on or run_id in self.runs:
            return
        try:
            folder = files.new_folder(self.root, run_id)
            writer = files.RecordWriter(folder)
            index: dict[str, Any] = {"record": folder.name, "run_id": run_id, "host": self.host, "state": "active",
                     "pipeline": os.path.basename(pipeline) if pipeline else None, "profiles": [],
                     "stages": [], "started": round(time.time(), 3), "ended": None, "outcome": None,
                     "level": self.settings.level}
            files.write_index(folder, index, sync=False)
        except OSError as exc:
            log.error("run %s: its record cannot be written (%s); the run goes on unrecorded", run_id, exc)
            return
        self.runs[run_id] = RunRec(run_id, writer, index)
        self.entry(run_id, "run_started", decision=True, pipeline=index["pipeline"], level=self.settings.level)
        self.spawn(self._publish(index, final=False))

    async def run_ended(self, run_id: str, outcome: str, problems: list[str] | None = None) -> None:
        run = self.runs.get(run_id)
        if run is None:
            return
        self.entry(run_id, "run_ended", decision=True, outcome=str(outcome), problems=len(problems or []))
        del self.runs[run_id]
        for watcher in list(run.watchers.values()):
            with swallowed(log, "closing the run record's view of a browser"):
                await watcher.close()
        index = await asyncio.to_thread(self._close_and_seal, run, str(outcome))
        if index is not None:
            await self._publish(index, final=True)

    def _close_and_seal(self, run: RunRec, outcome: str) -> dict[str, Any] | None:
        w = run.writer
        try:
            w.close()
        except OSError as exc:
            log.error("the record of run %s could not be closed: %s", run.run_id, exc)
        with run.index_lock:
            run.sealed = True
            return self.seal(w.folder, run.index, "ended", outcome,
                             files.Written(w.seq, w.head, dict(w.shots), w.bytes), dropped=run.dropped,
                             capped=run.capped)

    def seal(self, folder: Path, index: dict[str, Any], state: str, outcome: str, written: files.Written,
             **extra: Any) -> dict[str, Any] | None:
        """Write the final index and put its digest in the audit chain (`run_recorded`)."""
        try:
            index = dict(index, state=state, outcome=outcome, ended=round(time.time(), 3), entries=written.seq,
                         head=written.head, shots=written.shots, bytes=written.bytes, **extra)
            sha = files.write_index(folder, index)
        except OSError as exc:
            log.error("the record of run %s could not be sealed: %s", index.get("run_id"), exc)
            return None
        self._audit("run_recorded", run=index["run_id"], record=index["record"], record_sha256=sha,
                    count=written.seq)
        return index

    def recover(self) -> list[str]:
        """Records a guard left open (it was killed): sealed as they are on disk, `abandoned`."""
        sealed = []
        mine = {r.writer.folder.name for r in self.runs.values()}
        for folder in files.folders(self.root):
            index = files.read_index(folder)
            if index is None or index.get("state") != "active" or folder.name in mine:
                continue
            if self.seal(folder, index, "abandoned", "abandoned", files.on_disk(folder),
                         note="the guard stopped without ending the run"):
                sealed.append(folder.name)
        return sealed

    async def _publish(self, index: dict[str, Any], final: bool) -> None:
        if self.backend is None:
            return
        with swallowed(log, f"run {index.get('run_id')}: its record in the shared store"):
            folder = self.root / str(index["record"])
            await asyncio.to_thread(shared.publish, self.backend, folder, index, final)

    def _audit(self, event: str, **fields: Any) -> None:
        if self.audit is None:
            return
        with swallowed(log, f"the audit record {event}"):
            self.audit.record(event, **fields)

    # -- entries ------------------------------------------------------------------------------
    def level(self, *sites: tuple[str | None, int | None]) -> str:
        """The level for what touches these sites: the guard's, stricter by each site's (kept
        per policy in force: a reload of sites.yaml applies at once)."""
        rules = getattr(self.policy(), "recording", None)
        if rules is not self._levels_of:
            self._levels_of, self._levels = rules, {}
        out = self._levels.get(sites)
        if out is None:
            out = self.settings.level
            for host, port in sites:
                if host and rules is not None:
                    out = stricter(out, rules.level(host, port))
            if len(self._levels) < 4096:
                self._levels[sites] = out
        return out

    def entry(self, run_id: str, kind: str, *, decision: bool, t: float | None = None, ts: str | None = None,
              links: dict[str, Any] | None = None, **fields: Any) -> int | None:
        """Append one entry to a run's timeline; its seq, or None when it was not kept (no such
        run, the size cap, a full disk)."""
        run = self.runs.get(run_id)
        if run is None:
            return None
        cap = self.settings.max_run_mb * MB
        if run.writer.bytes >= cap:
            if not run.capped:
                run.capped = True
                self._write(run, {"kind": "record_capped", "bytes": run.writer.bytes})
            if not decision or run.writer.bytes >= cap * 1.1:
                run.dropped += 1
                return None
        entry = {"kind": kind, "t": round(time.monotonic() if t is None else t, 4), "ts": ts or now_ts(),
                 **{k: v for k, v in fields.items() if v is not None}}
        if links:
            entry["links"] = {k: v for k, v in links.items() if v is not None}
        return self._write(run, entry)

    def _write(self, run: RunRec, entry: dict[str, Any]) -> int | None:
        if "t" not in entry:
            entry["t"] = round(time.monotonic(), 4)
        if "ts" not in entry:
            entry["ts"] = now_ts()
        try:
            return run.writer.append(entry)[0]
        except OSError as exc:
            if not run.dropped:
                log.error("run %s: its record cannot be written (%s); entries are lost", run.run_id, exc)
            run.dropped += 1
            return None

    # -- screenshots --------------------------------------------------------------------------
    def shoot(self, run_id: str, stage_id: str | None, tab: str | None, why: str, cause: int | None,
              handoff: bool = False, quiet: bool = False) -> None:
        """A picture of a stage's tab, in the background (never of a tab no stage owns, of a
        browser in a login handoff (`handoff`: the one picture as it opens), of a site recorded
        below full, or over the cap). `quiet`: once the stage has sent nothing for QUIET_S (at
        most QUIET_MAX_S): a capture holds the tab's renderer for milliseconds, and a stage
        reads a page right after it loads; a picture of a tab that went on to another page
        meanwhile is not taken (that page's own load takes one)."""
        run = self.runs.get(run_id)
        st = run.stages.get(stage_id) if run is not None and stage_id else None
        if run is None or st is None or tab is None or st.pipe is None or self.settings.level != "full":
            return
        watcher = run.watchers.get(id(st.pipe))
        if watcher is None or run.capped or (run.profile_of.get(id(st.pipe), "") in run.paused and not handoff):
            return
        st.last_shot, st.busy = time.monotonic(), 0
        self.spawn(self._shoot(run, stage_id, st, watcher, tab, why, cause, handoff, quiet))

    async def _shoot(self, run: RunRec, stage_id: str | None, st: StageRec, watcher: TabWatcher, tab: str,
                     why: str, cause: int | None, handoff: bool = False, quiet: bool = False) -> None:
        url = (st.pipe.targets.get(tab) or {}).get("url")
        if quiet:
            until = time.monotonic() + QUIET_MAX_S
            while time.monotonic() - st.last_t < QUIET_S and time.monotonic() < until:
                await asyncio.sleep(QUIET_S / 2)
            if (st.pipe.targets.get(tab) or {}).get("url") != url:
                return
        if self.level(site(url)) != "full":
            return
        data = await watcher.capture(tab, self.settings.shot_quality)
        after = (st.pipe.targets.get(tab) or {}).get("url")
        paused = run.profile_of.get(id(st.pipe), "") in run.paused and not handoff
        if data is None or self.level(site(after)) != "full" or paused:
            return
        await self.keep_shot(run, data, ".jpg", stage=stage_id, attempt=st.attempt, tab=tab[:8], why=why,
                             url=summary.address(after), cause=cause)

    async def keep_shot(self, run: RunRec, data: bytes, ext: str, *, cause: int | None, **fields: Any) -> None:
        run.shots += 1
        name = f"{run.shots:05d}{ext}"
        try:
            if not await asyncio.to_thread(run.writer.add_shot, name, data):
                return
        except OSError as exc:
            log.warning("run %s: a screenshot could not be kept: %s", run.run_id, exc)
            return
        self.entry(run.run_id, "screenshot", decision=False, shot=name, links={"for": cause}, **fields)

    def _interval_shots(self) -> None:
        every = self.settings.shot_interval
        if not every:
            return
        now = time.monotonic()
        for run in list(self.runs.values()):
            for stage_id, st in list(run.stages.items()):
                if st.ready and st.busy and st.last_tab and now - st.last_shot >= every:
                    self.shoot(run.run_id, stage_id, st.last_tab, "interval", st.last_cmd, quiet=True)
