"""Key versions of the local providers: the state file `<home>/keys.json` and the rules over it.

The state names the current version, every version made (created, retired) and a rotation
under way; it holds no key. Without the file the home has one version, 1: the keys made before
versions existed (`<home>/keys/<scope>.key`, `audit.hmac`, or their keyring entries).

    {"current": 2,
     "versions": {"1": {"created": null, "retired": null}, "2": {"created": 1764..., "retired": null}},
     "rotation": {"from": 1, "to": 2, "started": 1764..., "switched": true}}

`LocalVersions` is what FileKeyProvider and KeyringKeyProvider (keys.py) share: they say where
a version's material lives and how it is made and dropped; the order of the steps is here.
Rotation and retirement take `locked()` (an flock on `<home>/keys.lock`) around their steps.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sfguard.supervisor.home import FILE_MODE, atomic_write
from sfguard.supervisor.protocols import KeyVersion, ProfileError, Rotation

STATE_FILE = "keys.json"
LOCK_FILE = "keys.lock"

__all__ = ["STATE_FILE", "LOCK_FILE", "KeyState", "KeyStateError", "KeysBusy", "LocalVersions",
           "check_version"]


class KeyStateError(ProfileError):
    """keys.json is damaged, or a step does not fit the key state (retiring the current version)."""


class KeysBusy(ProfileError):
    """Another rotation or retirement holds the key state's lock."""


def check_version(value: object) -> int:
    """A key version as given at the edge: a whole number from 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeyStateError("a key version is a whole number from 1")
    return value


class KeyState:
    """The parsed state: current version, versions {id: {created, retired}}, rotation."""

    def __init__(self, data: dict[str, Any] | None = None):
        data = data or {"current": 1, "versions": {"1": {"created": None, "retired": None}},
                        "rotation": None}
        try:
            self.current = check_version(data["current"])
            self.versions: dict[int, dict[str, float | None]] = {
                check_version(int(k)): {"created": v.get("created"), "retired": v.get("retired")}
                for k, v in data["versions"].items()}
            rot = data.get("rotation")
            self.rotation = None if rot is None else Rotation(
                check_version(rot["from"]), check_version(rot["to"]), float(rot["started"]),
                bool(rot["switched"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise KeyStateError(f"{STATE_FILE} is damaged: it must name the current key version "
                                "and the versions made; it was left as it is") from None
        if self.current not in self.versions:
            raise KeyStateError(f"{STATE_FILE} is damaged: the current version {self.current} is "
                                "not among its versions")

    def to_json(self) -> dict[str, Any]:
        rot = self.rotation
        return {"current": self.current,
                "versions": {str(k): v for k, v in sorted(self.versions.items())},
                "rotation": None if rot is None else {
                    "from": rot.from_version, "to": rot.to_version, "started": rot.started,
                    "switched": rot.switched}}

    def live(self) -> list[int]:
        return sorted(v for v, rec in self.versions.items() if rec.get("retired") is None)

    def state_of(self, version: int) -> str:
        rec = self.versions.get(version)
        if rec is None:
            return "unknown"
        if rec.get("retired") is not None:
            return "retired"
        if version == self.current:
            return "current"
        rot = self.rotation
        if rot is not None and rot.to_version == version and not rot.switched:
            return "prepared"
        return "old"


class LocalVersions:
    """The version steps of a provider whose state is `<home>/keys.json`. A subclass gives
    `home` and the material: `_make_material`, `_drop_material`, `_has_material`, `_where`."""

    home: Path

    def _make_material(self, version: int, scopes: list[str]) -> None:
        raise NotImplementedError

    def _drop_material(self, version: int, scopes: list[str]) -> None:
        raise NotImplementedError

    def _has_material(self, version: int) -> bool:
        raise NotImplementedError

    def _where(self, version: int) -> str:
        raise NotImplementedError

    # ----------------------------------------------------------------- the state file
    def state(self) -> KeyState:
        try:
            raw = (self.home / STATE_FILE).read_bytes()
        except FileNotFoundError:
            return KeyState()
        try:
            return KeyState(json.loads(raw))
        except ValueError:
            raise KeyStateError(f"{STATE_FILE} is damaged (not JSON); it was left as it is") from None

    def _save(self, state: KeyState) -> None:
        atomic_write(self.home / STATE_FILE, json.dumps(state.to_json(), sort_keys=True).encode() + b"\n",
                     FILE_MODE)

    @contextlib.contextmanager
    def locked(self, wait: float = 0.0) -> Iterator[None]:
        """The key state's lock (rotation, retirement) for this home; KeysBusy after `wait` s."""
        fd = os.open(self.home / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise KeysBusy("a key rotation or retirement is under way on this home "
                                       "(keys.lock is held); try again when it has finished") from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    # ----------------------------------------------------------------- KeyProvider
    def current_version(self) -> int:
        return self.state().current

    def rotation(self) -> Rotation | None:
        return self.state().rotation

    def versions(self) -> list[KeyVersion]:
        st = self.state()
        return [KeyVersion(v, st.state_of(v), self._where(v), rec.get("created"), rec.get("retired"),
                           rec.get("retired") is None and self._has_material(v))
                for v, rec in sorted(st.versions.items())]

    def _usable(self, version: int | None) -> tuple[KeyState, int]:
        """The state and the version asked for (None: the current one); KeyStateError for a
        version this home never made or has retired (subclasses turn it into KeyMissing)."""
        st = self.state()
        v = st.current if version is None else check_version(version)
        if v not in st.versions:
            raise KeyStateError(f"key version {v} was never made on this home")
        if st.versions[v].get("retired") is not None:
            raise KeyStateError(f"key version {v} was retired: its keys are gone")
        return st, v

    def prepare_version(self, scopes: list[str]) -> Rotation:
        """A new version's material and the rotation's intent (not yet current). A rotation
        prepared before and not switched is returned as it is (its material made again where
        a crash left it missing). The caller holds `locked()`."""
        st = self.state()
        rot = st.rotation
        if rot is not None and not rot.switched:
            self._make_material(rot.to_version, scopes)
            return rot
        if rot is not None:
            raise KeyStateError(f"the rotation to key version {rot.to_version} is still under way")
        new = max(st.versions) + 1
        # material a crash left before the state named it was never used: made afresh
        self._drop_material(new, scopes)
        self._make_material(new, scopes)
        st.versions[new] = {"created": time.time(), "retired": None}
        st.rotation = Rotation(st.current, new, time.time(), False)
        self._save(st)
        return st.rotation

    def set_current(self, version: int) -> None:
        """Make `version` current (the audit sink calls this right after the chain's
        `key_rotated` record); the rotation to it is then switched."""
        st, v = self._usable(version)
        st.current = v
        if st.rotation is not None and st.rotation.to_version == v:
            r = st.rotation
            st.rotation = Rotation(r.from_version, r.to_version, r.started, True)
        self._save(st)

    def end_rotation(self, version: int) -> bool:
        st = self.state()
        if st.rotation is None or st.rotation.to_version != version or not st.rotation.switched:
            return False
        st.rotation = None
        self._save(st)
        return True

    def retire_version(self, version: int, scopes: list[str]) -> None:
        """Drop a version's material and mark it retired (the caller checked nothing uses it)."""
        st, v = self._usable(version)
        if v == st.current:
            raise KeyStateError(f"key version {v} is the current one: it cannot be retired")
        if st.rotation is not None and v in (st.rotation.to_version,):
            raise KeyStateError(f"key version {v} is the new version of a rotation under way")
        self._drop_material(v, scopes)
        st.versions[v]["retired"] = time.time()
        self._save(st)
