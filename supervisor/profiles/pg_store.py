"""Profiles at rest in the shared store: `PgProfileStore` (ProfileStore); see pg_backend.py.

Sealed blobs live in `sfguard_blob_chunks`, one row per chunk of at most `BLOB_CHUNK` bytes.
Sealing stays on the guard host (supervisor/profiles/sealing.py, the same format as the local
store); the database only ever sees sealed bytes. A seal is written to a private temp file, then
streamed chunk by chunk into the database; a fetch streams the chunks into a private temp file
that is unsealed as the local store does. Working copies stay local
(`<runtime>/profiles/<scope>/<name>/`, 0700). Every reseal and state write checks, in the
transaction that writes it, that this guard still holds the profile with its fencing token
(pg_lease.py); otherwise it is refused and logged, and the newer state stays.
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from sfguard.supervisor.home import private_dir, runtime_path
from sfguard.supervisor.profiles import sealing
from sfguard.supervisor.profiles.keys import KeyVersionMissing
from sfguard.supervisor.profiles.local_store import working_copies
from sfguard.supervisor.profiles.pg_audit import PgAuditSink
from sfguard.supervisor.profiles.pg_backend import GUARD_ALIVE, PgBackend, StaleLease
from sfguard.supervisor.protocols import (
    ProfileBusy,
    ProfileExists,
    ProfileInfo,
    ProfileKey,
    ProfileNotFound,
    StoreUnavailable,
    validate_name,
)

log = logging.getLogger("sfguard.pg_store")     # one logger for the whole shared store

BLOB_CHUNK = 1 << 20            # bytes of sealed data per database row

__all__ = ["BLOB_CHUNK", "PgProfileStore"]


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
        sealed = False
        try:
            version, scope_key = self.keys.current_key(key.scope)
            sealing.seal_dir(src, tmp, scope_key, key.scope, key.name, key_version=version)
            sealed = True
        finally:
            if not sealed:
                self._discard(tmp)
        return tmp

    def _key_lookup(self, scope: str) -> sealing.KeyLookup:
        """The scope's key of whichever version a sealed file names."""
        return lambda version: self.keys.get_key(scope, create=False, version=version)

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
        fetched = False
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
            fetched = True
        finally:
            if not fetched:
                self._discard(tmp)
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
                    "blob_id, key_version) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (key.scope, key.name, identity, now, now, size, blob_id,
                     sealing.key_version_of(sealed, key.scope, key.name)))
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
        return dict(zip(names, row, strict=True))

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
            sealing.unseal_to(sealed, dest, self._key_lookup(key.scope), key.scope, key.name)
        finally:
            self._discard(sealed)
        return dest

    def _check_fence(self, conn, key: ProfileKey, what: str,
                     held: tuple[str, int] | None = None) -> tuple[str, int]:
        """Lock the profile's lease row and return the (run, fencing token) this guard holds
        (or `held`, captured earlier); raise StaleLease (and log it) when this guard no longer
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
        return held

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
                      final: bool = False, rekey: bool = False) -> None:
        """Stream a sealed file in as the profile's new blob, fenced by `held`. `final`: a
        deferred retry, whose file is removed once stored or refused. A new key version is
        recorded (`profile_rekeyed`) in the same transaction; `rekey`: a rotation's reseal at
        rest, which leaves `last_used` as it was."""
        version = sealing.key_version_of(sealed, key.scope, key.name)
        keep = False        # refused or failed: the sealed file goes
        try:
            with self.backend.conn() as conn:
                blob_id, size = self._insert_blob(conn, sealed)
                run, token = self._check_fence(conn, key, "reseal", held)
                old = conn.execute("SELECT blob_id, key_version FROM sfguard_profiles WHERE scope = %s "
                                   "AND name = %s FOR UPDATE", (key.scope, key.name)).fetchone()
                if old is None:
                    raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
                now = time.time()
                conn.execute("UPDATE sfguard_profiles SET blob_id = %s, size = %s, updated = %s, "
                             "last_used = CASE WHEN %s THEN last_used ELSE %s END, written_generation = %s, "
                             "key_version = %s WHERE scope = %s AND name = %s",
                             (blob_id, size, now, rekey, now, token, version, key.scope, key.name))
                conn.execute("DELETE FROM sfguard_blob_chunks WHERE blob_id = %s", (old[0],))
                if not rekey:
                    self._audit(conn, "profile_resealed", key,
                                {"run": run, "outcome": "late" if final else "stored"})
                if int(old[1]) != version:
                    self._audit(conn, "profile_rekeyed", key, {"run": run, "from_version": int(old[1]),
                                                                "to_version": version})
            keep = not final    # stored: a deferred retry's file goes; a save's is the caller's
        except StoreUnavailable:
            keep = True
            raise                                   # kept for the next retry
        finally:
            if not keep:
                self._discard(sealed)

    def record_login_check(self, key: ProfileKey, logged_in: bool) -> None:
        """A state write: the last login check's time and result, fenced like a reseal."""
        with self.backend.conn() as conn:
            _run, token = self._check_fence(conn, key, "state write")
            conn.execute("UPDATE sfguard_profiles SET last_login_check = %s, last_login_ok = %s, "
                         "written_generation = %s WHERE scope = %s AND name = %s",
                         (time.time(), logged_in, token, key.scope, key.name))

    def close(self, key: ProfileKey, *, save: bool = True) -> ProfileInfo:
        """End of lease: reseal (unless `save=False`) and remove the working copy. A refused
        (stale) reseal still removes the working copy and then raises StaleLease; a reseal this
        host cannot key (KeyVersionMissing) keeps it, for the guard to try again."""
        src = self._unsealed_dir(key)
        keep = False
        try:
            if save and src.is_dir():
                self.save(key)
        except KeyVersionMissing:
            keep = True
            raise      # kept: sealed once this host has the store's current key version
        finally:
            if not keep:
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
                                     + GUARD_ALIVE, (lease[1],)).fetchone() is not None:
                raise ProfileBusy(f"profile {key.name!r} is leased by run {lease[0]!r}")
            row = conn.execute("DELETE FROM sfguard_profiles WHERE scope = %s AND name = %s "
                               "RETURNING blob_id", (key.scope, key.name)).fetchone()
            if row is None:
                raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
            conn.execute("DELETE FROM sfguard_blob_chunks WHERE blob_id = %s", (row[0],))
            self._audit(conn, "profile_deleted", key, note)

    def delete_scope(self, scope: str) -> builtins.list[ProfileKey]:
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

    def unsealed(self) -> builtins.list[ProfileKey]:
        """Profiles with a working copy on this host (after a crash: for the start-up sweep)."""
        return working_copies(self._runtime_path())

    def scopes(self) -> builtins.list[str]:
        with self.backend.conn() as conn:
            return [r[0] for r in conn.execute("SELECT DISTINCT scope FROM sfguard_profiles ORDER BY 1")]

    def key_version(self, key: ProfileKey) -> int:
        with self.backend.conn() as conn:
            row = conn.execute("SELECT key_version FROM sfguard_profiles WHERE scope = %s AND name = %s",
                               (key.scope, key.name)).fetchone()
        if row is None:
            raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
        return int(row[0])

    def rekey(self, key: ProfileKey) -> tuple[int, int]:
        """Seal the stored copy again under the current key version (the caller holds the
        profile's lease: fenced like a reseal): (the version before, the version now)."""
        held = self.backend.token(key)
        version, scope_key = self.keys.current_key(key.scope)
        before = self.key_version(key)
        if before == version:
            return before, version
        fetched = self._fetch_to_file(key)
        try:
            out = self._scratch(".rekey-")
            try:
                sealing.reseal(fetched, out, self._key_lookup(key.scope), scope_key, version,
                               key.scope, key.name)
                self._store_sealed(key, out, held, rekey=True)
            finally:
                self._discard(out)
        finally:
            self._discard(fetched)
        return before, version
