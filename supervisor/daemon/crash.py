"""Crash records and the sweep that reads them.

While a run lives, `RunRecords.save` keeps `runs/<id>.json` (no secrets): the processes, session
names and runtime paths the run started, and the daemon that owns it. After a crash of the
daemon, `sweep()` (at `sfguard start`, or `sfguard sweep`) ends those processes (by pid AND start
time), removes the files, reseals unsealed profiles and releases the leases. Under a root guard
the record also names each browser's user (one per browser, supervisor/browsers/browser_pool.py):
the sweep ends every process of those users and gives them back to the pool once their files
are resealed or gone.

When a run ends, its crash record goes and `RunRecords.save_ended` keeps what the API showed
of it in `runs/ended/<id>.json` (no secrets): GET /v1/runs/{id} answers it once the run has
left the guard's memory (retention, supervisor/daemon/guard.py) or the guard was restarted.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.browsers import agent_browser, browser_pool
from sfguard.supervisor.browsers.browser_user import BrowserUser, take_back
from sfguard.supervisor.daemon.runs import Run, StageState
from sfguard.supervisor.daemon.stage_sessions import StageSessions
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.home import atomic_write, private_dir
from sfguard.supervisor.procs import ProcRecord, scan_orphans, terminate_recorded
from sfguard.supervisor.profiles import rotation, store_ops
from sfguard.supervisor.profiles.key_versions import KeyStateError
from sfguard.supervisor.profiles.keys import KeyMissing
from sfguard.supervisor.profiles.lease import current_process, process_alive
from sfguard.supervisor.protocols import ProcessIdentity, ProfileError
from sfguard.supervisor.stage.sandbox import lookup_user

if TYPE_CHECKING:
    from sfguard.supervisor.daemon.guard import Guard

log = logging.getLogger("sfguard.guard")


class RunRecords:
    """The crash records of this guard's runs (`<home>/runs/<id>.json`, 0600, atomic)."""

    def __init__(self, runs_dir: Path, scope: str, sessions: StageSessions):
        self.runs_dir, self.scope, self.sessions = runs_dir, scope, sessions
        self.ended_dir = runs_dir / "ended"

    def save(self, run: Run) -> None:
        """The crash record: what to clean if this daemon dies. No secrets."""
        procs: list[dict[str, Any]] = []
        paths: list[str] = [str(run.workdir)] if run.workdir else []
        unsealed: list[str] = []
        users = [{"user": b.user.name, "uid": b.user.uid, "browser": b.key} for b in run.browsers.values()
                 if b.user is not None]
        for b in run.browsers.values():
            if b.anchor is not None:
                procs += [p.to_json() for p in b.anchor.processes]
                if b.anchor.temp_profile:
                    paths.append(str(b.anchor.profile_dir))
            if b.profile is not None:
                unsealed.append(b.profile.name)
        spare_sessions: list[str] = []
        for b in run.browsers.values():
            if b.anchor is not None:   # a session started ahead for the anchor's next stage
                spare_procs, spare_sessions_b = self.sessions.spare_records(b.anchor)
                procs += [p.to_json() for p in spare_procs]
                spare_sessions += spare_sessions_b
        for st in run.stages.values():
            if st.state == StageState.READY:
                procs += [p.to_json() for p in st.processes]
        if run.proxy and run.proxy.record:
            procs.append(run.proxy.record.to_json())
        rec = {"run_id": run.run_id, "daemon": {"pid": os.getpid(), "start_time": current_process().start_time},
               "scope": self.scope, "processes": procs, "paths": paths, "profiles": sorted(set(unsealed)),
               "browser_users": users,
               "sessions": [s.env["AGENT_BROWSER_SESSION"] for s in run.stages.values()
                            if s.env and s.state == StageState.READY] + spare_sessions}
        atomic_write(self.runs_dir / f"{run.run_id}.json", json.dumps(rec).encode())

    def save_ended(self, run: Run) -> None:
        """The record of an ended run (`runs/ended/<id>.json`, what GET /v1/runs/{id} showed at
        its end): it outlives the run's place in memory (Guard.retire) and restarts.

        Written whole (a temp file renamed over the name) but not fsynced: a guard ending
        thousands of runs must not wait ~15 ms of disk flushes for each on its event loop. A
        power cut may lose the newest records (the audit log, fsynced, still has the runs);
        it never leaves half a record."""
        folder = private_dir(self.ended_dir)
        atomic_write(folder / f"{run.run_id}.json", json.dumps(run.public()).encode(), sync=False)

    def ended_record(self, run_id: str) -> dict[str, Any] | None:
        """The kept record of an ended run, or None."""
        try:
            rec = json.loads((self.ended_dir / f"{run_id}.json").read_bytes())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def drop(self, run_id: str) -> None:
        """The run ended cleanly: nothing of it is left to sweep."""
        with contextlib.suppress(FileNotFoundError):
            (self.runs_dir / f"{run_id}.json").unlink()


def release_runtime(guard: Guard) -> bool:
    """Remove the guard's runtime folder (memory-backed: sockets, config, throw-away profiles)
    when nothing in it still matters, i.e. no profile is left unsealed (a failed reseal keeps
    its working copy for the next sweep). True when it was removed."""
    if guard.store.unsealed():
        log.error("an unsealed profile is left in the runtime folder; the next start reseals it")
        return False
    shutil.rmtree(guard.runtime, ignore_errors=True)
    return not guard.runtime.exists()


def _recorded_uids(runs_dir: Path) -> set[int]:
    """The browser users' uids the run records name."""
    uids: set[int] = set()
    for path in runs_dir.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            uids |= {int(u["uid"]) for u in json.loads(path.read_text()).get("browser_users", [])}
    return uids


def _sweep_pool(guard: Guard) -> browser_pool.BrowserPool | None:
    """The guard's pool; for `sfguard sweep` (a guard not started), its existing users."""
    if guard.pool is not None or os.geteuid() != 0:
        return guard.pool
    try:
        users = browser_pool.ensure_users(guard.settings.browser_pool, create=False)
    except browser_pool.PoolError:     # not all there: those that are (nothing else runs as them)
        users = [u for u in (lookup_user(n) for n in guard.settings.browser_pool.names()) if u]
    return browser_pool.BrowserPool(users, guard.runtime) if users else None


def _return_users(guard: Guard, pool: browser_pool.BrowserPool, claimed: list[BrowserUser]) -> list[str]:
    """Give back the users a dead guard left: what they still own in the runtime's profiles (a
    working copy kept unsealed) is taken back by root first."""
    uids = {u.uid for u in claimed}
    owned = []
    for folder in (guard.runtime / "profiles").glob("*/*"):
        with contextlib.suppress(OSError):
            if folder.lstat().st_uid in uids:
                owned.append(folder)
    for folder in owned:
        with swallowed(log, f"sweep: taking back {folder.name}", (OSError,)):
            take_back(folder)
    return [u.name for u in claimed if pool.give_back(u)]


def sweep(guard: Guard) -> dict:
    """Clean what dead runs left: processes (by pid AND start time), session files, temp dirs,
    unsealed profiles (resealed), stale leases. Returns a report of what was done."""
    report: dict[str, Any] = {"runs": [], "processes": 0, "resealed": [], "leases": [], "orphans": 0,
                              "browser_users": []}
    pool = _sweep_pool(guard)
    # the users a dead guard of this runtime left: locked, every process of them ended first
    claimed = pool.claim_left(_recorded_uids(guard.runs_dir)) if pool is not None else []
    for path in sorted(guard.runs_dir.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            daemon = rec.get("daemon", {})
            owner = ProcessIdentity(int(daemon["pid"]), float(daemon["start_time"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("run record %s is unreadable (%s); left in place for inspection", path.name, exc)
            report.setdefault("unreadable", []).append(path.name)
            continue
        if process_alive(owner) and owner.pid != os.getpid():
            continue  # a live guard owns it
        records = [ProcRecord.from_json(p) for p in rec.get("processes", [])]
        report["processes"] += len(terminate_recorded(records, timeout=5))
        for sess in rec.get("sessions", []):
            with swallowed(log, f"sweep: removing session files of {sess}", (OSError, ValueError)):
                agent_browser.remove_session_files(guard.socket_dir, sess)
        for p in rec.get("paths", []):
            pp = Path(p)
            if pp.is_relative_to(guard.runtime):
                shutil.rmtree(pp, ignore_errors=True)
        run_id = rec.get("run_id")
        report["runs"].append(run_id)
        try:
            released, problems = store_ops.release_run(guard.stores, run_id, "abandoned")
        except ValueError:
            released, problems = [], []  # a record without a valid run id holds no lease
        for problem in problems:
            log.error("sweep of run %s: %s", run_id, problem)
        report["leases"] += [key.name for key in released]
        path.unlink()
    # processes that carry this guard's runtime paths but no record (e.g. killed mid-launch)
    # ... of the guard's user and of its browser users
    orphans = scan_orphans([str(guard.runtime)], pool.uids if pool is not None else ())
    report["orphans"] = len(terminate_recorded(orphans, timeout=5))
    for key in guard.store.unsealed():
        try:
            rotation.close_profile(guard.stores, key)
            report["resealed"].append(key.name)
        except (KeyMissing, KeyStateError) as exc:  # no current key here: kept, never sealed under another
            log.error("profile %s could not be resealed after a crash (%s); its unsealed copy is "
                      "kept until the current key version can be used", key.name, exc)
            report.setdefault("kept_unsealed", []).append(key.name)
        except (ProfileError, OSError) as exc:   # a seal or store failure, a full disk
            log.error("profile %s could not be resealed after a crash (%s); the previous sealed "
                      "copy is kept", key.name, exc)
            with swallowed(log, f"sweep: closing the unsealed copy of {key.name}"):
                guard.store.close(key, save=False)
    if pool is not None:
        report["browser_users"] = _return_users(guard, pool, claimed)
        if pool is not guard.pool:
            pool.close()
    for key, run_id in guard.stores.lease.sweep_stale():
        if not store_ops.audited(guard.stores.lease):    # the shared store audits it as it drops it
            guard.audit.record("profile_released", scope=key.scope, profile=key.name,
                               run=run_id, outcome="abandoned")
        report["leases"].append(key.name)
    return report
