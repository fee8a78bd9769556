"""Key providers: where the per-scope sealing keys live.

`default_key_provider(home)` prefers the system keyring (Secret Service, macOS Keychain, ...)
and falls back to 0600 key files in `<home>/keys/` when the machine has no keyring backend
(`keyring.get_keyring()` is the `fail` backend, as in containers and CI). `describe()` says
which one is in use; `sfguard profiles list` and `doctor` show it.

Each scope has its own random 32-byte key. Deleting a scope's key makes every sealed profile
of that scope unreadable, which is how `delete_scope` guarantees the data is gone even if a
copy of the sealed files survives somewhere.

Keys come in versions (key_versions.py keeps which is current in `<home>/keys.json`). Version
1 is where the keys always were (`<home>/keys/<scope>.key`, `keys/audit.hmac`; keyring users
`<tag>:<scope>`, `<tag>:#audit-chain`); version N > 1 lives beside it (`keys/vN/...`; keyring
users `<tag>:vN:<scope>`, `<tag>:vN:#audit-chain`).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from sfguard.supervisor.home import FILE_MODE, fsync_dir, private_dir
from sfguard.supervisor.profiles.key_versions import KeyStateError, LocalVersions
from sfguard.supervisor.protocols import ProfileError, validate_name

KEY_BYTES = 32
KEYRING_SERVICE = "sfguard"
#: The audit chain's HMAC key: a key of its own, never a scope's sealing key. Its file name and
#: keyring user cannot collide with a scope (scope names have no '.' and no '#').
AUDIT_KEY_FILE = "audit.hmac"
AUDIT_KEYRING_USER = "#audit-chain"


class KeyMissing(ProfileError):
    """A scope's key is missing, damaged or not private."""


class KeyVersionMissing(KeyMissing):
    """This host has not got a key version's material (it was never given, or was retired)."""


class KeyringRefused(ProfileError):
    """The system keyring would not answer (locked, its service away): the seam's own error, so
    that every caller that handles a key provider's failures handles this one too."""


def decode_key(raw: bytes | str, damaged: str) -> bytes:
    """A stored key (base64 of KEY_BYTES bytes) back to bytes; KeyMissing(`damaged`) if it is not."""
    try:
        key = base64.b64decode(raw, validate=True)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyMissing(damaged)
    return key


def _key_file(path: Path, what: str, create: bool) -> bytes | None:
    """The key in a 0600 file (base64 of KEY_BYTES); made when absent and `create` (None when
    absent otherwise). A key made at the same moment by another process wins: the file is
    linked into place only when no file is there, and then read."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return None
        private_dir(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), FILE_MODE)
                fh.write(base64.b64encode(secrets.token_bytes(KEY_BYTES)) + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
        fsync_dir(path.parent)
        st = os.lstat(path)
    if st.st_uid != os.getuid() or (st.st_mode & 0o077) or not os.path.isfile(path) \
            or os.path.islink(path):
        raise KeyMissing(f"{what} is not private (0600, ours): refusing it")
    return decode_key(path.read_bytes().strip(), f"{what} is damaged")


class FileKeyProvider(LocalVersions):
    """Keys as 0600 files `<home>/keys/<scope>.key` (base64 of 32 random bytes); version N > 1
    in `<home>/keys/vN/`."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self.folder = self.home / "keys"

    def _dir(self, version: int) -> Path:
        return self.folder if version == 1 else self.folder / f"v{version}"

    def _path(self, scope: str, version: int = 1) -> Path:
        return self._dir(version) / f"{validate_name(scope, 'scope')}.key"

    def _version(self, version: int | None) -> int:
        try:
            return self._usable(version)[1]
        except KeyStateError as exc:
            raise KeyVersionMissing(f"{exc} ({self.describe()})") from None

    def get_key(self, scope: str, *, create: bool = True, version: int | None = None) -> bytes:
        v = self._version(version)
        key = _key_file(self._path(scope, v), f"key file for scope {scope!r}"
                        + (f" (key version {v})" if v > 1 else ""), create)
        if key is None:
            raise KeyMissing(f"no key for scope {scope!r}" + (f" in key version {v}" if v > 1 else "")
                             + f" ({self.describe()})")
        return key

    def current_key(self, scope: str) -> tuple[int, bytes]:
        v = self.current_version()
        return v, self.get_key(scope, version=v)

    def delete_key(self, scope: str) -> bool:
        gone = False
        for v in self.state().versions:
            try:
                self._path(scope, v).unlink()
                gone = True
            except FileNotFoundError:
                pass
        return gone

    def get_audit_key(self, *, create: bool = True, version: int | None = None) -> bytes | None:
        """The audit chain's HMAC key (`<home>/keys/audit.hmac`, `keys/vN/audit.hmac`); None
        when absent and not created. KeyMissing when it is damaged or not private."""
        v = self._version(version)
        return _key_file(self._dir(v) / AUDIT_KEY_FILE, "the audit key file"
                         + (f" of key version {v}" if v > 1 else ""), create)

    def describe(self) -> str:
        return (f"key files in {self.folder} (folder 0700, one 0600 file per scope and one for "
                "the audit chain; no keyring backend on this machine)")

    # ----------------------------------------------------------------- versions' material
    def _where(self, version: int) -> str:
        return f"key files in {self._dir(version)}"

    def _has_material(self, version: int) -> bool:
        return version == 1 or self._dir(version).is_dir()

    def _make_material(self, version: int, scopes: list[str]) -> None:
        _key_file(self._dir(version) / AUDIT_KEY_FILE, "the audit key file", True)
        for scope in scopes:
            _key_file(self._path(scope, version), f"key file for scope {scope!r}", True)

    def _drop_material(self, version: int, scopes: list[str]) -> None:
        if version > 1:
            shutil.rmtree(self._dir(version), ignore_errors=True)
        else:       # version 1 shares the folder with the others' subfolders: its files only
            for path in [self.folder / AUDIT_KEY_FILE, *self.folder.glob("*.key")]:
                path.unlink(missing_ok=True)
        if self.folder.is_dir():
            fsync_dir(self.folder)


class KeyringKeyProvider(LocalVersions):
    """Keys in the system keyring, service "sfguard", user "<home tag>:<scope>" (version N > 1:
    "<home tag>:vN:<scope>"); which version is current is in `<home>/keys.json`.

    The home tag (a short hash of the home path) keeps two guard homes on one account apart.
    """

    def __init__(self, home: Path, backend=None):
        import keyring
        self._kr = backend or keyring.get_keyring()
        self.home = Path(home)
        self._tag = hashlib.sha256(str(self.home).encode()).hexdigest()[:12]

    def _user(self, name: str, version: int = 1) -> str:
        return f"{self._tag}:{name}" if version == 1 else f"{self._tag}:v{version}:{name}"

    def _version(self, version: int | None) -> int:
        try:
            return self._usable(version)[1]
        except KeyStateError as exc:
            raise KeyVersionMissing(f"{exc} ({self.describe()})") from None

    def _get(self, user: str, what: str) -> str | None:
        import keyring.errors
        try:
            stored: str | None = self._kr.get_password(KEYRING_SERVICE, user)
        except keyring.errors.KeyringError as exc:   # its type only: a message may carry more
            raise KeyringRefused(f"the system keyring refused to read {what} ({type(exc).__name__})") from None
        return stored

    def _entry(self, user: str, what: str, create: bool) -> bytes | None:
        import keyring.errors
        stored = self._get(user, what)
        if stored is None:
            if not create:
                return None
            key = secrets.token_bytes(KEY_BYTES)
            try:
                self._kr.set_password(KEYRING_SERVICE, user, base64.b64encode(key).decode())
            except keyring.errors.KeyringError as exc:
                raise KeyringRefused(f"the system keyring refused to store {what} "
                                     f"({type(exc).__name__})") from None
            return key
        return decode_key(stored, f"{what} is damaged")

    def get_key(self, scope: str, *, create: bool = True, version: int | None = None) -> bytes:
        v = self._version(version)
        key = self._entry(self._user(validate_name(scope, "scope"), v),
                          f"keyring entry for scope {scope!r}", create)
        if key is None:
            raise KeyMissing(f"no key for scope {scope!r}" + (f" in key version {v}" if v > 1 else "")
                             + f" ({self.describe()})")
        return key

    def current_key(self, scope: str) -> tuple[int, bytes]:
        v = self.current_version()
        return v, self.get_key(scope, version=v)

    def delete_key(self, scope: str) -> bool:
        import keyring.errors
        gone = False
        for v in self.state().versions:
            try:
                self._kr.delete_password(KEYRING_SERVICE, self._user(validate_name(scope, "scope"), v))
                gone = True
            except keyring.errors.PasswordDeleteError:
                pass
        return gone

    def get_audit_key(self, *, create: bool = True, version: int | None = None) -> bytes | None:
        """The audit chain's HMAC key, an entry of its own in the keyring."""
        v = self._version(version)
        return self._entry(self._user(AUDIT_KEYRING_USER, v), "the keyring entry of the audit key",
                           create)

    def describe(self) -> str:
        kr = type(self._kr)
        return f"keyring ({kr.__module__}.{kr.__name__})"

    # ----------------------------------------------------------------- versions' material
    def _where(self, version: int) -> str:
        return f"keyring entries {self._user('*', version)} ({self.describe()})"

    def _has_material(self, version: int) -> bool:
        return version == 1 or self._get(self._user(AUDIT_KEYRING_USER, version),
                                         "the keyring entry of the audit key") is not None

    def _make_material(self, version: int, scopes: list[str]) -> None:
        for name in (AUDIT_KEYRING_USER, *scopes):
            self._entry(self._user(name, version), f"the keyring entry {name!r}", True)

    def _drop_material(self, version: int, scopes: list[str]) -> None:
        import keyring.errors
        for name in (AUDIT_KEYRING_USER, *scopes):
            with contextlib.suppress(keyring.errors.PasswordDeleteError):
                self._kr.delete_password(KEYRING_SERVICE, self._user(name, version))


def keyring_usable() -> bool:
    """True when `keyring` has a real backend (not the `fail` one, not an empty chainer)."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return False
    kr = keyring.get_keyring()
    if isinstance(kr, fail.Keyring):
        return False
    backends = getattr(kr, "backends", None)
    return not (backends is not None and not backends)


def default_key_provider(home: Path):
    """Keyring first; a 0600 key file in the home where no keyring backend exists.

    `$SFGUARD_KEY_PROVIDER=file` forces the key file (useful for tests and headless servers).
    """
    if os.environ.get("SFGUARD_KEY_PROVIDER") != "file" and keyring_usable():
        return KeyringKeyProvider(home)
    return FileKeyProvider(home)
