"""Handing an unsealed profile to the browser user (root only): everything inside becomes
that user's, nothing outside does, whatever links the folder holds; a folder of a third
user is refused."""
from __future__ import annotations

import os
import stat

import pytest

from sfguard.supervisor.browsers import browser_user as bu
from sfguard.supervisor.home import HomeError
from sfguard.supervisor.stage.sandbox import ensure_system_user, lookup_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root hands folders over")


@pytest.fixture(scope="module")
def user():
    return ensure_system_user(bu.DEFAULT_BROWSER_USER, "browser")


@pytest.mark.parametrize("plant", ["file-link", "folder-link", "nested-link", "relaunch"])
def test_hand_over_changes_owners_inside_only(tmp_path, user, plant):
    outside = tmp_path / "guard-home"
    (outside / "keys").mkdir(parents=True)
    (outside / "keys" / "local.key").write_bytes(b"k")
    prof = tmp_path / "acct"
    (prof / "Default" / "Local Storage").mkdir(parents=True)
    (prof / "Default" / "Cookies").write_bytes(b"c")
    if plant == "file-link":
        (prof / "Default" / "Login Data").symlink_to(outside / "keys" / "local.key")
    elif plant == "folder-link":
        (prof / "Extensions").symlink_to(outside / "keys")
    elif plant == "nested-link":
        (prof / "Default" / "Local Storage" / "leveldb").symlink_to(outside)
    bu.hand_over(prof, user)
    if plant == "relaunch":   # a relaunch hands over a folder the user already owns
        bu.hand_over(prof, user)
    st = prof.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (user.uid, user.gid, 0o700)
    assert {p.lstat().st_uid for p in prof.rglob("*")} == {user.uid}
    assert {p.lstat().st_uid for p in outside.rglob("*")} | {outside.stat().st_uid} == {0}


def test_hand_over_refuses_a_folder_of_another_user_and_a_link(tmp_path, user):
    other = lookup_user("nobody")
    assert other is not None
    prof = tmp_path / "theirs"
    prof.mkdir()
    os.chown(prof, other.uid, other.gid)
    with pytest.raises(HomeError):
        bu.hand_over(prof, user)
    assert prof.stat().st_uid == other.uid
    link = tmp_path / "link"
    (tmp_path / "real").mkdir()
    link.symlink_to(tmp_path / "real")
    with pytest.raises(HomeError):
        bu.hand_over(link, user)
    assert (tmp_path / "real").stat().st_uid == 0
