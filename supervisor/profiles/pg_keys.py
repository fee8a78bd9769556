"""The keys of the shared store: the operator's master key and `PgKeyProvider`.

A master key shared by the operator (key file or environment variable, the same on every guard
host) wraps random per-scope keys kept in the database, so every host uses the same keys and
deleting a scope's wrapped key makes its profiles unreadable. See pg_backend.py for the whole.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sfguard.supervisor.profiles.keys import KEY_BYTES, KeyMissing, decode_key
from sfguard.supervisor.profiles.pg_backend import PgBackend
from sfguard.supervisor.protocols import StoreUnavailable, validate_name

ENV_KEY = "SFGUARD_KEY"
ENV_KEY_FILE = "SFGUARD_KEY_FILE"

__all__ = ["ENV_KEY", "ENV_KEY_FILE", "PgKeyProvider", "load_master_key"]


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
    return decode_key(raw, f"{what} is not base64 of 32 bytes")


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
