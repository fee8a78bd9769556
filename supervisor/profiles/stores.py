"""Which store a guard and the CLI use: the local home (default) or a shared PostgreSQL.

`--store URL` wins over `$SFGUARD_STORE`; neither (or `local`) means the local home, as
before. A `postgresql://` (or `postgres://`) URL selects the shared store
(supervisor/profiles/pg_*.py, described in pg_backend.py); the key is then the operator's
shared key (`$SFGUARD_KEY_FILE` or `$SFGUARD_KEY`), never a per-host one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sfguard.errors import SfguardError

ENV_STORE = "SFGUARD_STORE"
SCHEMES = ("postgresql://", "postgres://")

__all__ = ["ENV_STORE", "StoreError", "Stores", "store_url", "open_stores", "describe_store"]


class StoreError(SfguardError):
    """A store setting that cannot be used (the URL itself is never echoed: it may hold a
    password)."""


@dataclass
class Stores:
    """The four seams a guard uses, built for one store setting."""
    kind: str                  # "local" or "postgresql"
    shown: str                 # where, without secrets
    keys: Any
    store: Any
    lease: Any
    audit: Any
    backend: Any = None        # PgBackend for the shared store

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


def store_url(flag: str | None = None) -> str | None:
    """The shared store's URL from `--store` or `$SFGUARD_STORE`; None for the local home."""
    value = flag if flag else os.environ.get(ENV_STORE, "")
    value = value.strip()
    if not value or value == "local":
        return None
    if not value.startswith(SCHEMES):
        raise StoreError("the store must be 'local' or a postgresql://... URL "
                         f"(from {'--store' if flag else '$' + ENV_STORE})")
    return value


def describe_store(flag: str | None = None) -> str:
    """The store setting in words, without the password."""
    url = store_url(flag)
    if url is None:
        return "local home"
    from sfguard.supervisor.profiles.pg_backend import redact_url  # noqa: PLC0415
    return f"PostgreSQL {redact_url(url)}"


def open_stores(home: Path, runtime: Path | None = None, flag: str | None = None, *,
                read_only: bool = False, heartbeat: bool = True) -> Stores:
    """Build keys, store, lease and audit for the setting. `read_only` (`audit verify|show`,
    `profiles list|show`, `doctor`): create nothing in the home; on a shared store, migrate
    nothing, register no guard and open read-only sessions (pg_schema.NoSchema on a database
    no guard has started on, SchemaTooNew / SchemaTooOld on another version's schema)."""
    url = store_url(flag)
    if url is None:
        from sfguard.supervisor.profiles.audit import LocalAuditSink  # noqa: PLC0415
        from sfguard.supervisor.profiles.keys import default_key_provider  # noqa: PLC0415
        from sfguard.supervisor.profiles.lease import LocalProfileLease  # noqa: PLC0415
        from sfguard.supervisor.profiles.local_store import LocalProfileStore  # noqa: PLC0415
        keys = default_key_provider(home)
        if read_only:    # an existing home: these create nothing in it until asked to write
            return Stores("local", "local home", keys, LocalProfileStore(home, keys, runtime=runtime),
                          LocalProfileLease(home), LocalAuditSink(home, keys, read_only=True))
        return Stores("local", "local home", keys, LocalProfileStore(home, keys, runtime=runtime),
                      LocalProfileLease(home), LocalAuditSink(home, keys))
    from sfguard.supervisor.profiles.pg_audit import PgAuditSink  # noqa: PLC0415
    from sfguard.supervisor.profiles.pg_backend import PgBackend  # noqa: PLC0415
    from sfguard.supervisor.profiles.pg_keys import PgKeyProvider, load_master_keys  # noqa: PLC0415
    from sfguard.supervisor.profiles.pg_lease import PgProfileLease  # noqa: PLC0415
    from sfguard.supervisor.profiles.pg_store import PgProfileStore  # noqa: PLC0415
    masters, source = load_master_keys()
    backend = PgBackend(url, heartbeat=heartbeat, read_only=read_only)
    made = False
    try:
        keys = PgKeyProvider(backend, masters, source)
        made = True
    finally:
        if not made:    # the backend (its pool, its heartbeat) goes with the failed start
            backend.close()
    audit = PgAuditSink(backend, keys)
    backend.audit = audit
    return Stores("postgresql", f"PostgreSQL {backend.url_shown}", keys,
                  PgProfileStore(backend, keys, home, runtime=runtime, audit=audit),
                  PgProfileLease(backend, audit), audit, backend)
