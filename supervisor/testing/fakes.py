"""In-memory fakes of the profile seams, for contract suites and daemon tests (test support:
nothing in the product imports `sfguard.supervisor.testing`).

- `FakeKeyProvider`: keys in a dict.
- `FakeProfileStore`: two (or more) fixed scopes; sealed profiles are dicts of
  {relative path: bytes} kept in memory; `open` materialises a private temp folder.
- `FakeProfileLease`: the lease algorithm of `sfguard.supervisor.profiles.lease_fifo` (the one the local lease
  runs) over states kept in a dict; several "processes" share one `FakeLeaseState` through
  `for_process(owner)`, and `kill(owner)` marks one dead.
- `FakeAuditSink`: records in a list, same event/field validation and hash chain as the
  local sink.

They follow the same contracts as the local implementations (tests/profiles runs one suite
against both), so the daemon can be tested without touching the disk layout.
"""
from __future__ import annotations

import builtins
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfguard.supervisor.profiles import lease_fifo
from sfguard.supervisor.profiles.audit import (
    GENESIS,
    VerifyResult,
    canonical,
    chain_record,
    clean_fields,
    record_matches,
    walk_chain,
)
from sfguard.supervisor.profiles.keys import KeyMissing
from sfguard.supervisor.profiles.lease_fifo import LeaseState
from sfguard.supervisor.profiles.sealing import is_excluded
from sfguard.supervisor.protocols import (
    Granted,
    LeaseHolder,
    ProcessIdentity,
    ProfileBusy,
    ProfileExists,
    ProfileInfo,
    ProfileKey,
    ProfileNameError,
    ProfileNotFound,
    QueueEntry,
    Waiting,
    validate_name,
    validate_run_id,
)


class FakeKeyProvider:
    def __init__(self):
        self.keys: dict[str, bytes] = {}

    def get_key(self, scope: str, *, create: bool = True) -> bytes:
        validate_name(scope, "scope")
        if scope not in self.keys:
            if not create:
                raise KeyMissing(f"no key for scope {scope!r}")
            self.keys[scope] = secrets.token_bytes(32)
        return self.keys[scope]

    def delete_key(self, scope: str) -> bool:
        return self.keys.pop(scope, None) is not None

    def get_audit_key(self, *, create: bool = True) -> bytes | None:
        if "#audit" not in self.keys:
            if not create:
                return None
            self.keys["#audit"] = secrets.token_bytes(32)
        return self.keys["#audit"]

    def describe(self) -> str:
        return "in-memory keys (test fake)"


@dataclass
class _FakeProfile:
    files: dict[str, bytes]
    created: float
    key_id: bytes                       # the scope key it was "sealed" with
    last_used: float | None = None
    identity: str | None = None


class FakeProfileStore:
    """ProfileStore in memory with a fixed set of scopes (default "alpha" and "beta")."""

    def __init__(self, scopes: tuple[str, ...] = ("alpha", "beta"), keys: FakeKeyProvider | None = None):
        self.scopes = tuple(validate_name(s, "scope") for s in scopes)
        self.keys = keys or FakeKeyProvider()
        self._profiles: dict[ProfileKey, _FakeProfile] = {}
        self._open: dict[ProfileKey, Path] = {}
        # removed when the store is garbage-collected or the interpreter exits (test runs
        # left one folder per store in /tmp)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="sfg-fake-store-")
        self._tmp = Path(self._tmpdir.name)

    def _check_scope(self, scope: str) -> None:
        if scope not in self.scopes:
            raise ProfileNameError(f"unknown scope {scope!r}")

    def _get(self, key: ProfileKey) -> _FakeProfile:
        self._check_scope(key.scope)
        prof = self._profiles.get(key)
        if prof is None:
            raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
        if prof.key_id != self.keys.get_key(key.scope, create=False):
            raise ProfileNotFound(f"profile {key.name!r} cannot be opened (its scope key is gone)")
        return prof

    def _info(self, key: ProfileKey, prof: _FakeProfile) -> ProfileInfo:
        return ProfileInfo(key, prof.created, prof.last_used,
                           sum(len(v) for v in prof.files.values()), key in self._open,
                           prof.identity)

    def exists(self, key: ProfileKey) -> bool:
        self._check_scope(key.scope)
        return key in self._profiles

    def create(self, key: ProfileKey, identity: str | None = None) -> ProfileInfo:
        self._check_scope(key.scope)
        if identity is not None:
            validate_name(identity, "profile identity")
        if key in self._profiles:
            raise ProfileExists(f"profile {key.name!r} already exists in scope {key.scope!r}")
        self._profiles[key] = _FakeProfile({}, time.time(), self.keys.get_key(key.scope),
                                           identity=identity)
        return self.info(key)

    def info(self, key: ProfileKey) -> ProfileInfo:
        return self._info(key, self._get(key))

    def list(self, scope: str) -> list[ProfileInfo]:
        self._check_scope(scope)
        return [self._info(k, p) for k, p in sorted(self._profiles.items()) if k.scope == scope]

    def open(self, key: ProfileKey) -> Path:
        prof = self._get(key)
        if key in self._open:
            raise ProfileBusy(f"profile {key.name!r} is already open")
        dest = self._tmp / key.scope / key.name
        dest.mkdir(parents=True, mode=0o700)
        for rel, data in prof.files.items():
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_bytes(data)
            os.chmod(path, 0o600)
        self._open[key] = dest
        return dest

    def save(self, key: ProfileKey) -> ProfileInfo:
        prof = self._get(key)
        src = self._open.get(key)
        if src is None:
            raise ProfileNotFound(f"profile {key.name!r} is not open")
        files = {}
        for base, _dirs, names in os.walk(src):
            for n in names:
                full = Path(base) / n
                rel = full.relative_to(src).as_posix()
                if full.is_file() and not full.is_symlink() and not is_excluded(rel):
                    files[rel] = full.read_bytes()
        prof.files, prof.last_used = files, time.time()
        return self._info(key, prof)

    def close(self, key: ProfileKey, *, save: bool = True) -> ProfileInfo:
        if save and key in self._open:
            self.save(key)
        path = self._open.pop(key, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        return self.info(key)

    def delete(self, key: ProfileKey) -> None:
        self._get(key)
        if key in self._open:
            raise ProfileBusy(f"profile {key.name!r} is open (leased): close it first")
        del self._profiles[key]

    def delete_scope(self, scope: str) -> builtins.list[ProfileKey]:
        self._check_scope(scope)
        gone = sorted(k for k in self._profiles if k.scope == scope)
        for k in gone:
            del self._profiles[k]
            path = self._open.pop(k, None)
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
        self.keys.delete_key(scope)
        return gone

    def unsealed(self) -> builtins.list[ProfileKey]:
        return sorted(self._open)

    def verify(self, key: ProfileKey) -> None:
        """Like the local store's start-up check: absent, or sealed under a scope key that is
        gone, raises a ProfileError."""
        self._get(key)


@dataclass
class FakeLeaseState:
    """Shared by every FakeProfileLease view ("process") of one fake guard home."""
    leases: dict[ProfileKey, LeaseState] = field(default_factory=dict)
    dead: set[ProcessIdentity] = field(default_factory=set)
    next_pid: int = 1000


class FakeProfileLease:
    """ProfileLease in memory over the same algorithm as the local one (`lease_fifo`); the
    state of each profile sits in a dict. `for_process()` gives another "process" sharing it."""

    def __init__(self, state: FakeLeaseState | None = None, owner: ProcessIdentity | None = None):
        self.state = state or FakeLeaseState()
        if owner is None:
            self.state.next_pid += 1
            owner = ProcessIdentity(self.state.next_pid, 1.0)
        self.owner = owner

    def for_process(self, owner: ProcessIdentity | None = None) -> FakeProfileLease:
        return FakeProfileLease(self.state, owner)

    def kill(self, owner: ProcessIdentity | None = None) -> None:
        """Mark a "process" (default: this view's) as dead."""
        self.state.dead.add(owner or self.owner)

    def _live(self, key: ProfileKey) -> LeaseState:
        st = self.state.leases.setdefault(key, LeaseState())
        lease_fifo.drop_dead(st, lambda o: o not in self.state.dead)
        return st

    def try_acquire(self, key: ProfileKey, run: str) -> Granted | Waiting:
        validate_run_id(run)
        return lease_fifo.acquire(self._live(key), key, run, self.owner, time.time())

    def release(self, key: ProfileKey, run: str) -> bool:
        validate_run_id(run)
        return lease_fifo.release(self.state.leases.setdefault(key, LeaseState()), run)

    def release_all(self, run: str) -> list[ProfileKey]:
        validate_run_id(run)
        return [k for k in sorted(self.state.leases) if self.release(k, run)]

    def has_state(self, key: ProfileKey) -> bool:
        return key in self.state.leases

    def holder(self, key: ProfileKey) -> LeaseHolder | None:
        return self._live(key).holder

    def queue(self, key: ProfileKey) -> list[QueueEntry]:
        return list(self._live(key).queue)

    def sweep_stale(self) -> list[tuple[ProfileKey, str]]:
        dead = self.state.dead
        return [(k, run) for k in sorted(self.state.leases)
                for run in lease_fifo.drop_dead(self.state.leases[k], lambda o: o not in dead)]


class FakeAuditSink:
    """AuditSink in memory with the local sink's validation and hash chain."""

    def __init__(self):
        self.entries: list[dict[str, Any]] = []
        self.key = secrets.token_bytes(32)

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        clean = clean_fields(event, fields)
        seq, last = (self.entries[-1]["seq"], self.entries[-1]["hash"]) if self.entries else (0, GENESIS)
        rec = chain_record(self.key, seq, last, event, clean)
        self.entries.append(rec)
        return rec

    def verify(self) -> VerifyResult:
        """The local sink's chain walk over the records in memory (hash, link, MAC)."""
        walked = walk_chain(((n, canonical(r) + b"\n") for n, r in enumerate(self.entries, 1)), self.key)
        return walked if isinstance(walked, VerifyResult) else VerifyResult(True, walked.count)

    def records(self, *, profile: str | None = None, run: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.entries if record_matches(r, profile, run)]
