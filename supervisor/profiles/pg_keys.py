"""The keys of the shared store: the operator's master keys and `PgKeyProvider`.

A master key shared by the operator (key file or environment variable, the same on every guard
host) wraps random per-scope keys kept in the database, so every host uses the same keys and
deleting a scope's wrapped key makes its profiles unreadable. See pg_backend.py for the whole.

Key versions: the key file (or $SFGUARD_KEY) may hold several master keys, one per line (or
separated by spaces): `BASE64` is version 1 (the only form before versions existed),
`N:BASE64` version N. Version N's master key wraps the scope keys of version N and derives
its audit key. The database keeps which versions exist (a check value each, never a key),
which is current and the rotation under way (`sfguard_key_versions`, `sfguard_meta`), so every
host agrees on the current version. A host that is asked for a version it has not got reads
its key file again (at most once a second): a file updated in place is picked up without a
restart; otherwise it refuses, naming the version and the file (it never falls back to an
older version).
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sfguard.supervisor.profiles.key_versions import KeyStateError
from sfguard.supervisor.profiles.keys import KEY_BYTES, KeyMissing, KeyVersionMissing, decode_key
from sfguard.supervisor.profiles.pg_backend import PgBackend
from sfguard.supervisor.protocols import KeyVersion, Rotation, StoreUnavailable, validate_name

ENV_KEY = "SFGUARD_KEY"
ENV_KEY_FILE = "SFGUARD_KEY_FILE"
RELOAD_EVERY = 1.0              # seconds between two reads of the key file for a missing version
_ENTRY = re.compile(r"^(?:(\d{1,6}):)?(\S+)$")

__all__ = ["ENV_KEY", "ENV_KEY_FILE", "PgKeyProvider", "load_master_key", "load_master_keys"]


def load_master_keys(environ: dict | None = None) -> tuple[dict[int, bytes], str]:
    """The operator's shared master keys by version, and where they came from.

    `$SFGUARD_KEY_FILE` names a 0600 file holding base64 of 32 random bytes (made with
    `head -c 32 /dev/urandom | base64`), one key per line, `N:` before every version but the
    first; `$SFGUARD_KEY` holds the same text directly. The same keys must be given to every
    guard host that shares the database. KeyMissing when neither is set, or a key is not
    private, not 32 bytes or given twice (no key is ever shown)."""
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
        return _parse(p.read_bytes().decode("ascii", "replace"), f"the shared key file {p}"), \
            f"shared key file {p}"
    raw = env.get(ENV_KEY)
    if raw:
        return _parse(raw, f"${ENV_KEY}"), f"shared key from ${ENV_KEY}"
    raise KeyMissing(f"a shared store needs the key every guard host shares: set ${ENV_KEY_FILE} "
                     f"to a 0600 file with base64 of 32 random bytes (or ${ENV_KEY} to that text)")


def load_master_key(environ: dict | None = None) -> tuple[bytes, str]:
    """The newest version's master key and where it came from (see load_master_keys)."""
    keys, source = load_master_keys(environ)
    return keys[max(keys)], source


def _parse(text: str, what: str) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for n, token in enumerate(text.split(), 1):
        m = _ENTRY.fullmatch(token)
        version = int(m.group(1)) if m and m.group(1) else 1
        if m is None or version < 1:
            raise KeyMissing(f"{what}: entry {n} is not `BASE64` or `VERSION:BASE64`")
        if version in out:
            raise KeyMissing(f"{what} gives key version {version} twice")
        out[version] = decode_key(m.group(2).encode(), f"{what} (key version {version}) is not "
                                  "base64 of 32 bytes")
    if not out:
        raise KeyMissing(f"{what} is empty: it must hold base64 of 32 random bytes")
    return out


def _derive(master: bytes, purpose: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=f"sfguard shared {purpose} v1".encode()).derive(master)


def _check(master: bytes) -> str:
    return hmac.new(_derive(master, "check"), b"sfguard key check", hashlib.sha256).hexdigest()


def _aad(scope: str, version: int) -> bytes:
    return scope.encode() if version == 1 else f"{scope} v{version}".encode()


class PgKeyProvider:
    """KeyProvider for the shared store: per-scope random keys of each key version, wrapped
    (AES-GCM) under a key derived from that version's master key and kept in
    `sfguard_scope_keys`; the audit HMAC key of a version is derived from its master key. The
    first guard that starts records a check value of each master key it has; a guard whose key
    of a version differs refuses to start."""

    def __init__(self, backend: PgBackend, master: bytes | dict[int, bytes], source: str,
                 reload: Callable[[], dict[int, bytes]] | None = None):
        self.backend = backend
        self.source = source
        self._masters = {1: master} if isinstance(master, bytes) else dict(master)
        self._reload = reload if reload is not None else (lambda: load_master_keys()[0])
        self._reloaded = 0.0
        self._cache: dict[tuple[str, int], bytes] = {}
        self._cache_lock = threading.Lock()
        self._current = 1
        with backend.conn() as conn:
            if not backend.read_only:
                self._register(conn)
            rows = conn.execute("SELECT version, key_check FROM sfguard_key_versions").fetchall()
        for version, check in rows:
            mine = self._masters.get(int(version))
            if mine is not None and not hmac.compare_digest(str(check), _check(mine)):
                raise KeyMissing(self._mismatch(int(version)))

    def _mismatch(self, version: int) -> str:
        if version == 1:
            return (f"the {self.source} is not the key this database was set up with: every guard "
                    "host sharing the database must use the same key")
        return (f"key version {version} of the {self.source} is not the key this database knows as "
                f"version {version}: every guard host must be given the same key for each version")

    def _register(self, conn) -> None:
        """The first guard on a database records its master keys' check values (the newest is
        current); later guards change nothing here."""
        first = min(self._masters)
        made = conn.execute("INSERT INTO sfguard_meta (id, key_check, current_version) VALUES "
                            "(1, %s, %s) ON CONFLICT (id) DO NOTHING",
                            (_check(self._masters[first]), max(self._masters))).rowcount
        if made:
            for version, master in sorted(self._masters.items()):
                conn.execute("INSERT INTO sfguard_key_versions (version, key_check, created) VALUES "
                             "(%s, %s, %s) ON CONFLICT DO NOTHING", (version, _check(master), time.time()))

    # ----------------------------------------------------------------- master keys
    def _master(self, version: int) -> bytes:
        """This host's master key of `version`: from memory, else the key file read again
        (checked against the database's check value); KeyVersionMissing otherwise."""
        if version not in self._masters and time.monotonic() - self._reloaded >= RELOAD_EVERY:
            self._reloaded = time.monotonic()
            try:
                fresh = self._reload()
            except KeyMissing:
                fresh = {}
            if version in fresh:
                with self.backend.conn() as conn:
                    row = conn.execute("SELECT key_check FROM sfguard_key_versions WHERE version = %s",
                                       (version,)).fetchone()
                if row is not None and not hmac.compare_digest(str(row[0]), _check(fresh[version])):
                    raise KeyMissing(self._mismatch(version))
                self._masters[version] = fresh[version]
        if version not in self._masters:
            raise KeyVersionMissing(
                f"key version {version} is not on this host: the {self.source} has no version "
                f"{version} (add `{version}:BASE64` of that key, as every host of the store must "
                "have it; the guard reads the file again, no restart needed). Nothing is sealed "
                "with an older version")
        return self._masters[version]

    def _meta(self, conn) -> tuple | None:
        return conn.execute("SELECT current_version, rotation_from, rotation_to, rotation_started, "
                            "rotation_switched FROM sfguard_meta WHERE id = 1").fetchone()

    def current_version(self) -> int:
        """The store's current key version (the last one read when the database is away)."""
        try:
            with self.backend.conn() as conn:
                row = self._meta(conn)
        except StoreUnavailable:
            return self._current
        self._current = 1 if row is None else int(row[0])
        return self._current

    # ----------------------------------------------------------------- keys
    def get_key(self, scope: str, *, create: bool = True, version: int | None = None) -> bytes:
        validate_name(scope, "scope")
        v = self.current_version() if version is None else version
        try:
            key = self._fetch_key(scope, v, create)
        except StoreUnavailable:
            # the database is away: seal with the key last read from it (so a run that ends
            # now can still seal its profile on this host); never a key made up here
            with self._cache_lock:
                if (scope, v) in self._cache:
                    return self._cache[(scope, v)]
            raise
        with self._cache_lock:
            self._cache[(scope, v)] = key
        return key

    def current_key(self, scope: str) -> tuple[int, bytes]:
        v = self.current_version()
        return v, self.get_key(scope, version=v)

    def _fetch_key(self, scope: str, version: int, create: bool) -> bytes:
        wrap = AESGCM(_derive(self._master(version), "scope-key wrapping"))
        with self.backend.conn() as conn:
            if create and not self.backend.read_only:
                nonce = secrets.token_bytes(12)
                fresh = nonce + wrap.encrypt(nonce, secrets.token_bytes(KEY_BYTES), _aad(scope, version))
                conn.execute("INSERT INTO sfguard_scope_keys (scope, version, wrapped) VALUES "
                             "(%s, %s, %s) ON CONFLICT DO NOTHING", (scope, version, fresh))
            row = conn.execute("SELECT wrapped FROM sfguard_scope_keys WHERE scope = %s AND "
                               "version = %s", (scope, version)).fetchone()
        if row is None:
            raise KeyMissing(f"no key for scope {scope!r}" + (f" in key version {version}" if version > 1
                                                              else "") + f" ({self.describe()})")
        wrapped = bytes(row[0])
        try:
            return wrap.decrypt(wrapped[:12], wrapped[12:], _aad(scope, version))
        except (InvalidTag, ValueError):
            raise KeyMissing(f"the key of scope {scope!r} in the database is damaged") from None

    def delete_key(self, scope: str) -> bool:
        with self._cache_lock:
            for k in [k for k in self._cache if k[0] == scope]:
                del self._cache[k]
        with self.backend.conn() as conn:
            cur = conn.execute("DELETE FROM sfguard_scope_keys WHERE scope = %s",
                               (validate_name(scope, "scope"),))
            return cur.rowcount > 0

    def get_audit_key(self, *, create: bool = True, version: int | None = None) -> bytes | None:
        v = self.current_version() if version is None else version
        return _derive(self._master(v), "audit chain")

    def describe(self) -> str:
        return f"{self.source} (scope keys wrapped in the shared database)"

    # ----------------------------------------------------------------- versions
    def versions(self) -> list[KeyVersion]:
        with self.backend.conn() as conn:
            meta = self._meta(conn)
            rows = conn.execute("SELECT version, created, retired FROM sfguard_key_versions "
                                "ORDER BY version").fetchall()
        current = 1 if meta is None else int(meta[0])
        out = []
        for version, created, retired in rows:
            v = int(version)
            state = ("retired" if retired is not None else "current" if v == current else
                     "prepared" if meta is not None and meta[2] == v and not meta[4] else "old")
            try:
                held = retired is None and bool(self._master(v))
            except KeyMissing:
                held = False
            where = f"{self.source}, version {v}" if held else f"not on this host ({self.source} has no version {v})"
            out.append(KeyVersion(v, state, where, created, retired, held))
        return out

    def rotation(self) -> Rotation | None:
        with self.backend.conn() as conn:
            meta = self._meta(conn)
        if meta is None or meta[2] is None:
            return None
        return Rotation(int(meta[1]), int(meta[2]), float(meta[3]), bool(meta[4]))

    @contextlib.contextmanager
    def locked(self, wait: float = 0.0) -> Iterator[None]:
        """No lock across hosts: every rotation step is one transaction that checks the state
        it changes, so two hosts doing the same step do it once."""
        yield

    def prepare_version(self, scopes: list[str]) -> Rotation:
        """A new version (the lowest this host has above every version of the store) and the
        rotation's intent, in one transaction; a rotation prepared before and not switched is
        returned as it is."""
        with self.backend.conn() as conn:
            meta = conn.execute("SELECT current_version, rotation_from, rotation_to, rotation_started, "
                                "rotation_switched FROM sfguard_meta WHERE id = 1 FOR UPDATE").fetchone()
            if meta[2] is not None:
                if meta[4]:
                    raise KeyStateError(f"the rotation to key version {meta[2]} is still under way")
                rot = Rotation(int(meta[1]), int(meta[2]), float(meta[3]), False)
            else:
                top = int(conn.execute("SELECT max(version) FROM sfguard_key_versions").fetchone()[0] or 1)
                self._reloaded = 0.0
                with contextlib.suppress(KeyVersionMissing):
                    self._master(top + 1)
                ahead = sorted(v for v in self._masters if v > top)
                if not ahead:
                    raise KeyVersionMissing(
                        f"a rotation needs a new master key on every guard host first: add "
                        f"`{top + 1}:BASE64` (base64 of 32 new random bytes) to the {self.source} "
                        "of every host, then rotate (docs/deployment.md, \"Rotating the shared key\")")
                new, now = ahead[0], time.time()
                conn.execute("INSERT INTO sfguard_key_versions (version, key_check, created) VALUES "
                             "(%s, %s, %s)", (new, _check(self._masters[new]), now))
                conn.execute("UPDATE sfguard_meta SET rotation_from = current_version, rotation_to = %s, "
                             "rotation_started = %s, rotation_switched = false WHERE id = 1", (new, now))
                rot = Rotation(int(meta[0]), new, now, False)
        for scope in scopes:
            self.get_key(scope, version=rot.to_version)
        return rot

    def set_current(self, version: int, conn=None) -> None:
        sql = ("UPDATE sfguard_meta SET current_version = %s, rotation_switched = "
               "(rotation_switched OR rotation_to = %s) WHERE id = 1")
        if conn is not None:
            conn.execute(sql, (version, version))
            return
        with self.backend.conn() as c:
            c.execute(sql, (version, version))

    def end_rotation(self, version: int, conn=None) -> bool:
        sql = ("UPDATE sfguard_meta SET rotation_from = NULL, rotation_to = NULL, rotation_started = "
               "NULL, rotation_switched = false WHERE id = 1 AND rotation_to = %s AND rotation_switched")
        if conn is not None:
            return bool(conn.execute(sql, (version,)).rowcount)
        with self.backend.conn() as c:
            return bool(c.execute(sql, (version,)).rowcount)

    def retire_version(self, version: int, scopes: list[str]) -> None:
        """Delete the version's wrapped scope keys and mark it retired (the caller checked that
        no profile uses it); this host forgets its master key of that version."""
        with self.backend.conn() as conn:
            meta = conn.execute("SELECT current_version, rotation_to FROM sfguard_meta WHERE id = 1 "
                                "FOR UPDATE").fetchone()
            if meta is None or version in (int(meta[0]), meta[1]):
                raise KeyStateError(f"key version {version} is the current one (or a rotation's new "
                                    "one): it cannot be retired")
            made = conn.execute("UPDATE sfguard_key_versions SET retired = %s WHERE version = %s AND "
                                "retired IS NULL", (time.time(), version)).rowcount
            if not made:
                raise KeyStateError(f"key version {version} is not a live version of this store")
            conn.execute("DELETE FROM sfguard_scope_keys WHERE version = %s", (version,))
        self._masters.pop(version, None)
        with self._cache_lock:
            for k in [k for k in self._cache if k[1] == version]:
                del self._cache[k]
