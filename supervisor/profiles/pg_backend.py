"""Profiles, leases and the audit chain on PostgreSQL: several guard hosts, one set of logins.

Selected with `sfguard start --store postgresql://...` (or `$SFGUARD_STORE`); see
supervisor/profiles/stores.py for the choice and docs/deployment.md for the operator's side.
The shared store is six modules of this room:

- pg_backend.py (this one): `PgBackend`, the connection pool, this guard's row and heartbeat,
  its fencing tokens and the writes deferred while the database is away; `redact_url`.
- pg_schema.py: the versioned migrations and the schema check of read-only commands.
- pg_keys.py: `PgKeyProvider` (KeyProvider): a master key shared by the operator (key file or
  environment variable) wraps random per-scope keys kept in the database, so every host uses
  the same keys and deleting a scope's wrapped key makes its profiles unreadable.
- pg_store.py: `PgProfileStore` (ProfileStore): sealed blobs in chunk rows; sealing stays on
  the guard host, the database only ever sees sealed bytes.
- pg_lease.py: `PgProfileLease` (ProfileLease): one holder per profile across hosts, a FIFO
  queue, a TTL per guard and a fencing token per grant.
- pg_audit.py: `PgAuditSink` (AuditSink): the keyed hash chain of supervisor/profiles/audit.py,
  one row per record.

Times that decide expiry are the database's clock (`clock_timestamp()`), never a host's.
Connection strings can hold a password: they are never logged or shown (see `redact_url`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.profiles.lease import current_process
from sfguard.supervisor.profiles.pg_schema import check_schema, migrate
from sfguard.supervisor.protocols import ProfileError, ProfileKey, StoreUnavailable

if TYPE_CHECKING:
    from sfguard.supervisor.profiles.pg_audit import PgAuditSink

log = logging.getLogger("sfguard.pg_store")     # one logger for the whole shared store

DEFAULT_TTL = 30.0              # seconds a guard's leases outlive its last heartbeat
POOL_WAIT = 3.0                 # seconds to wait for a database connection before giving up
FAIL_FAST = 2.0                 # seconds after a failed connection during which calls fail at once
#: seconds one chain of reconnection attempts lasts (the pool backs off 1, 2, 4 s... within
#: it); the next call starts a new chain, so a server that is back is found within seconds
#: however long it was away (the pool's default, 5 minutes of doubling waits, could let a
#: guard come back after its TTL and lose its leases)
RECONNECT_WINDOW = 5.0
OUTAGE_RETRY = 1.0              # seconds between heartbeats while the database is away
ENV_TTL = "SFGUARD_LEASE_TTL"

__all__ = ["GUARD_ALIVE", "PgBackend", "StaleLease", "StoreRefused", "redact_url"]


class StoreRefused(ProfileError):
    """The database refused a statement (a constraint, a trigger, a permission): the whole
    transaction was rolled back, so the state change and its audit record are both absent.
    Only the SQLSTATE is shown (a server message may quote data)."""


class StaleLease(ProfileError):
    """A reseal or state write with a fencing token that is no longer current: refused."""


def redact_url(url: str) -> str:
    """The connection string without its password (for logs, status and doctor)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
    except ValueError:
        return "postgresql://(unparsable)"


# A guard is alive while its last heartbeat is younger than its TTL, and during its TTL after
# the database server (re)started: an outage of the database is nobody's missed heartbeat, so
# after it every guard gets a TTL to beat again (and store what waited) before it loses a lease.
GUARD_ALIVE = ("(g.expires_at >= clock_timestamp() OR "
                "pg_postmaster_start_time() + make_interval(secs => g.ttl) >= clock_timestamp())")


class PgBackend:
    """The connection pool, this guard's identity and heartbeat, and its fencing tokens.

    One per guard process. `guard_id` is random per process; `host` is the host name. The
    heartbeat thread pushes this guard's `expires_at` forward every `ttl/4` seconds; a guard
    that stops (killed, paused, partitioned) loses its leases `ttl` seconds later.
    """

    def __init__(self, url: str, *, ttl: float | None = None, host: str | None = None,
                 heartbeat: bool = True, pool_size: int = 4, connect_wait: float = 15.0,
                 read_only: bool = False):
        import psycopg_pool  # noqa: PLC0415 - only guards on a shared store need it
        if ttl is None:
            ttl = _env_ttl()
        if not ttl > 0:
            raise ValueError("the lease TTL must be a positive number of seconds")
        self.url_shown = redact_url(url)
        #: the connection string as given (a password too): only for this guard's run proxies,
        #: over their stdin (supervisor/daemon/run_proxy.py PaceSetting); never logged or shown
        self.url = url
        #: read-only commands (`profiles list|show`, `audit verify|show`, `doctor`): no
        #: migration, no guard row, and every session is read-only on the server itself
        self.read_only = read_only
        self.pool_size = pool_size
        self.ttl = float(ttl)
        self.host = host or socket.gethostname()
        self.guard_id = f"g-{secrets.token_hex(6)}"
        me = current_process()
        self.pid, self.started = me.pid, me.start_time
        #: key -> (run, fencing token) for the profiles this guard holds
        self.tokens: dict[ProfileKey, tuple[str, int]] = {}
        self.tokens_lock = threading.Lock()
        #: the audit sink that records the releases `close` makes (set by supervisor/profiles/stores.py)
        self.audit: PgAuditSink | None = None
        #: writes that found the database away, retried in order by the heartbeat
        self.pending: list[tuple[str, Callable[[], object]]] = []
        self.pending_lock = threading.Lock()
        self.pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=pool_size, open=False, timeout=POOL_WAIT,
            reconnect_timeout=RECONNECT_WINDOW,
            check=psycopg_pool.ConnectionPool.check_connection,   # survives a server restart
            kwargs=_connect_args(read_only), name="sfguard")
        self._down_until = 0.0        # after a failure, fail fast for a moment (no pile-up)
        #: a call found the database away; with a heartbeat, calls then fail at once until the
        #: heartbeat (which probes every OUTAGE_RETRY seconds) gets through again
        self.down = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        import psycopg  # noqa: PLC0415 - the pool's errors (PoolTimeout...) are psycopg.OperationalError
        try:
            self.pool.open(wait=True, timeout=connect_wait)
        except psycopg.Error as exc:
            with swallowed(log, "closing the pool that could not connect"):
                self.pool.close(timeout=1)
            raise StoreUnavailable(f"cannot reach the database {self.url_shown}: "
                                   f"{type(exc).__name__}") from None
        self.schema_version = 0
        started = False
        try:
            with self.conn() as conn:
                self.schema_version = (check_schema(conn, self.url_shown) if read_only
                                       else migrate(conn))
            if not read_only:
                self.beat()
            started = True
        finally:
            if not started:
                with swallowed(log, "closing the pool after a failed start"):
                    self.pool.close(timeout=1)
        if heartbeat and not read_only:
            self._thread = threading.Thread(target=self._beat_loop, name="sfguard-heartbeat",
                                            daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def conn(self, probe: bool = False) -> Iterator[Any]:
        """A pooled connection in a transaction (commit on success, rollback on error).
        `probe`: the heartbeat's call, which tries the database even while it is known away."""
        import psycopg  # noqa: PLC0415
        if not probe and (time.monotonic() < self._down_until or
                          (self.down and self._thread is not None)):
            raise StoreUnavailable(f"the database {self.url_shown} is unreachable (the guard "
                                   f"tries it again every {OUTAGE_RETRY:.0f} s)")
        try:
            with self.pool.connection() as conn:
                yield conn
            self.down, self._down_until = False, 0.0      # it answers: no more failing fast
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            self.down = True
            self._down_until = time.monotonic() + FAIL_FAST
            raise StoreUnavailable(f"the database {self.url_shown} is unreachable "
                                   f"({type(exc).__name__})") from None
        except psycopg.DatabaseError as exc:
            raise StoreRefused(f"the database {self.url_shown} refused the change "
                               f"(SQLSTATE {exc.sqlstate or 'unknown'}, {type(exc).__name__}); "
                               "nothing of it was written") from None

    def beat(self, conn=None) -> None:
        """Register or refresh this guard's row (its leases live until expires_at)."""
        sql = ("INSERT INTO sfguard_guards (guard_id, host, pid, started, ttl, expires_at) "
               "VALUES (%s, %s, %s, %s, %s, clock_timestamp() + make_interval(secs => %s)) "
               "ON CONFLICT (guard_id) DO UPDATE SET expires_at = EXCLUDED.expires_at")
        args = (self.guard_id, self.host, self.pid, self.started, self.ttl, self.ttl)
        if conn is not None:
            conn.execute(sql, args)
            return
        with self.conn(probe=True) as c:
            c.execute(sql, args)

    def _beat_loop(self) -> None:
        """Beat every TTL/4; while the database is away (a call or a beat failed), every
        OUTAGE_RETRY seconds, so what waited for it goes in as soon as it is back."""
        interval = max(0.05, self.ttl / 4)
        last, failing = time.monotonic(), False
        while not self._stop.wait(min(interval, OUTAGE_RETRY)):
            if not self.down and not failing and time.monotonic() - last < interval:
                continue
            try:
                self.beat()
            except ProfileError as exc:  # StoreUnavailable, StoreRefused: leases lapse after the TTL
                if not failing:
                    log.warning("heartbeat to the shared store failed (%s); leases of this "
                                "guard expire %.0f s after the last good one; trying again "
                                "every %.0f s", type(exc).__name__, self.ttl, OUTAGE_RETRY)
                failing = True
                continue
            if failing:
                log.info("the shared store answers again")
            last, failing = time.monotonic(), False
            if self.retry_pending():
                failing = True            # some still wait: try them again in OUTAGE_RETRY

    def defer(self, what: str, action: Callable[[], object]) -> None:
        """Keep a write that found the database away; `retry_pending` runs it when it is back."""
        with self.pending_lock:
            self.pending.append((what, action))
        log.warning("the shared store is unreachable: %s is kept on this host and done when "
                    "the database is back", what)

    def retry_pending(self) -> int:
        """Run the deferred writes in order; stop at the first that still cannot reach the
        database. A write refused for good (stale fencing token) is dropped (and logged by
        it). Returns how many are left."""
        while True:
            with self.pending_lock:
                if not self.pending:
                    return 0
                what, action = self.pending[0]
            try:
                action()
            except StoreUnavailable:
                with self.pending_lock:
                    return len(self.pending)
            except (ProfileError, OSError) as exc:   # StaleLease, StoreRefused, ...; its sealed file
                log.error("deferred %s was refused (%s)", what, exc)
            else:
                log.info("deferred %s is done", what)
            with self.pending_lock:
                self.pending.pop(0)

    def token(self, key: ProfileKey) -> tuple[str, int] | None:
        with self.tokens_lock:
            return self.tokens.get(key)

    def close(self) -> None:
        """Stop the heartbeat and end this guard's row (its leases are released now)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.read_only:
            with swallowed(log, "closing the pool"):
                self.pool.close(timeout=5)
            return
        with swallowed(log, "writing the deferred writes at stop"):
            self._down_until, self.down = 0.0, False     # one more real try
            left = self.retry_pending()          # what waited for the database goes in first
            if left:
                log.error("the shared store is still unreachable: %d deferred write(s) are "
                          "lost with this guard (the profiles keep their last stored state)", left)
        with swallowed(log, "releasing this guard's leases and queue places at stop"):
            with self.conn() as c:
                held = c.execute("SELECT scope, name, holder_run FROM sfguard_leases WHERE "
                                 "holder_guard = %s ORDER BY scope, name FOR UPDATE",
                                 (self.guard_id,)).fetchall()
                c.execute("UPDATE sfguard_leases SET holder_run = NULL, holder_guard = NULL, "
                          "holder_since = NULL WHERE holder_guard = %s", (self.guard_id,))
                if self.audit is not None:     # leftovers of a stopping guard, audited with it
                    for scope, name, run in held:
                        self.audit.append_event(c, "profile_released", scope=scope,
                                                profile=name, run=run, outcome="abandoned")
                c.execute("DELETE FROM sfguard_queue WHERE guard_id = %s", (self.guard_id,))
                c.execute("DELETE FROM sfguard_guards WHERE guard_id = %s", (self.guard_id,))
        with swallowed(log, "closing the pool"):
            self.pool.close(timeout=5)


def _connect_args(read_only: bool) -> dict:
    """libpq options: bounded connects; on TCP, keepalives and a user timeout so a cut-off
    server fails a call instead of hanging it; read-only sessions for read-only commands."""
    args = {"connect_timeout": 3, "application_name": "sfguard", "keepalives": 1,
            "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
            "tcp_user_timeout": 30000}
    if read_only:
        args["options"] = "-c default_transaction_read_only=on"
    return args


def _env_ttl() -> float:
    raw = os.environ.get(ENV_TTL)
    if not raw:
        return DEFAULT_TTL
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${ENV_TTL} must be a number of seconds, not {raw[:20]!r}") from None
    if not 0 < value <= 3600:
        raise ValueError(f"${ENV_TTL} must be between 0 and 3600 seconds")
    return value
