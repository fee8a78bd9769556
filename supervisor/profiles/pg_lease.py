"""Leases in the shared store: `PgProfileLease` (ProfileLease); see pg_backend.py.

One row per profile (holder + `generation`), a FIFO queue table, and a `sfguard_guards` row per
guard process whose `expires_at` its heartbeat pushes forward. A holder or queue entry whose
guard stopped beating for longer than the TTL is dropped by the next caller. Every grant
increments the profile's generation: the grant's fencing token, which every reseal and state
write of pg_store.py checks in its own transaction.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from sfguard.supervisor.profiles.pg_audit import PgAuditSink
from sfguard.supervisor.profiles.pg_backend import GUARD_ALIVE, PgBackend
from sfguard.supervisor.protocols import (
    Granted,
    LeaseHolder,
    ProcessIdentity,
    ProfileKey,
    QueueEntry,
    StoreUnavailable,
    Waiting,
    validate_run_id,
)

log = logging.getLogger("sfguard.pg_store")     # one logger for the whole shared store

__all__ = ["PgProfileLease"]


class PgProfileLease:
    """ProfileLease on PostgreSQL: one holder per profile across hosts, FIFO queue, TTL and
    fencing tokens (see the module docstring).

    With an audit sink, every change of holder writes its audit record in the transaction
    that makes it (`audits_changes`): a grant (`profile_leased`), a release
    (`profile_released` with the run's outcome) and a holder dropped after its guard's TTL
    (`profile_released`, outcome `expired`). A crash or a refused write between the two can
    leave neither alone."""

    def __init__(self, backend: PgBackend, audit: PgAuditSink | None = None):
        self.backend = backend
        self.audit = audit
        self.audits_changes = audit is not None

    def _audit(self, conn, event: str, key: ProfileKey, **fields: Any) -> None:
        if self.audit is not None:
            self.audit.append_event(conn, event, scope=key.scope, profile=key.name, **fields)

    @contextlib.contextmanager
    def _locked(self, key: ProfileKey) -> Iterator[tuple[Any, list]]:
        """A transaction holding the profile's lease row (created when missing) after dropping
        every holder and queue entry whose guard expired. Yields (conn, dropped runs)."""
        with self.backend.conn() as conn:
            self.backend.beat(conn)
            conn.execute("INSERT INTO sfguard_leases (scope, name) VALUES (%s, %s) "
                         "ON CONFLICT DO NOTHING", (key.scope, key.name))
            # Lock the lease row alone, then read the holder's guard: a join under FOR UPDATE
            # would re-check a row changed meanwhile against the guard row read before it.
            row = conn.execute("SELECT holder_run, holder_guard FROM sfguard_leases WHERE "
                               "scope = %s AND name = %s FOR UPDATE", (key.scope, key.name)).fetchone()
            alive = row[1] is not None and conn.execute(
                "SELECT 1 FROM sfguard_guards g WHERE g.guard_id = %s AND " + GUARD_ALIVE,
                (row[1],)).fetchone() is not None
            dropped = []
            if row[0] is not None and not alive:
                dropped.append(row[0])
                conn.execute("UPDATE sfguard_leases SET holder_run = NULL, holder_guard = NULL, "
                             "holder_since = NULL WHERE scope = %s AND name = %s",
                             (key.scope, key.name))
                self._audit(conn, "profile_released", key, run=row[0], outcome="expired")
                log.info("lease of %s held by run %s expired (its guard %s stopped beating)",
                         key, row[0], row[1])
            conn.execute(
                "DELETE FROM sfguard_queue q WHERE q.scope = %s AND q.name = %s AND NOT EXISTS "
                "(SELECT 1 FROM sfguard_guards g WHERE g.guard_id = q.guard_id AND " + GUARD_ALIVE + ")",
                (key.scope, key.name))
            yield conn, dropped

    @staticmethod
    def _holder_row(conn, key: ProfileKey):
        return conn.execute(
            "SELECT l.holder_run, l.holder_since, l.holder_guard, g.host, g.pid, g.started, "
            "l.generation FROM sfguard_leases l LEFT JOIN sfguard_guards g ON "
            "g.guard_id = l.holder_guard WHERE l.scope = %s AND l.name = %s",
            (key.scope, key.name)).fetchone()

    @staticmethod
    def _queue_rows(conn, key: ProfileKey, alive: bool = False):
        return conn.execute(
            "SELECT q.run, q.guard_id, q.since, q.seq, g.pid, g.started FROM sfguard_queue q "
            "LEFT JOIN sfguard_guards g ON g.guard_id = q.guard_id WHERE q.scope = %s AND "
            "q.name = %s" + (" AND " + GUARD_ALIVE if alive else "") + " ORDER BY q.seq",
            (key.scope, key.name)).fetchall()

    def try_acquire(self, key: ProfileKey, run: str) -> Granted | Waiting:
        """Grant the profile to `run` of this guard (a new fencing token), or queue it FIFO
        across every guard and name the holder (host, guard, run). Never blocks on a holder."""
        validate_run_id(run)
        me = self.backend.guard_id
        with self._locked(key) as (conn, _dropped):
            h = self._holder_row(conn, key)
            if h[0] == run and h[2] == me:
                with self.backend.tokens_lock:
                    self.backend.tokens[key] = (run, int(h[6]))
                return Granted(key, run, float(h[1]), reentrant=True)
            queue = self._queue_rows(conn, key)
            first = queue[0] if queue else None
            if h[0] is None and (first is None or (first[0] == run and first[1] == me)):
                got = conn.execute(
                    "UPDATE sfguard_leases SET holder_run = %s, holder_guard = %s, holder_since = "
                    "extract(epoch FROM clock_timestamp()), generation = generation + 1 WHERE "
                    "scope = %s AND name = %s RETURNING holder_since, generation",
                    (run, me, key.scope, key.name)).fetchone()
                conn.execute("DELETE FROM sfguard_queue WHERE scope = %s AND name = %s AND "
                             "run = %s AND guard_id = %s", (key.scope, key.name, run, me))
                self._audit(conn, "profile_leased", key, run=run)
                granted = Granted(key, run, float(got[0]))
            else:
                granted = None
                mine = [i for i, q in enumerate(queue) if q[0] == run and q[1] == me]
                if not mine:
                    q = conn.execute(
                        "INSERT INTO sfguard_queue (scope, name, run, guard_id, since) VALUES "
                        "(%s, %s, %s, %s, extract(epoch FROM clock_timestamp())) RETURNING since",
                        (key.scope, key.name, run, me)).fetchone()
                    position, since = len(queue) + 1, float(q[0])
                else:
                    position, since = mine[0] + 1, float(queue[mine[0]][2])
        if granted is not None:         # committed: only now is the token this guard's
            with self.backend.tokens_lock:
                self.backend.tokens[key] = (run, int(got[1]))
            return granted
        return Waiting(key, run, h[0], None if h[1] is None else float(h[1]), position, since,
                       holder_host=h[3] if h[0] else None, holder_guard=h[2] if h[0] else None)

    def release(self, key: ProfileKey, run: str, outcome: str = "released") -> bool:
        """Release this guard's `run` on `key` and drop it from the queue (a held lease's
        release is audited with `outcome` in the same transaction)."""
        validate_run_id(run)
        try:
            return self._release(key, run, outcome)
        except StoreUnavailable:
            self.backend.defer(f"release of profile {key} by run {run}",
                               lambda: self._release(key, run, "released_late"))
            raise

    def _release(self, key: ProfileKey, run: str, outcome: str) -> bool:
        me = self.backend.guard_id
        with self.backend.conn() as conn:
            held = conn.execute(
                "UPDATE sfguard_leases SET holder_run = NULL, holder_guard = NULL, holder_since = "
                "NULL WHERE scope = %s AND name = %s AND holder_run = %s AND holder_guard = %s",
                (key.scope, key.name, run, me)).rowcount
            queued = conn.execute("DELETE FROM sfguard_queue WHERE scope = %s AND name = %s AND "
                                  "run = %s AND guard_id = %s",
                                  (key.scope, key.name, run, me)).rowcount
            if held:
                self._audit(conn, "profile_released", key, run=run, outcome=outcome)
        with self.backend.tokens_lock:
            if self.backend.tokens.get(key, ("",))[0] == run:
                del self.backend.tokens[key]
        return bool(held or queued)

    def release_all(self, run: str, outcome: str = "released") -> list[ProfileKey]:
        """Release every lease and queue place of this guard's `run`; each held lease's
        `profile_released` record (with the run's `outcome`) commits with the release."""
        validate_run_id(run)
        try:
            return self._release_all(run, outcome)
        except StoreUnavailable:
            self.backend.defer(f"release of run {run}'s leases",
                               lambda: self._release_all(run, outcome, late=True))
            raise

    def _release_all(self, run: str, outcome: str, late: bool = False) -> list[ProfileKey]:
        """`late`: a deferred release (after a database outage), audited as `released_late`."""
        me = self.backend.guard_id
        with self.backend.conn() as conn:
            rows = conn.execute(
                "UPDATE sfguard_leases SET holder_run = NULL, holder_guard = NULL, holder_since = "
                "NULL WHERE holder_run = %s AND holder_guard = %s RETURNING scope, name",
                (run, me)).fetchall()
            held = {ProfileKey(s, n) for s, n in rows}
            rows += conn.execute("DELETE FROM sfguard_queue WHERE run = %s AND guard_id = %s "
                                 "RETURNING scope, name", (run, me)).fetchall()
            for key in sorted(held):
                self._audit(conn, "profile_released", key, run=run,
                            outcome="released_late" if late else outcome)
        keys = sorted({ProfileKey(s, n) for s, n in rows})
        with self.backend.tokens_lock:
            for key in keys:
                if self.backend.tokens.get(key, ("",))[0] == run:
                    del self.backend.tokens[key]
        return keys

    def has_state(self, key: ProfileKey) -> bool:
        with self.backend.conn() as conn:
            return conn.execute("SELECT 1 FROM sfguard_leases WHERE scope = %s AND name = %s",
                                (key.scope, key.name)).fetchone() is not None

    def holder(self, key: ProfileKey) -> LeaseHolder | None:
        if self.backend.read_only:       # as it stands, expired holders left out; writes nothing
            with self.backend.conn() as conn:
                h = conn.execute(
                    "SELECT l.holder_run, l.holder_since, l.holder_guard, g.host, g.pid, g.started "
                    "FROM sfguard_leases l JOIN sfguard_guards g ON g.guard_id = l.holder_guard "
                    "WHERE l.scope = %s AND l.name = %s AND " + GUARD_ALIVE,
                    (key.scope, key.name)).fetchone()
        else:
            with self._locked(key) as (conn, _):
                h = self._holder_row(conn, key)
        if h is None or h[0] is None:
            return None
        return LeaseHolder(key, h[0], float(h[1]), ProcessIdentity(int(h[4]), float(h[5])),
                           host=h[3], guard=h[2])

    def token(self, key: ProfileKey) -> int:
        """The profile's current generation (the fencing token of its latest grant)."""
        with self.backend.conn() as conn:
            row = conn.execute("SELECT generation FROM sfguard_leases WHERE scope = %s AND "
                               "name = %s", (key.scope, key.name)).fetchone()
        return 0 if row is None else int(row[0])

    def queue(self, key: ProfileKey) -> list[QueueEntry]:
        if self.backend.read_only:
            with self.backend.conn() as conn:
                rows = [r for r in self._queue_rows(conn, key, alive=True)]
        else:
            with self._locked(key) as (conn, _):
                rows = self._queue_rows(conn, key)
        return [QueueEntry(r[0], float(r[2]), int(r[3]), ProcessIdentity(int(r[4]), float(r[5])))
                for r in rows]

    def sweep_stale(self) -> list[tuple[ProfileKey, str]]:
        """Release holders whose guard expired and drop their queue entries (all profiles)."""
        with self.backend.conn() as conn:
            candidates = conn.execute(
                "SELECT l.scope, l.name FROM sfguard_leases l WHERE l.holder_run IS NOT NULL AND "
                "NOT EXISTS (SELECT 1 FROM sfguard_guards g WHERE g.guard_id = l.holder_guard AND "
                + GUARD_ALIVE + ") ORDER BY l.scope, l.name").fetchall()
        rows = []
        for scope, name in candidates:       # each re-checked under its row lock
            key = ProfileKey(scope, name)
            with self._locked(key) as (_conn, dropped):
                rows += [(scope, name, run) for run in dropped]
        with self.backend.conn() as conn:
            conn.execute("DELETE FROM sfguard_queue q WHERE NOT EXISTS (SELECT 1 FROM "
                         "sfguard_guards g WHERE g.guard_id = q.guard_id AND " + GUARD_ALIVE + ")")
            conn.execute("DELETE FROM sfguard_guards g WHERE g.expires_at < clock_timestamp() - "
                         "interval '1 day'")
        return [(ProfileKey(s, n), r) for s, n, r in rows]
