"""The seams of the guard: value types and Protocols that a hosted service could implement.

Everything the daemon does with a profile goes through these four interfaces:

- `ProfileStore`: where profiles rest (sealed) and where a leased one is unsealed.
- `ProfileLease`: which run may use a profile right now, and who waits for it (FIFO).
- `KeyProvider`: the per-scope key that seals a scope's profiles.
- `AuditSink`: the append-only, hash-chained record of who did what.

Local implementations live in `profiles.py`, `lease.py`, `keys.py` and `audit.py`; in-memory
fakes (two scopes) in `supervisor/testing/`. The `BrowserHost` and `Handoff` Protocols live next
to their value types, in browsers/host.py and browsers/handoff.py (this module imports no room);
so does `ConsoleView`, what the operator console reaches of the guard, in console/view.py.

A profile is addressed by a `ProfileKey` (scope + name). The scope is always set by the guard
(locally the fixed value `LOCAL_SCOPE`), never by a request body or YAML; names are validated
here, at the edge, so that a name can never be a path.
"""
from __future__ import annotations

import builtins
import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sfguard.errors import SfguardError

# --------------------------------------------------------------------------- names and keys

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN, re.ASCII)
LOCAL_SCOPE = "local"


class ProfileError(SfguardError):
    """Base class of every profile error; messages never contain secrets or paths of secrets."""


class ProfileNameError(ProfileError):
    """A profile name or scope that is not allowed (it could be a path, or is malformed)."""


class ProfileNotFound(ProfileError):
    """No profile of that name in that scope."""


class ProfileExists(ProfileError):
    """`create` of a name that is already taken in that scope."""


class ProfileBusy(ProfileError):
    """The profile is unsealed (open) or leased, so the operation is refused."""


class StoreUnavailable(ProfileError, OSError):
    """A shared store (database) cannot be reached right now; the message names it without
    any secret. Treated like an I/O failure; a run waiting for a grant keeps waiting."""


def validate_name(value: object, what: str = "profile name") -> str:
    """Return `value` if it matches `^[a-z0-9][a-z0-9_-]{0,63}$`, else raise ProfileNameError.

    `re.ASCII` plus `fullmatch` mean no Unicode look-alikes (Cyrillic 'а', fullwidth letters),
    no trailing newline, no NUL, no '/', no '..', no absolute path gets through.
    """
    if not isinstance(value, str):
        raise ProfileNameError(f"{what} must be a string, not {type(value).__name__}")
    if not _NAME_RE.fullmatch(value):
        shown = ascii(value) if len(value) <= 80 else ascii(value[:80]) + "..."
        raise ProfileNameError(
            f"invalid {what} {shown}: use 1-64 characters a-z, 0-9, '_' or '-', "
            "starting with a letter or digit (never a path)")
    return value


@dataclass(frozen=True, order=True)
class ProfileKey:
    """The identity of a profile: owner scope + name. Both validated on construction."""
    scope: str
    name: str

    def __post_init__(self) -> None:
        validate_name(self.scope, "scope")
        validate_name(self.name, "profile name")

    def __str__(self) -> str:
        return f"{self.scope}/{self.name}"


@dataclass(frozen=True)
class ProfileInfo:
    """What `ProfileStore.info/list` report about a profile (no paths, no secrets)."""
    key: ProfileKey
    created: float                 # unix time
    last_used: float | None        # unix time of the last reseal after a lease, None if never
    size: int                      # bytes of the sealed file
    unsealed: bool                 # an unsealed working copy exists (a lease has it open)
    identity: str | None = None    # the workflow identity it was made for (`pipeline-<hash>`)


# --------------------------------------------------------------------------- lease values

@dataclass(frozen=True)
class ProcessIdentity:
    """A process, robust against pid reuse: pid plus its start time (psutil create_time)."""
    pid: int
    start_time: float


@dataclass(frozen=True)
class LeaseHolder:
    """The run holding a profile, and the guard process that granted it."""
    key: ProfileKey
    run: str
    since: float
    owner: ProcessIdentity
    host: str | None = None        # shared stores: the host and guard that granted it
    guard: str | None = None


@dataclass(frozen=True)
class QueueEntry:
    """A run waiting for a profile (FIFO by `seq`)."""
    run: str
    since: float
    seq: int
    owner: ProcessIdentity


@dataclass(frozen=True)
class Granted:
    """`try_acquire` result: the run holds the profile (`reentrant`: it already did)."""
    key: ProfileKey
    run: str
    since: float
    reentrant: bool = False
    granted: bool = field(default=True, init=False)


@dataclass(frozen=True)
class Waiting:
    """`try_acquire` result: the run is queued; `holder_run` None when the profile is free
    but earlier runs are ahead in the queue. `position` is 1 for the first waiter."""
    key: ProfileKey
    run: str
    holder_run: str | None
    holder_since: float | None
    position: int
    queued_since: float
    holder_host: str | None = None   # shared stores: where the holder runs
    holder_guard: str | None = None
    granted: bool = field(default=False, init=False)


RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
_RUN_RE = re.compile(RUN_ID_PATTERN, re.ASCII)


def validate_run_id(value: object) -> str:
    """Run ids are opaque tokens from the daemon; refuse anything that is not a plain token."""
    if not isinstance(value, str) or not _RUN_RE.fullmatch(value):
        raise ValueError(f"invalid run id {ascii(value)[:80]}: use 1-128 characters "
                         "A-Z a-z 0-9 _ . : - starting with a letter or digit")
    return value


# --------------------------------------------------------------------------- audit values

@dataclass(frozen=True)
class VerifyResult:
    """What `AuditSink.verify` found: intact, or the first bad record and why."""
    ok: bool
    records: int
    line: int | None = None        # 1-based line of the first bad record (in `segment`)
    reason: str | None = None
    segment: str | None = None     # the file of that line when it is not audit.log itself

    def __str__(self) -> str:
        if self.ok:
            return f"audit log intact: {self.records} record(s)"
        where = f"line {self.line}" if self.line else "log"
        if self.segment:
            where = f"{self.segment} {where}" if self.line else self.segment
        return f"audit log broken at {where}: {self.reason}"


# --------------------------------------------------------------------------- key versions

@dataclass(frozen=True)
class KeyVersion:
    """One version of the keys: every scope's sealing key and the audit chain's HMAC key,
    made together. Sealed profiles and audit records name their version (an id, never a key)."""
    version: int
    state: str                     # "current", "old", "prepared" (a rotation's, not yet current), "retired"
    where: str                     # where its material lives (keyring, key files, shared key file)
    created: float | None          # unix time; None for version 1 made before versions existed
    retired: float | None = None
    available: bool = True         # this host holds its material


@dataclass(frozen=True)
class Rotation:
    """A key rotation under way: from the version that was current to a new one. `switched`:
    the new version is current (the audit chain holds its `key_rotated` record)."""
    from_version: int
    to_version: int
    started: float
    switched: bool


# --------------------------------------------------------------------------- Protocols

@runtime_checkable
class ProfileStore(Protocol):
    """Where profiles rest sealed, and where a leased one is unsealed for a browser.

    All path building lives in the implementation; callers only pass `ProfileKey`s. `open`
    returns the unsealed working folder (private, 0700); `close` reseals it atomically
    (a crash mid-seal keeps the previous sealed copy) and removes the working folder.
    """

    def create(self, key: ProfileKey, identity: str | None = None) -> ProfileInfo: ...
    def exists(self, key: ProfileKey) -> bool: ...
    def info(self, key: ProfileKey) -> ProfileInfo: ...
    def list(self, scope: str) -> list[ProfileInfo]: ...
    def open(self, key: ProfileKey) -> Path: ...
    def save(self, key: ProfileKey) -> ProfileInfo: ...
    def close(self, key: ProfileKey, *, save: bool = True) -> ProfileInfo: ...
    def delete(self, key: ProfileKey) -> None: ...
    def delete_scope(self, scope: str) -> builtins.list[ProfileKey]: ...
    def unsealed(self) -> builtins.list[ProfileKey]: ...
    def verify(self, key: ProfileKey) -> None: ...   # the seal authenticates (start-up check)
    def scopes(self) -> builtins.list[str]: ...      # scopes that hold profiles
    def key_version(self, key: ProfileKey) -> int: ...   # the key version of the sealed copy
    def rekey(self, key: ProfileKey) -> tuple[int, int]: ...   # reseal at rest under the current version


@runtime_checkable
class ProfileLease(Protocol):
    """One run at a time per profile; other runs queue FIFO. Holds across processes."""

    def try_acquire(self, key: ProfileKey, run: str) -> Granted | Waiting: ...
    def release(self, key: ProfileKey, run: str) -> bool: ...
    def release_all(self, run: str) -> list[ProfileKey]: ...
    def holder(self, key: ProfileKey) -> LeaseHolder | None: ...
    def queue(self, key: ProfileKey) -> list[QueueEntry]: ...
    def sweep_stale(self) -> list[tuple[ProfileKey, str]]: ...


@runtime_checkable
class KeyProvider(Protocol):
    """Per-scope 32-byte keys. Deleting a scope's key makes its sealed data unreadable.
    `get_audit_key` is the audit chain's HMAC key, a key of its own (None: absent, not made).

    Keys come in versions (`KeyVersion`): one is current (new seals, new audit records), older
    ones are kept for reading until they are retired. `version=None` means the current one.
    A rotation (supervisor/profiles/rotation.py) prepares a new version, the audit sink makes
    it current together with the chain's `key_rotated` record, and ends it when every profile
    moved."""

    def get_key(self, scope: str, *, create: bool = True, version: int | None = None) -> bytes: ...
    def current_key(self, scope: str) -> tuple[int, bytes]: ...   # (current version, its key)
    def delete_key(self, scope: str) -> bool: ...                  # every version's
    def get_audit_key(self, *, create: bool = True, version: int | None = None) -> bytes | None: ...
    def describe(self) -> str: ...
    def current_version(self) -> int: ...
    def versions(self) -> list[KeyVersion]: ...
    def rotation(self) -> Rotation | None: ...
    def prepare_version(self, scopes: list[str]) -> Rotation: ...  # a new version, not yet current
    def set_current(self, version: int) -> None: ...
    def end_rotation(self, version: int) -> bool: ...              # True when it ended it now
    def retire_version(self, version: int, scopes: list[str]) -> None: ...
    def locked(self, wait: float = 0.0) -> contextlib.AbstractContextManager[None]: ...  # rotation, retirement


@runtime_checkable
class AuditSink(Protocol):
    """Append-only, hash-chained records (see audit.EVENTS for the allowed events).

    Each record is keyed by one key version (`kid`). `switch_key` makes a prepared version
    current and writes the chain's `key_rotated` record (keyed by the new version, with a MAC
    by the old one too) as one step; `finish_rotation` records `key_rotation_finished` and ends
    the rotation as one step; `key_coverage` counts segments and records per key version."""

    def record(self, event: str, **fields: Any) -> dict[str, Any]: ...
    def records(self, *, profile: str | None = None, run: str | None = None) -> list[dict[str, Any]]: ...
    def verify(self) -> VerifyResult: ...            # the whole chain (start-up check)
    def switch_key(self, version: int) -> None: ...
    def finish_rotation(self, version: int, **fields: Any) -> bool: ...
    def key_coverage(self) -> dict[int, dict[str, int]]: ...


__all__ = [
    "NAME_PATTERN", "LOCAL_SCOPE", "ProfileError", "ProfileNameError", "ProfileNotFound",
    "ProfileExists", "ProfileBusy", "StoreUnavailable", "validate_name", "ProfileKey", "ProfileInfo",
    "ProcessIdentity", "LeaseHolder", "QueueEntry", "Granted", "Waiting", "validate_run_id",
    "VerifyResult", "KeyVersion", "Rotation", "ProfileStore", "ProfileLease", "KeyProvider", "AuditSink",
]

