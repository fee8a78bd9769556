"""The profile lease algorithm, pure: transitions over one profile's `LeaseState`.

A lease belongs to a RUN. Acquiring by the holder run is re-entrant; other runs queue in
arrival order (`seq`) and the first in the queue is granted when the profile is free. Entries
whose recording process is gone are dropped before every decision.

Nothing here reads a clock, a file or a process table: the caller passes `now`, the acting
`owner` and an `alive` check. `LocalProfileLease` (lease.py) stores the state as JSON under a
flock; the fake in `sfguard.supervisor.testing` keeps it in a dict. So the contract suite in
tests/profiles exercises this one algorithm over two stores.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sfguard.supervisor.protocols import (
    Granted,
    LeaseHolder,
    ProcessIdentity,
    ProfileKey,
    QueueEntry,
    Waiting,
)


@dataclass
class LeaseState:
    """Who holds one profile, who waits for it, and the next queue number."""

    holder: LeaseHolder | None = None
    queue: list[QueueEntry] = field(default_factory=list)
    next_seq: int = 1

    @classmethod
    def from_json(cls, key: ProfileKey, data: dict | None) -> LeaseState:
        """Parse the stored form; raises KeyError/TypeError/ValueError/AttributeError when it
        is damaged."""
        data = data or {}
        h = data.get("holder")
        return cls(
            LeaseHolder(key, h["run"], float(h["since"]), _owner_from(h)) if h else None,
            [QueueEntry(q["run"], float(q["since"]), int(q["seq"]), _owner_from(q))
             for q in data.get("queue", [])],
            int(data.get("next_seq", 1)))

    def to_json(self) -> dict:
        h = self.holder
        return {
            "holder": ({"run": h.run, "since": h.since, **_owner_json(h.owner)} if h else None),
            "queue": [{"run": q.run, "since": q.since, "seq": q.seq, **_owner_json(q.owner)}
                      for q in self.queue],
            "next_seq": self.next_seq,
        }


def _owner_json(o: ProcessIdentity) -> dict:
    return {"pid": o.pid, "pid_start_time": o.start_time}


def _owner_from(d: dict) -> ProcessIdentity:
    return ProcessIdentity(int(d["pid"]), float(d["pid_start_time"]))


def drop_dead(state: LeaseState, alive: Callable[[ProcessIdentity], bool]) -> list[str]:
    """Drop the holder and queue entries whose process is gone; returns the released runs."""
    released = []
    # One liveness check per distinct owner: a long queue is usually one guard process,
    # and a look-up per entry made every call O(queue length) (load finding F9).
    seen: dict[ProcessIdentity, bool] = {}

    def once(owner: ProcessIdentity) -> bool:
        if owner not in seen:
            seen[owner] = alive(owner)
        return seen[owner]

    if state.holder and not once(state.holder.owner):
        released.append(state.holder.run)
        state.holder = None
    state.queue = [q for q in state.queue if once(q.owner)]
    return released


def acquire(state: LeaseState, key: ProfileKey, run: str, owner: ProcessIdentity,
            now: float) -> Granted | Waiting:
    """Grant the profile to `run`, or queue it (FIFO) and say who holds it."""
    if state.holder and state.holder.run == run:
        return Granted(key, run, state.holder.since, reentrant=True)
    if state.holder is None and (not state.queue or state.queue[0].run == run):
        state.queue = [q for q in state.queue if q.run != run]
        state.holder = LeaseHolder(key, run, now, owner)
        return Granted(key, run, now)
    runs = [q.run for q in state.queue]
    if run not in runs:
        state.queue.append(QueueEntry(run, now, state.next_seq, owner))
        state.next_seq += 1
        runs.append(run)
    i = runs.index(run)
    holder = state.holder
    return Waiting(key, run, holder.run if holder else None, holder.since if holder else None,
                   i + 1, state.queue[i].since)


def release(state: LeaseState, run: str) -> bool:
    """Drop `run` as holder and from the queue; True if it was either."""
    changed = False
    if state.holder and state.holder.run == run:
        state.holder, changed = None, True
    kept = [q for q in state.queue if q.run != run]
    changed |= len(kept) != len(state.queue)
    state.queue = kept
    return changed
