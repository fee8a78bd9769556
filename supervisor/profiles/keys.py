"""Key providers: where the per-scope sealing keys live.

`default_key_provider(home)` prefers the system keyring (Secret Service, macOS Keychain, ...)
and falls back to 0600 key files in `<home>/keys/` when the machine has no keyring backend
(`keyring.get_keyring()` is the `fail` backend, as in containers and CI). `describe()` says
which one is in use; `sfguard profiles list` and `doctor` show it.

Each scope has its own random 32-byte key. Deleting a scope's key makes every sealed profile
of that scope unreadable, which is how `delete_scope` guarantees the data is gone even if a
copy of the sealed files survives somewhere.
"""
from __future__ import annotations

import base64
import hashlib
import os
import secrets
from pathlib import Path

from sfguard.supervisor.home import FILE_MODE, atomic_write, private_dir
from sfguard.supervisor.protocols import ProfileError, validate_name

KEY_BYTES = 32
KEYRING_SERVICE = "sfguard"
#: The audit chain's HMAC key: a key of its own, never a scope's sealing key. Its file name and
#: keyring user cannot collide with a scope (scope names have no '.' and no '#').
AUDIT_KEY_FILE = "audit.hmac"
AUDIT_KEYRING_USER = "#audit-chain"


class KeyMissing(ProfileError):
    """A scope's key is missing, damaged or not private."""


def decode_key(raw: bytes | str, damaged: str) -> bytes:
    """A stored key (base64 of KEY_BYTES bytes) back to bytes; KeyMissing(`damaged`) if it is not."""
    try:
        key = base64.b64decode(raw, validate=True)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyMissing(damaged)
    return key


class FileKeyProvider:
    """Keys as 0600 files `<home>/keys/<scope>.key` (base64 of 32 random bytes)."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self.folder = self.home / "keys"

    def _path(self, scope: str) -> Path:
        return self.folder / f"{validate_name(scope, 'scope')}.key"

    def get_key(self, scope: str, *, create: bool = True) -> bytes:
        path = self._path(scope)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                raise KeyMissing(f"no key for scope {scope!r} ({self.describe()})") from None
            private_dir(self.folder)
            key = secrets.token_bytes(KEY_BYTES)
            atomic_write(path, base64.b64encode(key) + b"\n", FILE_MODE)
            return key
        if st.st_uid != os.getuid() or (st.st_mode & 0o077):
            raise KeyMissing(f"key file for scope {scope!r} is not private (0600, ours): refusing it")
        return decode_key(path.read_bytes().strip(), f"key file for scope {scope!r} is damaged")

    def delete_key(self, scope: str) -> bool:
        try:
            self._path(scope).unlink()
            return True
        except FileNotFoundError:
            return False

    def get_audit_key(self, *, create: bool = True) -> bytes | None:
        """The audit chain's HMAC key (`<home>/keys/audit.hmac`); None when absent and not
        created. KeyMissing when it is damaged or not private."""
        path = self.folder / AUDIT_KEY_FILE
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return None
            private_dir(self.folder)
            key = secrets.token_bytes(KEY_BYTES)
            atomic_write(path, base64.b64encode(key) + b"\n", FILE_MODE)
            return key
        if st.st_uid != os.getuid() or (st.st_mode & 0o077) or not os.path.isfile(path) \
                or os.path.islink(path):
            raise KeyMissing("the audit key file is not private (0600, ours): refusing it")
        return decode_key(path.read_bytes().strip(), "the audit key file is damaged")

    def describe(self) -> str:
        return (f"key files in {self.folder} (folder 0700, one 0600 file per scope and one for "
                "the audit chain; no keyring backend on this machine)")


class KeyringKeyProvider:
    """Keys in the system keyring, service "sfguard", user "<home tag>:<scope>".

    The home tag (a short hash of the home path) keeps two guard homes on one account apart.
    """

    def __init__(self, home: Path, backend=None):
        import keyring
        self._kr = backend or keyring.get_keyring()
        self.home = Path(home)
        self._tag = hashlib.sha256(str(self.home).encode()).hexdigest()[:12]

    def _user(self, scope: str) -> str:
        return f"{self._tag}:{validate_name(scope, 'scope')}"

    def get_key(self, scope: str, *, create: bool = True) -> bytes:
        stored = self._kr.get_password(KEYRING_SERVICE, self._user(scope))
        if stored is None:
            if not create:
                raise KeyMissing(f"no key for scope {scope!r} ({self.describe()})")
            key = secrets.token_bytes(KEY_BYTES)
            self._kr.set_password(KEYRING_SERVICE, self._user(scope), base64.b64encode(key).decode())
            return key
        return decode_key(stored, f"keyring entry for scope {scope!r} is damaged")

    def delete_key(self, scope: str) -> bool:
        import keyring.errors
        try:
            self._kr.delete_password(KEYRING_SERVICE, self._user(scope))
            return True
        except keyring.errors.PasswordDeleteError:
            return False

    def get_audit_key(self, *, create: bool = True) -> bytes | None:
        """The audit chain's HMAC key, an entry of its own in the keyring."""
        user = f"{self._tag}:{AUDIT_KEYRING_USER}"
        stored = self._kr.get_password(KEYRING_SERVICE, user)
        if stored is None:
            if not create:
                return None
            key = secrets.token_bytes(KEY_BYTES)
            self._kr.set_password(KEYRING_SERVICE, user, base64.b64encode(key).decode())
            return key
        return decode_key(stored.encode(), "the keyring entry of the audit key is damaged")

    def describe(self) -> str:
        kr = type(self._kr)
        return f"keyring ({kr.__module__}.{kr.__name__})"


def keyring_usable() -> bool:
    """True when `keyring` has a real backend (not the `fail` one, not an empty chainer)."""
    try:
        import keyring
        from keyring.backends import fail
    except Exception:
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
