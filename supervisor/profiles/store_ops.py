"""The guard's state changes on the profile seams, each with its audit record, and the way the
daemon calls the seams without blocking its event loop.

- Audited operations (`grant`, `release_run`, `create_profile`, `delete_profile`): a seam that
  `audits_changes` (the shared PostgreSQL store, supervisor/profiles/pg_store.py and
  pg_lease.py) writes the record in the database transaction of the change, so a crash or a
  refused write can never leave one without the other. The local home writes the change, then
  the record (two files, no common transaction), as it always did.
- `StoreCalls`: the daemon's event loop also relays every browser's CDP traffic and answers
  the control API, so seam calls (a database that is slow or away, a 50 MB reseal) run in
  worker threads; `bounded` gives up waiting after a bound (the call finishes in its thread,
  its answer is dropped) for answers that must come back at once (`status`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
from collections.abc import Callable
from typing import Any

from sfguard.errors import SfguardError
from sfguard.supervisor.profiles.keys import KeyVersionMissing
from sfguard.supervisor.protocols import (
    Granted,
    ProfileExists,
    ProfileInfo,
    ProfileKey,
    StoreUnavailable,
    Waiting,
)

log = logging.getLogger("sfguard.store")

__all__ = ["audited", "grant", "release_run", "create_profile", "delete_profile", "StoreCalls",
           "StoreSlow"]


def audited(seam: Any) -> bool:
    """True when the seam writes the audit records of its own changes (in their transaction)."""
    return bool(getattr(seam, "audits_changes", False))


def grant(stores, key: ProfileKey, run: str, identity: str | None = None) -> Granted | Waiting:
    """Grant `key` to `run` or queue it; a new grant is audited (`profile_leased`). A profile
    that does not exist yet is created first (`profile_created`, with `identity`), so the
    audit log tells the first run of a new profile in causal order: created, then leased."""
    if not stores.store.exists(key):
        try:
            create_profile(stores, key, identity, run=run)
        except ProfileExists:
            pass                      # made meanwhile (by another guard of a shared store)
    result = stores.lease.try_acquire(key, run)
    if isinstance(result, Granted) and not result.reentrant and not audited(stores.lease):
        stores.audit.record("profile_leased", scope=key.scope, profile=key.name, run=run)
    return result


def release_run(stores, run: str, outcome: str) -> tuple[list[ProfileKey], list[str]]:
    """Release every lease and queue place of `run`, each release audited with the run's
    outcome. Returns (the released profiles, problems to report)."""
    if audited(stores.lease):
        try:
            return stores.lease.release_all(run, outcome=outcome), []
        except StoreUnavailable:
            return [], ["the database is unreachable: the release of this run's profiles waits "
                        "on this guard host and is done (and audited) when the database is back"]
        except KeyVersionMissing as exc:      # its record cannot be keyed here: nothing written
            return [], [f"releasing the run's leases waits: {exc} (key_missing)"]
    try:
        released = stores.lease.release_all(run)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return [], [f"releasing the run's leases failed: {exc}; the guard releases them as "
                        "soon as there is space (no_space)"]
        return [], [f"releasing the run's leases failed: {exc}; the next start of the guard "
                    "releases them"]
    problems = []
    for key in released:
        try:
            stores.audit.record("profile_released", scope=key.scope, profile=key.name, run=run,
                                outcome=outcome)
        except OSError as exc:
            problems.append(f"the audit record of the release could not be written ({exc}); "
                            "the chain up to it is intact")
    return released, problems


def create_profile(stores, key: ProfileKey, identity: str | None = None,
                   **fields: Any) -> ProfileInfo:
    """Create an empty profile (with its workflow identity, if any), audited
    (`profile_created` with `fields`)."""
    if audited(stores.store):
        return stores.store.create(key, identity, note=fields)
    info = stores.store.create(key, identity)
    stores.audit.record("profile_created", scope=key.scope, profile=key.name, **fields)
    return info


def delete_profile(stores, key: ProfileKey, **fields: Any) -> None:
    """Delete a profile, audited (`profile_deleted` with `fields`)."""
    if audited(stores.store):
        stores.store.delete(key, note=fields)
        return
    stores.store.delete(key)
    stores.audit.record("profile_deleted", scope=key.scope, profile=key.name, **fields)


class StoreSlow(SfguardError):
    """A bounded seam call did not answer in time (it goes on in its thread)."""


class StoreCalls:
    """Seam calls off the event loop: one worker for the local home (its calls ran one at a
    time before, and still do), as many as the database pool has connections for a shared
    store."""

    def __init__(self, workers: int = 1):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers),
                                                           thread_name_prefix="sfguard-store")

    async def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    async def bounded(self, bound: float, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """`run`, but StoreSlow after `bound` seconds; the call itself is not interrupted."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), bound)
        except TimeoutError:
            fut.add_done_callback(_drop_result)
            raise StoreSlow(f"the store did not answer within {bound:.0f} s") from None

    def submit(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """Fire and forget (an audit record of the guard's own housekeeping); failures are
        logged with `what`, never raised into the caller."""
        def done(f: concurrent.futures.Future) -> None:
            exc = f.exception()
            if exc is not None:
                log.warning("%s could not be written: %s", what, exc)
        try:
            self._pool.submit(fn, *args, **kw).add_done_callback(done)
        except RuntimeError:          # shut down: the guard is stopping
            log.warning("%s was not written: the guard is stopping", what)

    def close(self) -> None:
        """Wait for the calls under way (what they write is not dropped), then stop."""
        self._pool.shutdown(wait=True)


def _drop_result(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()         # retrieved: no "exception was never retrieved" warning
