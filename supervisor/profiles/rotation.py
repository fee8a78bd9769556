"""Key rotation: every sealed profile and the audit chain move to a new key version while the
guard runs, and a crash at any step is finished by the next start (or `rotate` again).

    rotate(stores)             begin a rotation, or resume the one under way; reseal every
                               profile at rest now; a leased one waits for its run's end
    close_profile(stores, ...) a run's end: reseal (under the current version) and close;
                               the rotation is finished once no profile is on an older version
    retire(stores, version)    drop an old version's keys when nothing uses it, else say what does
    key_status(stores)         versions, where each lives, what each still covers

The steps of a rotation and what a `kill -9` between them leaves (every profile opens at every
moment: its sealed copy is under the old version or the new, and both are held):
  1. prepare: the new version's keys are made and the key state names it as the rotation's
     (`key_rotation_started`, keyed by the old version). Crash: nothing uses the new keys yet.
  2. switch: the audit chain's `key_rotated` record (keyed by both versions) and then the
     key state's current version, as one step of the audit sink. From here every seal and
     record uses the new version.
  3. reseal at rest: each profile no run holds is leased to the rotation (`keys-rotation-vN`)
     for the moment of its reseal (sealing.reseal: chunk by chunk, atomic rename), so no run
     opens it half-way; each is recorded (`profile_rekeyed`). Crash: some are moved, the rest
     are moved by the next start.
  4. finish: once no profile is on an older version (the leased ones are resealed at their
     runs' ends), `key_rotation_finished` and the rotation's end, as one step.

`SFGUARD_TEST_ROTATION_PAUSE=STEP` (tests only) holds a rotation at a step (`prepared`,
`switched`, `resealed-one`, `resealed`) for up to 120 s, so a test can kill the guard there.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.profiles.key_versions import KeysBusy, KeyStateError, check_version
from sfguard.supervisor.profiles.store_ops import audited
from sfguard.supervisor.protocols import Granted, ProfileError, ProfileInfo, ProfileKey

log = logging.getLogger("sfguard.keys")

ENV_PAUSE = "SFGUARD_TEST_ROTATION_PAUSE"
PAUSE_MAX_S = 120.0
#: how long a rotation waits for another rotation or retirement of the same home
LOCK_WAIT_S = 5.0

__all__ = ["rotate", "close_profile", "finish_if_done", "retire", "key_status", "rotation_run",
           "KeysBusy", "KeyStateError"]


def rotation_run(version: int) -> str:
    """The run id a rotation's short leases are held by."""
    return f"keys-rotation-v{version}"


def _pause(step: str) -> None:
    if os.environ.get(ENV_PAUSE) == step:
        log.warning("key rotation paused at step %s (test hook $%s)", step, ENV_PAUSE)
        time.sleep(PAUSE_MAX_S)


def _profiles(stores: Any) -> list[ProfileKey]:
    return [info.key for scope in stores.store.scopes() for info in stores.store.list(scope)]


def _holder(stores: Any, key: ProfileKey, read_only: bool = False) -> dict[str, Any]:
    """{"leased_by": the run holding `key` or None, and "leased_on": its host on a shared
    store}; read-only never creates lease files."""
    lease = stores.lease
    if lease is None or (read_only and hasattr(lease, "has_state") and not lease.has_state(key)):
        return {"leased_by": None}
    holder = lease.holder(key)
    if holder is None:
        return {"leased_by": None}
    return {"leased_by": holder.run, **({"leased_on": holder.host} if holder.host else {})}


def _off_version(stores: Any, current: int) -> list[tuple[ProfileKey, int]]:
    """(profile, its key version) of every profile not sealed under `current`."""
    out = []
    for key in _profiles(stores):
        try:
            version = stores.store.key_version(key)
        except ProfileError as exc:
            log.error("profile %s: its key version cannot be read (%s)", key, exc)
            continue
        if version != current:
            out.append((key, version))
    return out


def rotate(stores: Any, *, by: str = "cli") -> dict[str, Any]:
    """Begin a rotation (or resume the one under way), reseal every profile at rest under the
    new version and finish it when nothing is left on an older one. Raises KeysBusy (another
    rotation holds the lock), KeyMissing (a shared store's new key is not on this host)."""
    keys, audit = stores.keys, stores.audit
    with keys.locked(LOCK_WAIT_S):
        rot = keys.rotation()
        resumed = rot is not None
        if rot is None:
            rot = keys.prepare_version(stores.store.scopes())
            event = "key_rotation_started"
        else:
            event = "key_rotation_resumed"
        audit.record(event, from_version=rot.from_version, to_version=rot.to_version, by=by)
        log.info("key rotation %s: version %d to %d", "resumed" if resumed else "started",
                 rot.from_version, rot.to_version)
        _pause("prepared")
        if not rot.switched:
            audit.switch_key(rot.to_version)
        _pause("switched")
        report = _reseal_at_rest(stores, rot.to_version)
        _pause("resealed")
        report["finished"] = _finish(stores, rot.to_version)
    if not report["finished"]:     # a run that ended while the lock was held could not finish it
        report["finished"] = finish_if_done(stores) or keys.rotation() is None
    report.update(from_version=rot.from_version, to_version=rot.to_version, resumed=resumed)
    return report


def _reseal_at_rest(stores: Any, version: int) -> dict[str, Any]:
    """Reseal under `version` every profile that no run holds; the held ones are pending."""
    resealed: list[str] = []
    pending: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    run = rotation_run(version)
    for key, _old in _off_version(stores, version):
        got = stores.lease.try_acquire(key, run)
        if not isinstance(got, Granted):
            stores.lease.release(key, run)          # out of the queue: its run's end reseals it
            pending.append({"profile": key.name, "scope": key.scope, "leased_by": got.holder_run,
                            **({"leased_on": got.holder_host} if got.holder_host else {})})
            continue
        try:
            before, after = stores.store.rekey(key)
            if before != after and not audited(stores.store):
                stores.audit.record("profile_rekeyed", scope=key.scope, profile=key.name, run=run,
                                    from_version=before, to_version=after)
            resealed.append(key.name)
        except (ProfileError, OSError) as exc:
            log.error("key rotation: profile %s could not be resealed (%s); it stays under its "
                      "version and opens as before", key, exc)
            failed.append({"profile": key.name, "scope": key.scope, "error": str(exc)})
        finally:
            stores.lease.release(key, run)
        if len(resealed) == 1:
            _pause("resealed-one")
    return {"resealed": resealed, "pending": pending, "failed": failed}


def _finish(stores: Any, version: int) -> bool:
    """Under the key state's lock: finish the rotation to `version` when no profile is left on
    an older version. True when it is finished (now or before)."""
    rot = stores.keys.rotation()
    if rot is None or rot.to_version != version:
        return True
    if not rot.switched or _off_version(stores, version):
        return False
    stores.audit.finish_rotation(version, profiles=len(_profiles(stores)))
    log.info("key rotation to version %d finished", version)
    return True


def finish_if_done(stores: Any, wait: float = 0.0) -> bool:
    """After a reseal: finish a rotation under way when nothing is left on an older version.
    False when none is under way, something is left, or a rotation holds the lock: it looks
    again once it let the lock go, so a run's end never waits for it."""
    rot = stores.keys.rotation()
    if rot is None or not rot.switched:
        return False
    try:
        with stores.keys.locked(wait):
            return _finish(stores, rot.to_version)
    except KeysBusy:
        return False


def close_profile(stores: Any, key: ProfileKey, run: str | None = None, *,
                  save: bool = True) -> ProfileInfo:
    """End of a lease: `store.close` (a reseal under the current key version unless `save`
    is False); a profile that moved to a new version is recorded (`profile_rekeyed`, by the
    store itself when it audits its changes) and a rotation waiting only for it is finished."""
    before = None
    if save:
        with swallowed(log, f"profile {key}: reading its key version", (ProfileError, OSError)):
            before = stores.store.key_version(key)
    info = stores.store.close(key, save=save)
    if before is None:
        return info
    with swallowed(log, f"profile {key}: recording its new key version", (ProfileError, OSError)):
        after = stores.store.key_version(key)
        if after != before and not audited(stores.store):
            fields: dict[str, Any] = {"run": run} if run else {}
            stores.audit.record("profile_rekeyed", scope=key.scope, profile=key.name,
                                from_version=before, to_version=after, **fields)
        if after != before:
            finish_if_done(stores)
    return info


def retire(stores: Any, version: int) -> dict[str, Any]:
    """Drop key version `version` when no profile's sealed copy uses it: {"retired": True}, or
    {"retired": False, "users": [...]} naming each profile that does (and the run that holds
    it). KeyStateError for the current version, a rotation's new one, or one not live."""
    version = check_version(version)
    keys = stores.keys
    with keys.locked(LOCK_WAIT_S):
        known = {v.version: v for v in keys.versions()}
        if version not in known or known[version].state == "retired":
            raise KeyStateError(f"key version {version} is not a live version of this store "
                                f"(versions: {', '.join(str(v) for v in sorted(known)) or 'none'})")
        if known[version].state in ("current", "prepared"):
            raise KeyStateError(f"key version {version} is the {known[version].state} one: rotate "
                                "first (`sfguard keys rotate`), then retire the old version")
        users = [{"profile": key.name, "scope": key.scope, **_holder(stores, key)}
                 for key, v in _off_version(stores, keys.current_version()) if v == version]
        if users:
            return {"retired": False, "version": version, "users": users}
        rekey_anchor = getattr(stores.audit, "rekey_anchor", None)
        if rekey_anchor is not None:
            rekey_anchor(version)
        stores.audit.record("key_retired", version=version)
        keys.retire_version(version, stores.store.scopes())
    log.info("key version %d retired", version)
    return {"retired": True, "version": version, "users": []}


def key_status(stores: Any, read_only: bool = True) -> dict[str, Any]:
    """Versions (state, where, created, retired, held here), how many profiles and audit
    segments and records each covers, and the rotation under way with what it waits for."""
    keys = stores.keys
    current = keys.current_version()
    profiles: dict[int, list[dict[str, Any]]] = {}
    for key in _profiles(stores):
        try:
            v = stores.store.key_version(key)
        except ProfileError:
            continue
        profiles.setdefault(v, []).append({"profile": key.name, "scope": key.scope,
                                           **_holder(stores, key, read_only)})
    coverage = stores.audit.key_coverage()
    versions = [{"version": v.version, "state": v.state, "where": v.where, "created": v.created,
                 "retired": v.retired, "available": v.available,
                 "profiles": len(profiles.get(v.version, [])),
                 "audit_segments": coverage.get(v.version, {}).get("segments", 0),
                 "audit_records": coverage.get(v.version, {}).get("records", 0)}
                for v in keys.versions()]
    rot = keys.rotation()
    remaining = [{**p, "version": v} for v, ps in sorted(profiles.items()) if v != current for p in ps]
    return {"current": current, "key_provider": keys.describe(), "versions": versions,
            "rotation": None if rot is None else {
                "from_version": rot.from_version, "to_version": rot.to_version,
                "started": rot.started, "switched": rot.switched, "remaining": remaining},
            "old_profiles": remaining}
