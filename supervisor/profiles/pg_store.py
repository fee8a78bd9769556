"""Profiles, leases and the audit chain on PostgreSQL: several guard hosts, one set of logins.

Selected with `sfguard start --store postgresql://...` (or `$SFGUARD_STORE`); see
supervisor/profiles/stores.py for the choice and docs/deployment.md for the operator's side.

- `PgProfileStore` (ProfileStore): sealed blobs in `sfguard_blob_chunks`, one row per chunk of
  at most `BLOB_CHUNK` bytes. Sealing stays on the guard host (supervisor/profiles/sealing.py, the same
  format as the local store); the database only ever sees sealed bytes. A seal is written to
  a private temp file, then streamed chunk by chunk into the database; a fetch streams the
  chunks into a private temp file that is unsealed as the local store does. Working copies stay
  local (`<runtime>/profiles/<scope>/<name>/`, 0700).
- `PgProfileLease` (ProfileLease): one row per profile (holder + `generation`), a FIFO queue
  table, and a `sfguard_guards` row per guard process whose `expires_at` its heartbeat pushes
  forward. A holder or queue entry whose guard stopped beating for longer than the TTL is
  dropped by the next caller. Every grant increments the profile's generation: the grant's
  fencing token. Every reseal and state write checks, in the transaction that writes it, that
  this guard still holds the profile with that token; otherwise it is refused and logged, and
  the newer state stays.
- `PgAuditSink` (AuditSink): the keyed hash chain of supervisor/profiles/audit.py, one row per record,
  the head in a row of its own, both written in one transaction under the head's row lock.
- `PgKeyProvider` (KeyProvider): a master key shared by the operator (key file or environment
  variable) wraps random per-scope keys kept in the database, so every host uses the same keys
  and deleting a scope's wrapped key makes its profiles unreadable.

Times that decide expiry are the database's clock (`clock_timestamp()`), never a host's.
Connection strings can hold a password: they are never logged or shown (see `redact_url`).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sfguard.supervisor.home import private_dir, runtime_path
from sfguard.supervisor.profiles import audit as audit_mod
from sfguard.supervisor.profiles import sealing
from sfguard.supervisor.profiles.keys import KEY_BYTES, KeyMissing
from sfguard.supervisor.profiles.lease import current_process
from sfguard.supervisor.protocols import (
    Granted,
    LeaseHolder,
    ProcessIdentity,
    ProfileBusy,
    ProfileError,
    ProfileExists,
    ProfileInfo,
    ProfileKey,
    ProfileNotFound,
    QueueEntry,
    StoreUnavailable,
    Waiting,
    validate_name,
    validate_run_id,
)

log = logging.getLogger("sfguard.pg_store")

BLOB_CHUNK = 1 << 20            # bytes of sealed data per database row
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
ENV_KEY = "SFGUARD_KEY"
ENV_KEY_FILE = "SFGUARD_KEY_FILE"

__all__ = ["StoreUnavailable", "SchemaTooNew", "SchemaTooOld", "NoSchema", "StoreRefused",
           "StaleLease", "PgBackend", "PgKeyProvider",
           "PgProfileStore", "PgProfileLease", "PgAuditSink", "redact_url", "load_master_key",
           "MIGRATIONS"]


class SchemaTooNew(ProfileError):
    """The database schema is newer than this sfguard knows: refuse to start."""


class SchemaTooOld(ProfileError):
    """A read-only command on a database an older sfguard migrated: `sfguard start` of this
    version migrates it; read-only commands never do."""


class NoSchema(ProfileError):
    """A read-only command on a database no guard has started on yet (no sfguard tables)."""


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


# --------------------------------------------------------------------------- schema

#: Versioned migrations, applied in order at start inside one transaction under an advisory
#: lock (so two guards starting at once apply them once). Never edit a released step: add one.
MIGRATIONS: list[str] = [
    # 1: profiles, blobs, guards, leases, queue, audit, scope keys
    """
    CREATE TABLE sfguard_meta (
        id int PRIMARY KEY CHECK (id = 1),
        key_check text NOT NULL
    );
    CREATE TABLE sfguard_scope_keys (
        scope text PRIMARY KEY,
        wrapped bytea NOT NULL
    );
    CREATE SEQUENCE sfguard_blob_ids;
    CREATE TABLE sfguard_profiles (
        scope text NOT NULL,
        name text NOT NULL,
        identity text,
        created double precision NOT NULL,
        updated double precision NOT NULL,
        last_used double precision,
        last_login_check double precision,
        last_login_ok boolean,
        size bigint NOT NULL,
        blob_id bigint NOT NULL,
        written_generation bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (scope, name)
    );
    CREATE TABLE sfguard_blob_chunks (
        blob_id bigint NOT NULL,
        idx int NOT NULL,
        data bytea NOT NULL,
        PRIMARY KEY (blob_id, idx)
    );
    CREATE TABLE sfguard_guards (
        guard_id text PRIMARY KEY,
        host text NOT NULL,
        pid int NOT NULL,
        started double precision NOT NULL,
        ttl double precision NOT NULL,
        expires_at timestamptz NOT NULL
    );
    CREATE TABLE sfguard_leases (
        scope text NOT NULL,
        name text NOT NULL,
        holder_run text,
        holder_guard text,
        holder_since double precision,
        generation bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (scope, name)
    );
    CREATE TABLE sfguard_queue (
        scope text NOT NULL,
        name text NOT NULL,
        run text NOT NULL,
        guard_id text NOT NULL,
        since double precision NOT NULL,
        seq bigserial,
        PRIMARY KEY (scope, name, run, guard_id)
    );
    CREATE INDEX sfguard_queue_order ON sfguard_queue (scope, name, seq);
    CREATE TABLE sfguard_audit (
        seq bigint PRIMARY KEY,
        body text NOT NULL
    );
    CREATE TABLE sfguard_audit_head (
        id int PRIMARY KEY CHECK (id = 1),
        seq bigint NOT NULL,
        hash text NOT NULL,
        mac text
    );
    INSERT INTO sfguard_audit_head (id, seq, hash, mac) VALUES (1, 0, '%s', NULL);
    """ % audit_mod.GENESIS,
]

_MIGRATION_LOCK = 0x5F6775617264    # advisory lock id for schema changes ("_guard")


def migrate(conn, migrations: list[str] = MIGRATIONS) -> int:
    """Apply the missing migrations; returns the schema version. SchemaTooNew when the
    database was migrated by a newer sfguard (nothing is changed then)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS sfguard_schema_version ("
                     "version int PRIMARY KEY, applied double precision NOT NULL)")
        row = conn.execute("SELECT coalesce(max(version), 0) FROM sfguard_schema_version").fetchone()
        current = int(row[0])
        if current > len(migrations):
            raise SchemaTooNew(
                f"the database schema is version {current}, newer than this sfguard knows "
                f"(up to {len(migrations)}): upgrade sfguard on this host; nothing was changed")
        for version in range(current + 1, len(migrations) + 1):
            conn.execute(migrations[version - 1])
            conn.execute("INSERT INTO sfguard_schema_version (version, applied) VALUES (%s, %s)",
                         (version, time.time()))
            log.info("database schema migrated to version %d", version)
        return len(migrations)


def check_schema(conn, url_shown: str, migrations: list[str] = MIGRATIONS) -> int:
    """The schema version for a read-only command, changing nothing: NoSchema on a database
    without sfguard tables, SchemaTooNew / SchemaTooOld when it is not this sfguard's."""
    if conn.execute("SELECT to_regclass('sfguard_schema_version')").fetchone()[0] is None:
        raise NoSchema(f"the database {url_shown} has no sfguard schema: start a guard with "
                       "--store on it first (`sfguard start` creates the tables)")
    current = int(conn.execute("SELECT coalesce(max(version), 0) FROM "
                               "sfguard_schema_version").fetchone()[0])
    if current > len(migrations):
        raise SchemaTooNew(
            f"the database schema is version {current}, newer than this sfguard knows "
            f"(up to {len(migrations)}): upgrade sfguard on this host; nothing was changed")
    if current < len(migrations):
        raise SchemaTooOld(
            f"the database schema is version {current}, older than this sfguard "
            f"({len(migrations)}): start a guard of this version (`sfguard start --store ...`) "
            "to migrate it; read-only commands change nothing")
    return current


# --------------------------------------------------------------------------- backend

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
        self.pending: list[tuple[str, Callable[[], None]]] = []
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
        try:
            self.pool.open(wait=True, timeout=connect_wait)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.pool.close(timeout=1)
            raise StoreUnavailable(f"cannot reach the database {self.url_shown}: "
                                   f"{type(exc).__name__}") from None
        self.schema_version = 0
        try:
            with self.conn() as conn:
                self.schema_version = (check_schema(conn, self.url_shown) if read_only
                                       else migrate(conn))
            if not read_only:
                self.beat()
        except BaseException:
            with contextlib.suppress(Exception):
                self.pool.close(timeout=1)
            raise
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
        except Exception as exc:
            if type(exc).__module__.startswith(("psycopg_pool",)):
                self.down = True
                self._down_until = time.monotonic() + FAIL_FAST
                raise StoreUnavailable(f"no database connection to {self.url_shown} "
                                       f"({type(exc).__name__})") from None
            raise

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
            except Exception as exc:  # the database is away: leases lapse after the TTL
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

    def defer(self, what: str, action: Callable[[], None]) -> None:
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
            except Exception as exc:
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
            with contextlib.suppress(Exception):
                self.pool.close(timeout=5)
            return
        with contextlib.suppress(Exception):
            self._down_until, self.down = 0.0, False     # one more real try
            left = self.retry_pending()          # what waited for the database goes in first
            if left:
                log.error("the shared store is still unreachable: %d deferred write(s) are "
                          "lost with this guard (the profiles keep their last stored state)", left)
        with contextlib.suppress(Exception):
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
        with contextlib.suppress(Exception):
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


# --------------------------------------------------------------------------- keys

def load_master_key(environ: dict | None = None) -> tuple[bytes, str]:
    """The operator's shared master key and where it came from.

    `$SFGUARD_KEY_FILE` names a 0600 file holding base64 of 32 random bytes (made with
    `head -c 32 /dev/urandom | base64`); `$SFGUARD_KEY` holds the same text directly. The
    same key must be given to every guard host that shares the database. KeyMissing when
    neither is set, or the key is not private or not 32 bytes (the key is never shown)."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_KEY_FILE)
    if path:
        p = Path(path)
        try:
            st = os.stat(p)
        except OSError:
            raise KeyMissing(f"${ENV_KEY_FILE} names {p}, which cannot be read") from None
        if st.st_mode & 0o077:
            raise KeyMissing(f"the shared key file {p} is readable by others: chmod 600 it")
        return _decode(p.read_bytes().strip(), f"the shared key file {p}"), f"shared key file {p}"
    raw = env.get(ENV_KEY)
    if raw:
        return _decode(raw.strip().encode(), f"${ENV_KEY}"), f"shared key from ${ENV_KEY}"
    raise KeyMissing(f"a shared store needs the key every guard host shares: set ${ENV_KEY_FILE} "
                     f"to a 0600 file with base64 of 32 random bytes (or ${ENV_KEY} to that text)")


def _decode(raw: bytes, what: str) -> bytes:
    try:
        key = base64.b64decode(raw, validate=True)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyMissing(f"{what} is not base64 of 32 bytes")
    return key


def _derive(master: bytes, purpose: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=f"sfguard shared {purpose} v1".encode()).derive(master)


class PgKeyProvider:
    """KeyProvider for the shared store: per-scope random keys, wrapped (AES-GCM) under a key
    derived from the operator's master key and kept in `sfguard_scope_keys`; the audit HMAC key
    is derived from the master key. The first guard that starts records a check value of the
    master key; a guard with another key refuses to start."""

    def __init__(self, backend: PgBackend, master: bytes, source: str):
        self.backend = backend
        self.source = source
        self._cache: dict[str, bytes] = {}
        self._cache_lock = threading.Lock()
        self._wrap = AESGCM(_derive(master, "scope-key wrapping"))
        self._audit = _derive(master, "audit chain")
        check = hmac.new(_derive(master, "check"), b"sfguard key check", hashlib.sha256).hexdigest()
        with backend.conn() as conn:
            if not backend.read_only:
                conn.execute("INSERT INTO sfguard_meta (id, key_check) VALUES (1, %s) "
                             "ON CONFLICT (id) DO NOTHING", (check,))
            row = conn.execute("SELECT key_check FROM sfguard_meta WHERE id = 1").fetchone()
        stored = check if row is None else row[0]     # read-only, before any guard started
        if not hmac.compare_digest(stored, check):
            raise KeyMissing(f"the {source} is not the key this database was set up with: every "
                             "guard host sharing the database must use the same key")

    def get_key(self, scope: str, *, create: bool = True) -> bytes:
        validate_name(scope, "scope")
        try:
            key = self._fetch_key(scope, create)
        except StoreUnavailable:
            # the database is away: seal with the key last read from it (so a run that ends
            # now can still seal its profile on this host); never a key made up here
            with self._cache_lock:
                if scope in self._cache:
                    return self._cache[scope]
            raise
        with self._cache_lock:
            self._cache[scope] = key
        return key

    def _fetch_key(self, scope: str, create: bool) -> bytes:
        with self.backend.conn() as conn:
            if create and not self.backend.read_only:
                nonce = secrets.token_bytes(12)
                fresh = nonce + self._wrap.encrypt(nonce, secrets.token_bytes(KEY_BYTES),
                                                   scope.encode())
                conn.execute("INSERT INTO sfguard_scope_keys (scope, wrapped) VALUES (%s, %s) "
                             "ON CONFLICT (scope) DO NOTHING", (scope, fresh))
            row = conn.execute("SELECT wrapped FROM sfguard_scope_keys WHERE scope = %s",
                               (scope,)).fetchone()
        if row is None:
            raise KeyMissing(f"no key for scope {scope!r} ({self.describe()})")
        wrapped = bytes(row[0])
        try:
            return self._wrap.decrypt(wrapped[:12], wrapped[12:], scope.encode())
        except (InvalidTag, ValueError):
            raise KeyMissing(f"the key of scope {scope!r} in the database is damaged") from None

    def delete_key(self, scope: str) -> bool:
        with self._cache_lock:
            self._cache.pop(scope, None)
        with self.backend.conn() as conn:
            cur = conn.execute("DELETE FROM sfguard_scope_keys WHERE scope = %s",
                               (validate_name(scope, "scope"),))
            return cur.rowcount > 0

    def get_audit_key(self, *, create: bool = True) -> bytes | None:
        return self._audit

    def describe(self) -> str:
        return f"{self.source} (scope keys wrapped in the shared database)"


# --------------------------------------------------------------------------- profiles

class PgProfileStore:
    """ProfileStore on PostgreSQL; sealed client-side, working copies under the local runtime.

    With an audit sink (`audits_changes`), a create (`profile_created`), a reseal
    (`profile_resealed`) and a delete (`profile_deleted`) write their audit record in the
    transaction of the change: both commit, or neither does. `note` adds the caller's fields
    (the run, `by`)."""

    def __init__(self, backend: PgBackend, keys, home: Path, runtime: Path | None = None,
                 audit: PgAuditSink | None = None):
        self.backend = backend
        self.keys = keys
        self.home = Path(home)
        self._runtime = Path(runtime) if runtime is not None else None
        self.audit = audit
        self.audits_changes = audit is not None

    def _audit(self, conn, event: str, key: ProfileKey, note: dict | None = None) -> None:
        if self.audit is not None:
            self.audit.append_event(conn, event, scope=key.scope, profile=key.name,
                                    **(note or {}))

    # ----------------------------------------------------------------- local paths
    def _runtime_path(self) -> Path:
        """The runtime folder's path; creates nothing (reads must leave no folder behind)."""
        return self._runtime if self._runtime is not None else runtime_path(self.home)

    def _runtime_root(self) -> Path:
        """The runtime folder, created (0700) for a write that needs it."""
        return private_dir(self._runtime_path())

    def _unsealed_dir(self, key: ProfileKey) -> Path:
        return self._runtime_path() / "profiles" / key.scope / key.name

    def _scratch(self, prefix: str, *, folder: bool = False) -> Path:
        """A new private temp file (or folder) in the runtime folder's `store-tmp`.

        `_discard` removes `store-tmp` once empty, so another thread or process may remove it
        between our creating it and using it: then it is created again (bounded)."""
        for _ in range(5):
            scratch = private_dir(self._runtime_root() / "store-tmp")
            try:
                if folder:
                    return Path(tempfile.mkdtemp(dir=scratch, prefix=prefix))
                fd, tmp = tempfile.mkstemp(dir=scratch, prefix=prefix, suffix=".tmp")
                os.close(fd)
                return Path(tmp)
            except FileNotFoundError:
                continue
        raise StoreUnavailable("could not make a private temp file in the runtime folder")

    def _discard(self, path: Path) -> None:
        """Remove a scratch file or folder, then `store-tmp` when empty and, for a store used
        without a guard (which owns and removes its runtime folder), the runtime folder when
        empty: a CLI command leaves nothing in /dev/shm. A non-empty folder (another
        operation's file, a deferred seal, a guard's sockets) makes rmdir fail: it is kept."""
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.rmdir(path.parent)
            if self._runtime is None:
                os.rmdir(self._runtime_path())

    # ----------------------------------------------------------------- blobs
    def _seal_to_file(self, key: ProfileKey, src: Path) -> Path:
        tmp = self._scratch(".seal-")
        try:
            sealing.seal_dir(src, tmp, self.keys.get_key(key.scope), key.scope, key.name)
        except BaseException:
            self._discard(tmp)
            raise
        return tmp

    @staticmethod
    def _insert_blob(conn, path: Path) -> tuple[int, int]:
        """Stream the file into new chunk rows; (blob_id, size). One chunk in memory at a time."""
        blob_id = conn.execute("SELECT nextval('sfguard_blob_ids')").fetchone()[0]
        size, idx = 0, 0
        with open(path, "rb") as fh:
            while True:
                data = fh.read(BLOB_CHUNK)
                if not data and idx:
                    break
                conn.execute("INSERT INTO sfguard_blob_chunks (blob_id, idx, data) "
                             "VALUES (%s, %s, %s)", (blob_id, idx, data))
                size += len(data)
                idx += 1
                if not data:
                    break
        return int(blob_id), size

    def _fetch_to_file(self, key: ProfileKey) -> Path:
        """Stream the current sealed blob into a private temp file (chunk by chunk)."""
        tmp = self._scratch(".fetch-")
        try:
            with open(tmp, "wb") as out, self.backend.conn() as conn:
                row = conn.execute("SELECT blob_id FROM sfguard_profiles WHERE scope = %s AND "
                                   "name = %s", (key.scope, key.name)).fetchone()
                if row is None:
                    raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
                # a server-side cursor, one chunk row per fetch: never the whole blob in memory
                with conn.cursor(name=f"fetch_{secrets.token_hex(4)}") as cur:
                    cur.itersize = 1
                    cur.execute("SELECT data FROM sfguard_blob_chunks WHERE blob_id = %s "
                                "ORDER BY idx", (row[0],))
                    for (data,) in cur:
                        out.write(data)
        except BaseException:
            self._discard(tmp)
            raise
        return tmp

    # ----------------------------------------------------------------- ProfileStore
    def exists(self, key: ProfileKey) -> bool:
        with self.backend.conn() as conn:
            return conn.execute("SELECT 1 FROM sfguard_profiles WHERE scope = %s AND name = %s",
                                (key.scope, key.name)).fetchone() is not None

    def create(self, key: ProfileKey, identity: str | None = None, *,
               note: dict | None = None) -> ProfileInfo:
        """Create an empty sealed profile; ProfileExists if the name is taken in that scope.
        `identity`: the workflow identity it was made for (`pipeline-<hash>`), kept with it."""
        if identity is not None:
            validate_name(identity, "profile identity")
        if self.exists(key):
            raise ProfileExists(f"profile {key.name!r} already exists in scope {key.scope!r}")
        empty = self._scratch(".empty-", folder=True)
        try:
            sealed = self._seal_to_file(key, empty)
        finally:
            self._discard(empty)
        try:
            with self.backend.conn() as conn:
                blob_id, size = self._insert_blob(conn, sealed)
                now = time.time()
                cur = conn.execute(
                    "INSERT INTO sfguard_profiles (scope, name, identity, created, updated, size, "
                    "blob_id) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (key.scope, key.name, identity, now, now, size, blob_id))
                if cur.rowcount == 0:
                    raise ProfileExists(f"profile {key.name!r} already exists in scope {key.scope!r}")
                self._audit(conn, "profile_created", key, note)
        finally:
            self._discard(sealed)
        return self.info(key)

    def _info_from(self, key: ProfileKey, row) -> ProfileInfo:
        return ProfileInfo(key=key, created=float(row[0]), last_used=row[1], size=int(row[2]),
                           unsealed=os.path.isdir(self._unsealed_dir(key)), identity=row[3])

    def info(self, key: ProfileKey) -> ProfileInfo:
        with self.backend.conn() as conn:
            row = conn.execute("SELECT created, last_used, size, identity FROM sfguard_profiles "
                               "WHERE scope = %s AND name = %s", (key.scope, key.name)).fetchone()
        if row is None:
            raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
        return self._info_from(key, row)

    def details(self, key: ProfileKey) -> dict:
        """Everything the database keeps about a profile (no secrets)."""
        with self.backend.conn() as conn:
            row = conn.execute(
                "SELECT identity, created, updated, last_used, last_login_check, last_login_ok, "
                "size, written_generation FROM sfguard_profiles WHERE scope = %s AND name = %s",
                (key.scope, key.name)).fetchone()
        if row is None:
            raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
        names = ("identity", "created", "updated", "last_used", "last_login_check",
                 "last_login_ok", "size", "generation")
        return dict(zip(names, row))

    def list(self, scope: str) -> list[ProfileInfo]:
        validate_name(scope, "scope")
        with self.backend.conn() as conn:
            rows = conn.execute("SELECT name, created, last_used, size, identity FROM "
                                "sfguard_profiles WHERE scope = %s ORDER BY name",
                                (scope,)).fetchall()
        return [self._info_from(ProfileKey(scope, r[0]), r[1:]) for r in rows]

    def open(self, key: ProfileKey) -> Path:
        """Fetch and unseal into the private runtime folder; ProfileBusy if already open here."""
        dest = self._unsealed_dir(key)
        if os.path.lexists(dest):
            raise ProfileBusy(f"profile {key.name!r} is already open")
        private_dir(self._runtime_root() / "profiles")
        private_dir(dest.parent)
        sealed = self._fetch_to_file(key)
        try:
            sealing.unseal_to(sealed, dest, self.keys.get_key(key.scope, create=False),
                              key.scope, key.name)
        finally:
            self._discard(sealed)
        return dest

    def _check_fence(self, conn, key: ProfileKey, what: str,
                     held: tuple[str, int] | None = None) -> int:
        """Lock the profile's lease row and return the fencing token this guard holds (or
        `held`, captured earlier); raise StaleLease (and log it) when this guard no longer
        holds it with that token."""
        held = held or self.backend.token(key)
        row = conn.execute("SELECT holder_run, holder_guard, generation FROM sfguard_leases "
                           "WHERE scope = %s AND name = %s FOR UPDATE",
                           (key.scope, key.name)).fetchone()
        if held is None or row is None or row[1] != self.backend.guard_id or row[0] != held[0] \
                or int(row[2]) != held[1]:
            current = None if row is None else int(row[2])
            log.warning("late %s of profile %s refused: fencing token %s is not current (%s); "
                        "the newer state in the store is kept", what, key,
                        None if held is None else held[1], current)
            raise StaleLease(f"{what} of profile {key.name!r} refused: this guard's lease "
                             "(fencing token) is no longer current; the newer state is kept")
        return held[1]

    def save(self, key: ProfileKey) -> ProfileInfo:
        """Reseal the open working copy into the store (fenced) and keep it open."""
        src = self._unsealed_dir(key)
        if not src.is_dir():
            raise ProfileNotFound(f"profile {key.name!r} is not open")
        held = self.backend.token(key)
        sealed = self._seal_to_file(key, src)
        try:
            self._store_sealed(key, sealed, held)
        except StoreUnavailable:
            # Nothing is lost: the seal waits on this host (private runtime folder) and is
            # stored, still fenced by the token it was made under, when the database is back.
            self.backend.defer(f"reseal of profile {key}",
                               lambda: self._store_sealed(key, sealed, held, final=True))
            raise StoreUnavailable(f"the database is unreachable: profile {key.name!r} is sealed "
                                   "on this host and stored when the database is back (if this "
                                   "guard's lease is still current then)") from None
        self._discard(sealed)
        return self.info(key)

    def _store_sealed(self, key: ProfileKey, sealed: Path, held: tuple[str, int] | None,
                      final: bool = False) -> None:
        """Stream a sealed file in as the profile's new blob, fenced by `held`. `final`: a
        deferred retry, whose file is removed once stored or refused."""
        try:
            with self.backend.conn() as conn:
                blob_id, size = self._insert_blob(conn, sealed)
                token = self._check_fence(conn, key, "reseal", held)
                old = conn.execute("SELECT blob_id FROM sfguard_profiles WHERE scope = %s AND "
                                   "name = %s FOR UPDATE", (key.scope, key.name)).fetchone()
                if old is None:
                    raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
                now = time.time()
                conn.execute("UPDATE sfguard_profiles SET blob_id = %s, size = %s, updated = %s, "
                             "last_used = %s, written_generation = %s WHERE scope = %s AND "
                             "name = %s", (blob_id, size, now, now, token, key.scope, key.name))
                conn.execute("DELETE FROM sfguard_blob_chunks WHERE blob_id = %s", (old[0],))
                self._audit(conn, "profile_resealed", key,
                            {"run": held[0], "outcome": "late" if final else "stored"})
        except StoreUnavailable:
            raise                                   # kept for the next retry
        except BaseException:
            self._discard(sealed)
            raise
        if final:
            self._discard(sealed)

    def record_login_check(self, key: ProfileKey, logged_in: bool) -> None:
        """A state write: the last login check's time and result, fenced like a reseal."""
        with self.backend.conn() as conn:
            token = self._check_fence(conn, key, "state write")
            conn.execute("UPDATE sfguard_profiles SET last_login_check = %s, last_login_ok = %s, "
                         "written_generation = %s WHERE scope = %s AND name = %s",
                         (time.time(), logged_in, token, key.scope, key.name))

    def close(self, key: ProfileKey, *, save: bool = True) -> ProfileInfo:
        """End of lease: reseal (unless `save=False`) and remove the working copy. A refused
        (stale) reseal still removes the working copy and then raises StaleLease."""
        src = self._unsealed_dir(key)
        try:
            if save and src.is_dir():
                self.save(key)
        finally:
            shutil.rmtree(src, ignore_errors=True)
        return self.info(key)

    def delete(self, key: ProfileKey, *, note: dict | None = None) -> None:
        """Delete the profile. ProfileBusy while it is open here or leased on any host."""
        if os.path.lexists(self._unsealed_dir(key)):
            raise ProfileBusy(f"profile {key.name!r} is open (leased): close it first")
        with self.backend.conn() as conn:
            lease = conn.execute("SELECT holder_run, holder_guard FROM sfguard_leases WHERE "
                                 "scope = %s AND name = %s FOR UPDATE",
                                 (key.scope, key.name)).fetchone()
            if lease is not None and lease[0] is not None and lease[1] != self.backend.guard_id \
                    and conn.execute("SELECT 1 FROM sfguard_guards g WHERE g.guard_id = %s AND "
                                     + _ALIVE, (lease[1],)).fetchone() is not None:
                raise ProfileBusy(f"profile {key.name!r} is leased by run {lease[0]!r}")
            row = conn.execute("DELETE FROM sfguard_profiles WHERE scope = %s AND name = %s "
                               "RETURNING blob_id", (key.scope, key.name)).fetchone()
            if row is None:
                raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
            conn.execute("DELETE FROM sfguard_blob_chunks WHERE blob_id = %s", (row[0],))
            self._audit(conn, "profile_deleted", key, note)

    def delete_scope(self, scope: str) -> list[ProfileKey]:
        """Delete every profile of `scope` (rows, chunks, local working copies) and its key."""
        validate_name(scope, "scope")
        with self.backend.conn() as conn:
            rows = conn.execute("DELETE FROM sfguard_profiles WHERE scope = %s "
                                "RETURNING name, blob_id", (scope,)).fetchall()
            for _name, blob_id in rows:
                conn.execute("DELETE FROM sfguard_blob_chunks WHERE blob_id = %s", (blob_id,))
        shutil.rmtree(self._runtime_path() / "profiles" / scope, ignore_errors=True)
        self.keys.delete_key(scope)
        return sorted(ProfileKey(scope, r[0]) for r in rows)

    def verify(self, key: ProfileKey) -> None:
        """Authenticate every chunk of the stored seal without unsealing it."""
        sealed = self._fetch_to_file(key)
        try:
            sealing.verify_sealed(sealed, self.keys.get_key(key.scope, create=False),
                                  key.scope, key.name)
        finally:
            self._discard(sealed)

    def unsealed(self) -> list[ProfileKey]:
        """Profiles with a working copy on this host (after a crash: for the start-up sweep)."""
        root = self._runtime_path() / "profiles"
        out = []
        if root.is_dir():
            for scope in sorted(os.listdir(root)):
                for name in sorted(os.listdir(root / scope)):
                    try:
                        out.append(ProfileKey(scope, name))
                    except ValueError:
                        continue
        return out


# --------------------------------------------------------------------------- leases

# A guard is alive while its last heartbeat is younger than its TTL, and during its TTL after
# the database server (re)started: an outage of the database is nobody's missed heartbeat, so
# after it every guard gets a TTL to beat again (and store what waited) before it loses a lease.
_ALIVE = ("(g.expires_at >= clock_timestamp() OR "
          "pg_postmaster_start_time() + make_interval(secs => g.ttl) >= clock_timestamp())")


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
                "SELECT 1 FROM sfguard_guards g WHERE g.guard_id = %s AND " + _ALIVE,
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
                "(SELECT 1 FROM sfguard_guards g WHERE g.guard_id = q.guard_id AND " + _ALIVE + ")",
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
            "q.name = %s" + (" AND " + _ALIVE if alive else "") + " ORDER BY q.seq",
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
                    "WHERE l.scope = %s AND l.name = %s AND " + _ALIVE,
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
                + _ALIVE + ") ORDER BY l.scope, l.name").fetchall()
        rows = []
        for scope, name in candidates:       # each re-checked under its row lock
            key = ProfileKey(scope, name)
            with self._locked(key) as (_conn, dropped):
                rows += [(scope, name, run) for run in dropped]
        with self.backend.conn() as conn:
            conn.execute("DELETE FROM sfguard_queue q WHERE NOT EXISTS (SELECT 1 FROM "
                         "sfguard_guards g WHERE g.guard_id = q.guard_id AND " + _ALIVE + ")")
            conn.execute("DELETE FROM sfguard_guards g WHERE g.expires_at < clock_timestamp() - "
                         "interval '1 day'")
        return [(ProfileKey(s, n), r) for s, n, r in rows]


# --------------------------------------------------------------------------- audit

class PgAuditSink:
    """AuditSink on PostgreSQL: the keyed chain of supervisor/profiles/audit.py, one row per record;
    the record and the head move together in one transaction under the head's row lock."""

    def __init__(self, backend: PgBackend, keys):
        self.backend = backend
        self.keys = keys

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        clean = audit_mod.clean_fields(event, fields)
        key = self.keys.get_audit_key(create=True)
        with self.backend.conn() as conn:
            return self.append(conn, key, event, clean)

    @staticmethod
    def append(conn, key: bytes, event: str, clean: dict) -> dict[str, Any]:
        """Append inside the caller's transaction (so an event and its record commit together)."""
        seq, prev = conn.execute("SELECT seq, hash FROM sfguard_audit_head WHERE id = 1 "
                                 "FOR UPDATE").fetchone()
        rec = audit_mod.chain_record(key, int(seq), str(prev), event, clean)
        conn.execute("INSERT INTO sfguard_audit (seq, body) VALUES (%s, %s)",
                     (rec["seq"], audit_mod.canonical(rec).decode()))
        conn.execute("UPDATE sfguard_audit_head SET seq = %s, hash = %s, mac = %s WHERE id = 1",
                     (rec["seq"], rec["hash"], audit_mod.head_mac(key, rec["seq"], rec["hash"])))
        return rec

    def append_event(self, conn, event: str, **fields: Any) -> dict[str, Any]:
        """Validate and append a record inside the caller's transaction: the state change it
        records and the record commit together or not at all."""
        clean = audit_mod.clean_fields(event, fields)
        return self.append(conn, self.keys.get_audit_key(create=True), event, clean)

    def _rows(self) -> Iterator[tuple[int, bytes]]:
        with self.backend.conn() as conn:
            yield from self._rows_in(conn)

    def records(self, *, profile: str | None = None, run: str | None = None) -> list[dict[str, Any]]:
        import json  # noqa: PLC0415
        out = []
        for _, line in self._rows():
            rec = json.loads(line)
            f = rec.get("fields") or {}
            if profile is not None and f.get("profile") != profile:
                continue
            if run is not None and f.get("run") != run:
                continue
            out.append(rec)
        return out

    def verify(self) -> audit_mod.VerifyResult:
        """Walk the whole chain in the database and compare its end with the head row."""
        key = self.keys.get_audit_key(create=False)
        with self.backend.conn() as conn:
            if self.backend.read_only:     # no row locks there: one snapshot for walk and head
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            else:
                conn.execute("SELECT 1 FROM sfguard_audit_head WHERE id = 1 FOR SHARE")
            walked = audit_mod.walk_chain(self._rows_in(conn), key)
            if isinstance(walked, audit_mod.VerifyResult):
                return walked
            head = conn.execute("SELECT seq, hash, mac FROM sfguard_audit_head WHERE id = 1").fetchone()
        if head is None:
            return audit_mod.VerifyResult(False, walked.count, None, "the audit head row is missing")
        if walked.count == 0 and int(head[0]) == 0:
            return audit_mod.VerifyResult(True, 0)
        return audit_mod.check_head(walked, (int(head[0]), str(head[1]), head[2]), key,
                                    "audit head row")

    @staticmethod
    def _rows_in(conn) -> Iterator[tuple[int, bytes]]:
        with conn.cursor(name=f"audit_{secrets.token_hex(4)}") as cur:
            cur.itersize = 1000
            cur.execute("SELECT body FROM sfguard_audit ORDER BY seq")
            for n, (body,) in enumerate(cur, 1):
                yield n, body.encode() + b"\n"
