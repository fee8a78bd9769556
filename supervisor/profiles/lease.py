"""Profile leases across processes: one run holds a profile, other runs queue FIFO.

A lease belongs to a RUN, from its first stage that needs the profile until the run ends.
Acquiring by the holder run is re-entrant, so stages of one run never wait for each other.
Other runs are queued in arrival order (`seq`); `try_acquire` never blocks: it answers
`Granted` or `Waiting(holder_run, since, position)` and the daemon asks again later.

On disk (under the guard home, 0700 folders, 0600 files)::

    <home>/leases/<scope>/<name>.lease   JSON {"holder": {...} | null, "queue": [...], "next_seq": n}
    <home>/leases/<scope>/<name>.lock    empty sidecar; fcntl.flock on it guards every change

Each holder and queue entry records the guard process that wrote it (pid + process start
time). Every operation first drops entries whose process is gone (pid dead, or reused by a
process with another start time), and `sweep_stale()` does it for all profiles at start-up.
So two guard processes on one home never lease one profile twice, and a crashed guard never
leaves a lease behind.

The algorithm itself (grant, queue, release, drop the dead) is `sfguard.supervisor.profiles.lease_fifo`; this
class keeps its state on disk.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from sfguard.supervisor.home import FILE_MODE, atomic_write, ensure_home, private_dir
from sfguard.supervisor.profiles import lease_fifo
from sfguard.supervisor.profiles.lease_fifo import LeaseState
from sfguard.supervisor.protocols import (
    Granted,
    LeaseHolder,
    ProcessIdentity,
    ProfileError,
    ProfileKey,
    ProfileNameError,
    QueueEntry,
    Waiting,
    validate_name,
    validate_run_id,
)

__all__ = ["LeaseFileDamaged", "LocalProfileLease", "current_process", "process_alive"]


class LeaseFileDamaged(ProfileError):
    """A `.lease` file cannot be parsed. It is never reset or rewritten: who holds the profile
    is unknown, so the profile stays unusable until an operator inspects the file."""


def current_process() -> ProcessIdentity:
    """This process as a ProcessIdentity (pid + psutil create_time)."""
    return ProcessIdentity(os.getpid(), psutil.Process().create_time())


def process_alive(owner: ProcessIdentity) -> bool:
    """True when `owner.pid` runs and is the same process (same start time, not a zombie)."""
    try:
        proc = psutil.Process(owner.pid)
        if abs(proc.create_time() - owner.start_time) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _damaged(path: Path, exc: Exception) -> str:
    return (f"lease file {path} is damaged ({type(exc).__name__}); it was left untouched: "
            "inspect it, then remove it only if no guard uses that profile")


class LocalProfileLease:
    """ProfileLease on the local disk; safe across processes sharing one guard home.

    `owner` (default: this process) is recorded with every holder/queue entry; `alive`
    decides whether a recorded owner still runs (default: psutil pid + start time).
    """

    def __init__(self, home: Path, owner: ProcessIdentity | None = None,
                 alive: Callable[[ProcessIdentity], bool] = process_alive):
        self.home = ensure_home(home)
        self.root = self.home / "leases"
        self.owner = owner or current_process()
        self._alive = alive

    # ----------------------------------------------------------------- files
    def _paths(self, key: ProfileKey) -> tuple[Path, Path]:
        folder = self.root / validate_name(key.scope, "scope")
        return folder / f"{key.name}.lease", folder / f"{key.name}.lock"

    @contextlib.contextmanager
    def _locked(self, key: ProfileKey, write: bool = True) -> Iterator[LeaseState]:
        """Hold the profile's flock, yield its state, write it back (atomically) on success."""
        state_path, lock_path = self._paths(key)
        private_dir(self.root)
        private_dir(state_path.parent)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                data = json.loads(state_path.read_bytes())
            except FileNotFoundError:
                data = None
            except ValueError as exc:  # JSON or UTF-8 error: a damaged file
                raise LeaseFileDamaged(_damaged(state_path, exc)) from None
            try:
                if data is not None and not isinstance(data, dict):
                    raise TypeError("not a JSON object")
                state = LeaseState.from_json(key, data)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise LeaseFileDamaged(_damaged(state_path, exc)) from None
            before = state.to_json()
            yield state
            if write and state.to_json() != before:
                atomic_write(state_path, json.dumps(state.to_json(), sort_keys=True).encode())
        finally:
            os.close(fd)              # closing the descriptor releases the flock

    def _drop_dead(self, state: LeaseState) -> list[str]:
        return lease_fifo.drop_dead(state, self._alive)

    def _keys(self) -> list[ProfileKey]:
        out = []
        if self.root.is_dir():
            for scope in sorted(os.listdir(self.root)):
                folder = self.root / scope
                if not folder.is_dir():
                    continue
                for entry in sorted(os.listdir(folder)):
                    if entry.endswith(".lease"):
                        try:
                            out.append(ProfileKey(scope, entry[:-len(".lease")]))
                        except ProfileNameError:
                            continue
        return out

    # ----------------------------------------------------------------- ProfileLease
    def try_acquire(self, key: ProfileKey, run: str) -> Granted | Waiting:
        """Grant the profile to `run`, or queue it (FIFO) and say who holds it. Never blocks."""
        validate_run_id(run)
        now = time.time()
        with self._locked(key) as st:
            self._drop_dead(st)
            return lease_fifo.acquire(st, key, run, self.owner, now)

    def release(self, key: ProfileKey, run: str) -> bool:
        """Release `run`'s lease on `key` and drop it from the queue; True if it had either."""
        validate_run_id(run)
        with self._locked(key) as st:
            return lease_fifo.release(st, run)

    def release_all(self, run: str) -> list[ProfileKey]:
        """Run end (any outcome): release every lease and queue place of `run`."""
        validate_run_id(run)
        return [key for key in self._keys() if self.release(key, run)]

    def has_state(self, key: ProfileKey) -> bool:
        """True when `key` was ever leased or queued here (read-only callers skip the rest)."""
        state_path, _ = self._paths(key)
        return state_path.exists()

    def holder(self, key: ProfileKey) -> LeaseHolder | None:
        with self._locked(key) as st:
            self._drop_dead(st)
            return st.holder

    def queue(self, key: ProfileKey) -> list[QueueEntry]:
        with self._locked(key) as st:
            self._drop_dead(st)
            return list(st.queue)

    def sweep_stale(self) -> list[tuple[ProfileKey, str]]:
        """Release leases whose guard process is gone and drop its queue entries."""
        out: list[tuple[ProfileKey, str]] = []
        for key in self._keys():
            with self._locked(key) as st:
                out.extend((key, run) for run in self._drop_dead(st))
        return out
