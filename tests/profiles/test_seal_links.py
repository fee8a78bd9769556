"""Sealing a profile folder another user may have written (a root guard's browser user):
nothing outside the folder is ever sealed into it, whatever links or special files it holds,
and a fifo never blocks the seal. Checked on what unsealing gives back."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from sfguard.supervisor.profiles.sealing import seal_dir, unseal_to

SCOPE_KEY = bytes(range(32))


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("plant", [
    "file-link", "folder-link", "fifo", "link-in-subfolder", "dangling-link",
])
def test_links_and_special_files_in_a_profile_are_never_sealed(tmp_path, plant):
    outside = tmp_path / "guard-home"
    (outside / "keys").mkdir(parents=True)
    (outside / "keys" / "local.key").write_bytes(b"THE-SCOPE-KEY")
    src = tmp_path / "profile"
    (src / "Default").mkdir(parents=True)
    (src / "Default" / "Cookies").write_bytes(b"cookie-db")
    if plant == "file-link":
        (src / "Default" / "Login Data").symlink_to(outside / "keys" / "local.key")
    elif plant == "folder-link":
        (src / "Default" / "Extensions").symlink_to(outside / "keys")
    elif plant == "fifo":
        os.mkfifo(src / "Default" / "Preferences")
    elif plant == "link-in-subfolder":
        (src / "Default" / "Local Storage").mkdir()
        (src / "Default" / "Local Storage" / "leveldb").symlink_to(outside)
    elif plant == "dangling-link":
        (src / "Default" / "Web Data").symlink_to(tmp_path / "nothing-here")
    sealed = tmp_path / "profile.sealed"
    seal_dir(src, sealed, SCOPE_KEY, "local", "acct")
    back = tmp_path / "back"
    unseal_to(sealed, back, SCOPE_KEY, "local", "acct")
    got = files_of(back)
    assert got["Default/Cookies"] == b"cookie-db"
    assert b"THE-SCOPE-KEY" not in b"".join(got.values())
    assert set(got) == {"Default/Cookies"}
    assert not any(p.is_symlink() for p in back.rglob("*"))
