"""The runtime folder (memory-backed, /dev/shm or $XDG_RUNTIME_DIR) exists only while something
is unsealed or a guard runs there: reading profiles never creates it, and the last close of a
store without a guard removes it again (issue 11: nothing left in /dev/shm)."""
from __future__ import annotations

import stat

from sfguard.supervisor.home import runtime_path
from sfguard.supervisor.profiles.keys import FileKeyProvider
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.protocols import ProfileKey
from tests.profiles.conftest import sfguard

SHOP = ProfileKey("local", "shop")
MAIL = ProfileKey("local", "mail")


def test_reads_create_nothing_and_the_last_close_removes_the_folder(tmp_path):
    home = (tmp_path / "home").absolute()
    store = LocalProfileStore(home, FileKeyProvider(home))
    rt = runtime_path(home)
    assert not rt.exists()
    store.create(SHOP)
    store.create(MAIL)
    assert not rt.exists(), "create seals an empty profile and leaves no runtime folder"
    store.list("local"), store.info(SHOP), store.unsealed(), store.exists(SHOP)
    assert not rt.exists(), "reading profiles must not create the runtime folder"

    work = store.open(SHOP)
    assert work.is_relative_to(rt)
    for folder in (rt, rt / "profiles", rt / "profiles" / "local"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    store.open(MAIL)
    store.close(SHOP)
    assert (rt / "profiles" / "local" / "mail").is_dir(), "another open profile keeps its folder"
    store.close(MAIL)
    assert not rt.exists()


def test_a_failed_unseal_leaves_no_folder(tmp_path):
    home = (tmp_path / "home").absolute()
    store = LocalProfileStore(home, FileKeyProvider(home))
    store.create(SHOP)
    sealed = home / "profiles" / "local" / "shop" / "profile.sealed"
    data = bytearray(sealed.read_bytes())
    data[-5] ^= 0xFF
    sealed.write_bytes(bytes(data))
    try:
        store.open(SHOP)
    except Exception:
        pass
    else:
        raise AssertionError("a tampered profile must not unseal")
    assert not runtime_path(home).exists()


def test_profile_commands_leave_no_runtime_folder(tmp_path):
    home = (tmp_path / "home").absolute()
    for args in (("profiles", "create", "shop"), ("profiles", "list"), ("profiles", "list", "--json"),
                 ("status",), ("audit", "verify")):
        sfguard(*args, home=home)
        assert not runtime_path(home).exists(), args
