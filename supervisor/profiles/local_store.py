"""Profiles at rest: names, pipeline identities and the local ProfileStore.

Layout (all path building for profiles lives in this module)::

    <home>/profiles/<scope>/<name>/profile.sealed   the sealed profile (0600)
    <home>/profiles/<scope>/<name>/meta.json        created / last_used (0600)
    <runtime>/profiles/<scope>/<name>/              unsealed working copy while leased (0700)

`<home>` is the guard home (`--home`, `$SFGUARD_HOME`, `~/.stageflow/guard`), never the
project or the current directory; `<runtime>` is `sfguard.supervisor.home.runtime_dir(home)` (prefers
`$XDG_RUNTIME_DIR`). Every folder is 0700 and every file 0600.

The scope is set by the guard (`LOCAL_SCOPE` = "local" on one machine), never by a request.
Names are validated by `ProfileKey` (see protocols.validate_name), so a name is never a path.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from sfguard.supervisor.home import atomic_write, ensure_home, private_dir, prune_empty, runtime_path
from sfguard.supervisor.profiles import sealing
from sfguard.supervisor.protocols import (
    LOCAL_SCOPE,
    KeyProvider,
    ProfileBusy,
    ProfileExists,
    ProfileInfo,
    ProfileKey,
    ProfileNameError,
    ProfileNotFound,
    validate_name,
)

SEALED_FILE = "profile.sealed"
META_FILE = "meta.json"

__all__ = ["LOCAL_SCOPE", "ProfileKey", "validate_name", "normalise_pipeline_path",
           "pipeline_profile_name", "LocalProfileStore"]


def normalise_pipeline_path(path: str | os.PathLike) -> str:
    """The normalised form of a pipeline file path, used for its profile identity.

    Normalisation: made absolute against the current directory (`os.path.abspath`), symlinks
    resolved (`os.path.realpath`), then `os.path.normpath` (no '.', '..' or doubled '/').
    No user expansion ('~' is a literal folder name) and no case folding.
    """
    return os.path.normpath(os.path.realpath(os.path.abspath(os.fspath(path))))


def pipeline_profile_name(path: str | os.PathLike) -> str:
    """`pipeline-` + the first 16 hex digits of sha256("workflow" NUL normalised path).

    Every run of one pipeline shares one login; two pipelines never do (the identity depends
    only on the normalised path: not on the user, run, schedule or any caller label).
    """
    norm = normalise_pipeline_path(path)
    digest = hashlib.sha256(b"workflow\0" + os.fsencode(norm)).hexdigest()[:16]
    return validate_name(f"pipeline-{digest}")


def working_copies(runtime: Path) -> list[ProfileKey]:
    """The profiles with a working copy under `runtime`/profiles/<scope>/<name> (every store
    unseals there on this host); folders that are no valid key are skipped."""
    root = runtime / "profiles"
    out = []
    if root.is_dir():
        for scope in sorted(os.listdir(root)):
            for name in sorted(os.listdir(root / scope)):
                try:
                    out.append(ProfileKey(scope, name))
                except ProfileNameError:
                    continue
    return out


class LocalProfileStore:
    """ProfileStore on the local disk, sealed with keys from a KeyProvider."""

    def __init__(self, home: Path, keys: KeyProvider, runtime: Path | None = None):
        self.home = ensure_home(home)
        self.keys = keys
        self._runtime = Path(runtime) if runtime is not None else None

    # ----------------------------------------------------------------- paths (only here)
    def _scope_dir(self, scope: str) -> Path:
        return self.home / "profiles" / validate_name(scope, "scope")

    def _profile_dir(self, key: ProfileKey) -> Path:
        return self._scope_dir(key.scope) / key.name

    def _runtime_root(self) -> Path:
        """The runtime folder's path; only `open` and `create` create it (readers never do)."""
        return self._runtime if self._runtime is not None else runtime_path(self.home)

    def _prune_runtime(self, folder: Path) -> None:
        """After a working copy is gone: drop the empty folders above it, up to the runtime
        root of a store without a guard (a guard's root holds its sockets and stays)."""
        if self._runtime is None:
            prune_empty(folder, self._runtime_root())

    def _runtime_scope_dir(self, scope: str) -> Path:
        return self._runtime_root() / "profiles" / validate_name(scope, "scope")

    def _unsealed_dir(self, key: ProfileKey) -> Path:
        return self._runtime_scope_dir(key.scope) / key.name

    # ----------------------------------------------------------------- helpers
    def _meta(self, key: ProfileKey) -> dict:
        try:
            data = json.loads((self._profile_dir(key) / META_FILE).read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_meta(self, key: ProfileKey, meta: dict) -> None:
        atomic_write(self._profile_dir(key) / META_FILE, json.dumps(meta, sort_keys=True).encode())

    def _require(self, key: ProfileKey) -> Path:
        sealed = self._profile_dir(key) / SEALED_FILE
        if not sealed.is_file() or sealed.is_symlink():
            raise ProfileNotFound(f"no profile {key.name!r} in scope {key.scope!r}")
        return sealed

    def _seal_from(self, key: ProfileKey, src: Path) -> None:
        folder = private_dir(self._profile_dir(key))
        # Temp files of a seal that crashed before its rename (the lease serialises sealing
        # of one profile, so none of these belongs to a seal still running).
        for stale in folder.glob(f".{SEALED_FILE}.*.tmp"):
            stale.unlink(missing_ok=True)
        version, scope_key = self.keys.current_key(key.scope)
        sealing.seal_dir(src, folder / SEALED_FILE, scope_key, key.scope, key.name, key_version=version)

    def _key_lookup(self, scope: str) -> sealing.KeyLookup:
        """The scope's key of whichever version a sealed file names."""
        return lambda version: self.keys.get_key(scope, create=False, version=version)

    # ----------------------------------------------------------------- ProfileStore
    def exists(self, key: ProfileKey) -> bool:
        sealed = self._profile_dir(key) / SEALED_FILE
        return sealed.is_file() and not sealed.is_symlink()

    def create(self, key: ProfileKey, identity: str | None = None) -> ProfileInfo:
        """Create an empty sealed profile; ProfileExists if the name is taken in that scope.
        `identity`: the workflow identity it was made for (`pipeline-<hash>`), kept in its
        meta.json."""
        if identity is not None:
            validate_name(identity, "profile identity")
        if self.exists(key):
            raise ProfileExists(f"profile {key.name!r} already exists in scope {key.scope!r}")
        private_dir(self.home / "profiles")
        private_dir(self._scope_dir(key.scope))
        private_dir(self._profile_dir(key))
        empty = private_dir(self._runtime_root()) / f".empty-{os.getpid()}-{time.monotonic_ns()}"
        empty.mkdir(mode=0o700)
        try:
            self._seal_from(key, empty)
        finally:
            shutil.rmtree(empty, ignore_errors=True)
            self._prune_runtime(self._runtime_root())
        meta: dict[str, object] = {"created": time.time(), "last_used": None}
        if identity is not None:
            meta["identity"] = identity
        self._write_meta(key, meta)
        return self.info(key)

    def info(self, key: ProfileKey) -> ProfileInfo:
        sealed = self._require(key)
        meta = self._meta(key)
        st = sealed.stat()
        return ProfileInfo(key=key, created=float(meta.get("created") or st.st_mtime),
                           last_used=meta.get("last_used"), size=st.st_size,
                           unsealed=os.path.isdir(self._unsealed_dir(key)),
                           identity=meta.get("identity") if isinstance(meta.get("identity"), str)
                           else None)

    def list(self, scope: str) -> list[ProfileInfo]:
        folder = self._scope_dir(scope)
        out = []
        if folder.is_dir():
            for entry in sorted(os.listdir(folder)):
                try:
                    key = ProfileKey(scope, entry)
                except ProfileNameError:
                    continue                       # stray temp files and foreign entries
                if self.exists(key):
                    out.append(self.info(key))
        return out

    def open(self, key: ProfileKey) -> Path:
        """Unseal for a lease into the private runtime folder and return that folder.

        ProfileBusy if it is already unsealed (a lease has it); SealError if the sealed file
        fails verification (nothing is left unsealed then).
        """
        sealed = self._require(key)
        dest = self._unsealed_dir(key)
        if os.path.lexists(dest):
            raise ProfileBusy(f"profile {key.name!r} is already open")
        private_dir(self._runtime_root())
        private_dir(self._runtime_root() / "profiles")
        private_dir(self._runtime_scope_dir(key.scope))
        opened = False
        try:
            sealing.unseal_to(sealed, dest, self._key_lookup(key.scope), key.scope, key.name)
            opened = True
        finally:
            if not opened:
                self._prune_runtime(dest.parent)
        return dest

    def save(self, key: ProfileKey) -> ProfileInfo:
        """Reseal the open working copy atomically and keep it open."""
        src = self._unsealed_dir(key)
        self._require(key)
        if not src.is_dir():
            raise ProfileNotFound(f"profile {key.name!r} is not open")
        self._seal_from(key, src)
        meta = self._meta(key)
        meta["last_used"] = time.time()
        self._write_meta(key, meta)
        return self.info(key)

    def close(self, key: ProfileKey, *, save: bool = True) -> ProfileInfo:
        """End of lease: reseal (unless `save=False`) and remove the unsealed working copy."""
        src = self._unsealed_dir(key)
        if save and src.is_dir():
            self.save(key)
        shutil.rmtree(src, ignore_errors=True)
        self._prune_runtime(src.parent)
        return self.info(key)

    def delete(self, key: ProfileKey) -> None:
        """Delete the sealed profile. ProfileBusy while it is unsealed (leased)."""
        self._require(key)
        if os.path.lexists(self._unsealed_dir(key)):
            raise ProfileBusy(f"profile {key.name!r} is open (leased): close it first")
        shutil.rmtree(self._profile_dir(key))

    def delete_scope(self, scope: str) -> builtins.list[ProfileKey]:
        """Delete every profile of `scope` (sealed and unsealed copies) and the scope's key."""
        removed = [info.key for info in self.list(scope)]
        shutil.rmtree(self._scope_dir(scope), ignore_errors=True)
        shutil.rmtree(self._runtime_scope_dir(scope), ignore_errors=True)
        self._prune_runtime(self._runtime_root() / "profiles")
        self.keys.delete_key(scope)
        return removed

    def verify(self, key: ProfileKey) -> None:
        """Authenticate every chunk of the sealed file without unsealing it (start-up check);
        raises SealError (a ProfileError) naming what is wrong, ProfileNotFound if absent."""
        sealing.verify_sealed(self._require(key), self._key_lookup(key.scope), key.scope, key.name)

    def scopes(self) -> builtins.list[str]:
        """The scopes with a folder of profiles in this home."""
        root = self.home / "profiles"
        if not root.is_dir():
            return []
        out = []
        for entry in sorted(os.listdir(root)):
            try:
                out.append(validate_name(entry, "scope"))
            except ProfileNameError:
                continue
        return out

    def key_version(self, key: ProfileKey) -> int:
        """The key version that sealed the profile's sealed copy (its header says)."""
        return sealing.key_version_of(self._require(key), key.scope, key.name)

    def rekey(self, key: ProfileKey) -> tuple[int, int]:
        """Seal the sealed copy again under the current key version, in place and atomically
        (the caller holds the profile's lease): (the version before, the version now). A copy
        already under the current version is left as it is."""
        sealed = self._require(key)
        version, scope_key = self.keys.current_key(key.scope)
        before = sealing.key_version_of(sealed, key.scope, key.name)
        if before == version:
            return before, version
        for stale in sealed.parent.glob(f".{SEALED_FILE}.*.tmp"):
            stale.unlink(missing_ok=True)
        sealing.reseal(sealed, sealed, self._key_lookup(key.scope), scope_key, version,
                       key.scope, key.name)
        return before, version

    def unsealed(self) -> builtins.list[ProfileKey]:
        """Profiles with an unsealed working copy (after a crash: for the start-up sweep)."""
        return working_copies(self._runtime_root())
