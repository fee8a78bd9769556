"""Key providers: keyring first, 0600 key file where the machine has no keyring backend."""
from __future__ import annotations

import os
import stat

import keyring.backend
import pytest

from sfguard.supervisor.profiles.keys import FileKeyProvider, KeyMissing, KeyringKeyProvider, default_key_provider
from sfguard.supervisor.testing import FakeKeyProvider


class MemoryKeyring(keyring.backend.KeyringBackend):
    """A real keyring backend class, storing in a dict (stands in for Secret Service)."""
    priority = 1

    def __init__(self):
        super().__init__()
        self.data = {}

    def get_password(self, service, username):
        return self.data.get((service, username))

    def set_password(self, service, username, password):
        self.data[(service, username)] = password

    def delete_password(self, service, username):
        if (service, username) not in self.data:
            import keyring.errors
            raise keyring.errors.PasswordDeleteError(username)
        del self.data[(service, username)]


def providers(tmp_path):
    return {"file": FileKeyProvider(tmp_path / "home"),
            "keyring": KeyringKeyProvider(tmp_path / "home", backend=MemoryKeyring()),
            "fake": FakeKeyProvider()}


@pytest.mark.parametrize("kind", ["file", "keyring", "fake"])
def test_per_scope_keys_stable_and_deletable(tmp_path, kind):
    kp = providers(tmp_path)[kind]
    with pytest.raises(KeyMissing):
        kp.get_key("alpha", create=False)
    a = kp.get_key("alpha")
    assert len(a) == 32 and kp.get_key("alpha") == a and kp.get_key("alpha", create=False) == a
    b = kp.get_key("beta")
    assert b != a
    assert kp.delete_key("alpha") is True
    assert kp.delete_key("alpha") is False
    with pytest.raises(KeyMissing):
        kp.get_key("alpha", create=False)
    assert kp.get_key("beta") == b
    assert kp.describe()


def test_file_key_is_private_and_foreign_modes_refused(tmp_path):
    kp = FileKeyProvider(tmp_path / "home")
    kp.get_key("local")
    path = tmp_path / "home" / "keys" / "local.key"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    os.chmod(path, 0o644)
    with pytest.raises(KeyMissing, match="not private"):
        kp.get_key("local")


def test_keyring_entry_is_per_home(tmp_path):
    ring = MemoryKeyring()
    one = KeyringKeyProvider(tmp_path / "one", backend=ring)
    two = KeyringKeyProvider(tmp_path / "two", backend=ring)
    assert one.get_key("local") != two.get_key("local")
    assert "MemoryKeyring" in one.describe()


def test_default_on_this_machine_is_the_key_file(tmp_path):
    """This machine has no keyring backend (keyring's fail backend): the key file is used."""
    import keyring
    from keyring.backends import fail
    kp = default_key_provider(tmp_path / "home")
    if isinstance(keyring.get_keyring(), fail.Keyring):
        assert isinstance(kp, FileKeyProvider)
        assert "key file" in kp.describe()
    else:
        assert isinstance(kp, KeyringKeyProvider)


def test_the_file_provider_names_a_folder_of_key_files(tmp_path):
    """Issue 35: `status` called the keys folder "a 0600 key file"."""
    from sfguard.supervisor.profiles.keys import FileKeyProvider
    text = FileKeyProvider(tmp_path).describe()
    assert text.startswith(f"key files in {tmp_path / 'keys'} (folder 0700, one 0600 file per scope")


class LockedKeyring(MemoryKeyring):
    """A keyring that refuses: locked for reads, or for writes only."""

    def __init__(self, reads: bool):
        super().__init__()
        self.reads = reads

    def get_password(self, service, username):
        import keyring.errors
        if self.reads:
            raise keyring.errors.KeyringLocked("locked; secret=" + "s3cr3t-token")
        return super().get_password(service, username)

    def set_password(self, service, username, password):
        import keyring.errors
        raise keyring.errors.PasswordSetError("cannot store " + password)


@pytest.mark.parametrize("reads", [True, False], ids=["read-locked", "write-refused"])
@pytest.mark.parametrize("ask", ["scope key", "audit key", "current key"])
def test_a_refusing_keyring_is_the_providers_own_error(tmp_path, reads, ask):
    """Every caller that handles a key provider's failures (ProfileError) handles a keyring that
    refuses too; the error names the entry and the keyring error's type, never its message."""
    from sfguard.supervisor.protocols import ProfileError
    kp = KeyringKeyProvider(tmp_path / "home", backend=LockedKeyring(reads))
    call = {"scope key": lambda: kp.get_key("alpha"), "audit key": lambda: kp.get_audit_key(),
            "current key": lambda: kp.current_key("alpha")}[ask]
    with pytest.raises(ProfileError) as err:
        call()
    text = str(err.value)
    assert "keyring refused" in text and ("KeyringLocked" if reads else "PasswordSetError") in text
    assert "s3cr3t" not in text and "cannot store" not in text
