"""In-memory fakes of the profile seams, for contract suites and daemon tests (test support:
nothing in the product imports `sfguard.supervisor.testing`).

- `FakeKeyProvider`: keys in a dict, per key version; the version rules of the local
  providers (key_versions.LocalVersions) over a state kept in memory.
- `FakeProfileStore`: two (or more) fixed scopes; sealed profiles are dicts of
  {relative path: bytes} kept in memory; `open` materialises a private temp folder.
- `FakeProfileLease`: the lease algorithm of `sfguard.supervisor.profiles.lease_fifo` (the one the local lease
  runs) over states kept in a dict; several "processes" share one `FakeLeaseState` through
  `for_process(owner)`, and `kill(owner)` marks one dead.
- `FakeAuditSink`: records in a list, same event/field validation, hash chain and key
  versions as the local sink (given the FakeKeyProvider; without one, a key of its own).

They follow the same contracts as the local implementations (tests/profiles runs one suite
against both), so the daemon can be tested without touching the disk layout.
"""
from __future__ import annotations

import builtins
import contextlib
import copy
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfguard.supervisor.profiles import lease_fifo
from sfguard.supervisor.profiles.audit import (
    GENESIS,
    VerifyResult,
    canonical,
    chain_record,
    check_head,
    clean_fields,
    head_mac,
    record_kid,
    record_matches,
    walk_chain,
)
from sfguard.supervisor.profiles.audit_chain import ChainKeys, tie_record
from sfguard.supervisor.profiles.key_versions import KeyState, KeyStateError, LocalVersions
from sfguard.supervisor.profiles.keys import KeyMissing, KeyVersionMissing
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


class FakeKeyProvider(LocalVersions):
    """Keys in a dict {(version, scope): key}; "#audit" is the audit key's scope."""

    def __init__(self):
        self.keys: dict[tuple[int, str], bytes] = {}
        self._state = KeyState()
        self._lock = threading.Lock()

    def state(self) -> KeyState:
        return copy.deepcopy(self._state)

    def _save(self, state: KeyState) -> None:
        self._state = copy.deepcopy(state)

    @contextlib.contextmanager
    def locked(self, wait: float = 0.0) -> Iterator[None]:
        with self._lock:
            yield

    def _version(self, version: int | None) -> int:
        try:
            return self._usable(version)[1]
        except KeyStateError as exc:
            raise KeyVersionMissing(str(exc)) from None

    def _get(self, name: str, create: bool, version: int | None) -> bytes | None:
        v = self._version(version)
        if (v, name) not in self.keys:
            if not create:
                return None
            self.keys[(v, name)] = secrets.token_bytes(32)
        return self.keys[(v, name)]

    def get_key(self, scope: str, *, create: bool = True, version: int | None = None) -> bytes:
        validate_name(scope, "scope")
        key = self._get(scope, create, version)
        if key is None:
            raise KeyMissing(f"no key for scope {scope!r}")
        return key

    def current_key(self, scope: str) -> tuple[int, bytes]:
        v = self.current_version()
        return v, self.get_key(scope, version=v)

    def delete_key(self, scope: str) -> bool:
        gone = [k for k in self.keys if k[1] == scope]
        for k in gone:
            del self.keys[k]
        return bool(gone)

    def get_audit_key(self, *, create: bool = True, version: int | None = None) -> bytes | None:
        return self._get("#audit", create, version)

    def describe(self) -> str:
        return "in-memory keys (test fake)"

    def _where(self, version: int) -> str:
        return f"in-memory keys, version {version} (test fake)"

    def _has_material(self, version: int) -> bool:
        return version == 1 or (version, "#audit") in self.keys

    def _make_material(self, version: int, scopes: list[str]) -> None:
        for name in ("#audit", *scopes):
            self.keys.setdefault((version, name), secrets.token_bytes(32))

    def _drop_material(self, version: int, scopes: list[str]) -> None:
        for k in [k for k in self.keys if k[0] == version]:
            del self.keys[k]


@dataclass
class _FakeProfile:
    files: dict[str, bytes]
    created: float
    key_id: bytes                       # the scope key it was "sealed" with
    last_used: float | None = None
    identity: str | None = None
    version: int = 1                    # the key version of that key


class FakeProfileStore:
    """ProfileStore in memory with a fixed set of scopes (default "alpha" and "beta")."""

    def __init__(self, scopes: tuple[str, ...] = ("alpha", "beta"), keys: FakeKeyProvider | None = None):
        self.known_scopes = tuple(validate_name(s, "scope") for s in scopes)
        self.keys = keys or FakeKeyProvider()
        self._profiles: dict[ProfileKey, _FakeProfile] = {}
        self._open: dict[ProfileKey, Path] = {}
        # removed when the store is garbage-collected or the interpreter exits (test runs
        # left one folder per store in /tmp)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="sfg-fake-store-")
        self._tmp = Path(self._tmpdir.name)

    def _check_scope(self, scope: str) -> None:
        if scope not in self.known_scopes:
            raise ProfileNameError(f"unknown scope {scope!r}")

    def _get(self, key: ProfileKey) -> _FakeProfile:
        self._check_scope(key.scope)
        prof = self._profiles.get(key)
        if prof is None:
            raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
        if prof.key_id != self.keys.get_key(key.scope, create=False, version=prof.version):
            raise ProfileNotFound(f"profile {key.name!r} cannot be opened (its scope key is gone)")
        return prof

    def _seal(self, prof: _FakeProfile, scope: str) -> None:
        prof.version, prof.key_id = self.keys.current_key(scope)

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
        version, scope_key = self.keys.current_key(key.scope)
        self._profiles[key] = _FakeProfile({}, time.time(), scope_key, identity=identity,
                                           version=version)
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
        self._seal(prof, key.scope)
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

    def scopes(self) -> builtins.list[str]:
        return sorted({k.scope for k in self._profiles})

    def key_version(self, key: ProfileKey) -> int:
        return self._get(key).version

    def rekey(self, key: ProfileKey) -> tuple[int, int]:
        prof = self._get(key)
        before = prof.version
        self._seal(prof, key.scope)
        return before, prof.version


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
    """AuditSink in memory with the local sink's validation, hash chain and key versions."""

    def __init__(self, keys: FakeKeyProvider | None = None):
        self.entries: list[dict[str, Any]] = []
        self.keys = keys
        self.key = secrets.token_bytes(32) if keys is None else None
        self.head: tuple[int, str, str | None] | None = None

    def _key(self, version: int, create: bool = False) -> bytes | None:
        if self.keys is None:
            return self.key
        try:
            return self.keys.get_audit_key(create=create, version=version)
        except KeyVersionMissing:
            return None

    def _current(self) -> int:
        return 1 if self.keys is None else self.keys.current_version()

    def _last_kid(self) -> int | None:
        return record_kid(self.entries[-1]) if self.entries else None

    def _append(self, event: str, clean: dict[str, Any], kid: int) -> dict[str, Any]:
        seq, last = (self.entries[-1]["seq"], self.entries[-1]["hash"]) if self.entries else (0, GENESIS)
        if event == "key_rotated":
            rec = tie_record(lambda v: self._key(v, v == kid), seq, last, clean["from_version"], kid)
        else:
            key = self._key(kid, True)
            assert key is not None
            rec = chain_record(key, seq, last, event, clean, kid=kid)
        self.entries.append(rec)
        key = self._key(kid)
        assert key is not None
        self.head = (rec["seq"], rec["hash"], head_mac(key, rec["seq"], rec["hash"]))
        return rec

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        clean = clean_fields(event, fields)
        last_kid = self._last_kid()
        kid = max(self._current(), last_kid or 1)
        if last_kid is not None and last_kid < kid:
            self._append("key_rotated", {"from_version": last_kid, "to_version": kid}, kid)
        return self._append(event, clean, kid)

    def switch_key(self, version: int) -> None:
        assert self.keys is not None, "a FakeAuditSink without keys has one key version"
        last_kid = self._last_kid()
        if last_kid is not None and last_kid < version:
            self._append("key_rotated", {"from_version": last_kid, "to_version": version}, version)
        self.keys.set_current(version)

    def finish_rotation(self, version: int, **fields: Any) -> bool:
        assert self.keys is not None
        rot = self.keys.rotation()
        if rot is None or rot.to_version != version or not rot.switched:
            return False
        self.record("key_rotation_finished", to_version=version, **fields)
        return self.keys.end_rotation(version)

    def key_coverage(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for rec in self.entries:
            kid = record_kid(rec) or 1
            out.setdefault(kid, {"segments": 1, "records": 0})["records"] += 1
        return out

    def chain_keys(self) -> ChainKeys:
        if self.keys is None:
            return ChainKeys.of(self.key)
        retired = frozenset(v.version for v in self.keys.versions() if v.state == "retired")
        return ChainKeys(lambda v: None if v in retired else self._key(v), retired, self._current())

    def verify(self) -> VerifyResult:
        """The local sink's chain walk over the records in memory (hash, link, MAC, versions)."""
        keys = self.chain_keys()
        walked = walk_chain(((n, canonical(r) + b"\n") for n, r in enumerate(self.entries, 1)), keys)
        if isinstance(walked, VerifyResult) or self.head is None:
            return walked if isinstance(walked, VerifyResult) else VerifyResult(True, walked.count)
        return check_head(walked, self.head, keys, "head")

    def records(self, *, profile: str | None = None, run: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.entries if record_matches(r, profile, run)]
