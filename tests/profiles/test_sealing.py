"""Sealing at rest: real Chromium profile round trip, wrong key, tampering, truncation,
crash safety, hostile archives and file modes."""
from __future__ import annotations

import hashlib
import io
import os
import socket
import sqlite3
import stat
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from sfguard.supervisor.profiles import sealing
from sfguard.supervisor.profiles.keys import FileKeyProvider
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.profiles.sealing import SealError, is_excluded, seal_dir, unseal_to
from sfguard.supervisor.protocols import ProfileKey
from tests.profiles.conftest import ROOT

KEY = ProfileKey("local", "shop")
SECRET_KEY = bytes(range(32))


def tree(root: Path) -> dict[str, bytes]:
    out = {}
    for base, _dirs, files in os.walk(root):
        for f in files:
            full = Path(base) / f
            if full.is_file() and not full.is_symlink():
                out[full.relative_to(root).as_posix()] = full.read_bytes()
    return out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def store(tmp_path):
    home = tmp_path / "home"
    return LocalProfileStore(home, FileKeyProvider(home), runtime=tmp_path / "run")


def test_chromium_profile_round_trip(store, chromium_profile, tmp_path, monkeypatch):
    store.create(KEY)
    work = store.open(KEY)
    os.rmdir(work)
    subprocess.run(["cp", "-a", f"{chromium_profile}/.", str(work)], check=True)
    os.chmod(work, 0o700)
    # What a running browser leaves: Singleton* lock symlink, socket and cookie, plus caches.
    (work / "SingletonLock").symlink_to("host-12345")
    (work / "SingletonCookie").symlink_to("987654")
    sock = socket.socket(socket.AF_UNIX)
    monkeypatch.chdir(work)            # a relative name: the full path may pass AF_UNIX's 108 bytes
    sock.bind("SingletonSocket")
    monkeypatch.undo()
    for cache in ("Default/Cache/Cache_Data", "Default/Code Cache/js", "Default/GPUCache",
                  "Default/Service Worker/CacheStorage/abc", "GrShaderCache", "ShaderCache"):
        (work / cache).mkdir(parents=True, exist_ok=True)
        (work / cache / "blob").write_bytes(b"cache bytes")
    (work / "Default" / "Service Worker" / "Database").mkdir(parents=True, exist_ok=True)
    (work / "Default" / "Service Worker" / "Database" / "keep").write_bytes(b"sw db")
    before = tree(work)
    store.close(KEY)
    sock.close()
    assert not work.exists()

    sealed = store.home / "profiles" / "local" / "shop" / "profile.sealed"
    blob = sealed.read_bytes()
    for needle in (b"persisted-login-123", b"Default/Cookies", b"Local Storage", b"SQLite format"):
        assert needle not in blob

    again = store.open(KEY)
    after = tree(again)
    expected = {k: v for k, v in before.items() if not is_excluded(k)}
    assert after == expected                       # byte-identical, caches left out
    assert "Default/Cookies" in after
    assert not any(k.startswith("Default/Cache/") or "CacheStorage" in k or "GPUCache" in k for k in after)
    assert not any("Service Worker" in k for k in after)      # registrations too: see sealing.py
    assert not any(p.name.startswith("Singleton") for p in again.iterdir())
    names = [r[0] for r in sqlite3.connect(again / "Default" / "Cookies").execute(
        "select name from cookies")]
    assert names == ["sid"]
    for base, _dirs, files in os.walk(again):
        assert stat.S_IMODE(os.stat(base).st_mode) == 0o700
        for f in files:
            assert stat.S_IMODE(os.lstat(os.path.join(base, f)).st_mode) == 0o600
    store.close(KEY, save=False)


@pytest.fixture
def sealed_file(tmp_path) -> Path:
    src = tmp_path / "src"
    (src / "Default").mkdir(parents=True)
    (src / "Default" / "Cookies").write_bytes(os.urandom(20000))
    (src / "Preferences").write_bytes(b"{}" * 3000)
    dest = tmp_path / "p.sealed"
    seal_dir(src, dest, SECRET_KEY, "local", "shop", chunk_size=4096)
    return dest


def chunk_offsets(path: Path) -> list[int]:
    data = path.read_bytes()
    (hlen,) = struct.unpack(">I", data[8:12])
    pos, out = 12 + hlen, []
    while pos < len(data):
        out.append(pos)
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        pos += 4 + n
    return out


def assert_refused(sealed: Path, tmp_path: Path, key=SECRET_KEY, scope="local", name="shop"):
    dest_parent = tmp_path / "out"
    dest_parent.mkdir(exist_ok=True)
    with pytest.raises(SealError):
        unseal_to(sealed, dest_parent / "profile", key, scope, name)
    assert leftovers(dest_parent) == []            # nothing unsealed, no temp folder


def test_intact_file_unseals(sealed_file, tmp_path):
    unseal_to(sealed_file, tmp_path / "ok", SECRET_KEY, "local", "shop")
    assert tree(tmp_path / "ok") == tree(tmp_path / "src")
    assert len(chunk_offsets(sealed_file)) > 5


@pytest.mark.parametrize("key,scope,name", [
    (bytes(32), "local", "shop"), (SECRET_KEY, "other", "shop"), (SECRET_KEY, "local", "mail")])
def test_wrong_key_or_identity_refused(sealed_file, tmp_path, key, scope, name):
    assert_refused(sealed_file, tmp_path, key, scope, name)


def test_flip_any_byte_refused(sealed_file, tmp_path):
    data = sealed_file.read_bytes()
    offs = chunk_offsets(sealed_file)
    positions = {0, 7, 8, 11, 12, 20, offs[0], offs[0] + 3, offs[0] + 4, offs[0] + 100,
                 offs[1] - 1, offs[-1], offs[-1] + 5, len(data) - 1}
    positions |= set(range(0, len(data), 997))
    bad = tmp_path / "bad.sealed"
    for pos in sorted(positions):
        mutated = bytearray(data)
        mutated[pos] ^= 0x01
        bad.write_bytes(bytes(mutated))
        assert_refused(bad, tmp_path)


def test_truncated_or_extended_refused(sealed_file, tmp_path):
    data = sealed_file.read_bytes()
    offs = chunk_offsets(sealed_file)
    bad = tmp_path / "bad.sealed"
    # Cuts: empty, mid-header, after header, every chunk boundary (drops the final chunk and
    # more), mid-chunk, one byte short.
    for cut in [0, 5, offs[0], *offs[1:], offs[-1] + 10, len(data) - 1]:
        bad.write_bytes(data[:cut])
        assert_refused(bad, tmp_path)
    bad.write_bytes(data + b"\0\0\0\0")           # data after the final chunk
    assert_refused(bad, tmp_path)
    bad.write_bytes(data + data[offs[-1]:])       # the final chunk replayed
    assert_refused(bad, tmp_path)


def test_reordered_chunks_refused(sealed_file, tmp_path):
    data = sealed_file.read_bytes()
    offs = chunk_offsets(sealed_file) + [len(data)]
    c1, c2 = data[offs[1]:offs[2]], data[offs[2]:offs[3]]
    bad = tmp_path / "bad.sealed"
    bad.write_bytes(data[:offs[1]] + c2 + c1 + data[offs[3]:])
    assert_refused(bad, tmp_path)


def _seal_tar_bytes(tar_bytes: bytes, dest: Path) -> None:
    """Seal arbitrary tar bytes, as a holder of the key could (hostile archive content)."""
    header, hdr = sealing._header("local", "shop", 4096, 1)
    aes = sealing._file_key(SECRET_KEY, hdr)
    with open(dest, "wb") as out:
        out.write(header)
        w = sealing._SealWriter(out, aes, bytes.fromhex(hdr["prefix"]),
                                hashlib.sha256(header).digest(), 4096)
        w.write(tar_bytes)
        w.finish()


def _tar_with(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ok = tarfile.TarInfo("fine.txt")
        ok.size = 2
        tf.addfile(ok, io.BytesIO(b"ok"))
        member.size = len(data) if member.isreg() else 0
        tf.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return buf.getvalue()


def _member(name: str, kind=tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    return m


@pytest.mark.parametrize("member", [
    _member("/etc/evil"), _member("../evil"), _member("a/../../evil"),
    _member("link", tarfile.SYMTYPE, "/etc/passwd"), _member("link", tarfile.SYMTYPE, "../../x"),
    _member("hard", tarfile.LNKTYPE, "fine.txt"), _member("dev", tarfile.CHRTYPE),
    _member("fifo", tarfile.FIFOTYPE), _member("blk", tarfile.BLKTYPE),
], ids=["absolute", "dotdot", "nested-dotdot", "symlink-abs", "symlink-out", "hardlink",
        "chardev", "fifo", "blockdev"])
def test_hostile_archive_members_refused(tmp_path, member):
    sealed = tmp_path / "hostile.sealed"
    _seal_tar_bytes(_tar_with(member, b"evil"), sealed)
    assert_refused(sealed, tmp_path)
    assert not (tmp_path / "evil").exists()


CRASH_SCRIPT = r"""
import os, sys
from pathlib import Path
from sfguard.supervisor.profiles.keys import FileKeyProvider
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.protocols import ProfileKey
home, run = Path(sys.argv[1]), Path(sys.argv[2])
store = LocalProfileStore(home, FileKeyProvider(home), runtime=run)
key = ProfileKey("local", "shop")
(run / "profiles" / "local" / "shop" / "Cookies").write_bytes(b"NEW login")
def crash(*a, **k):
    os._exit(9)            # the process dies after writing+fsync, before the rename
os.replace = crash
store.save(key)
"""


def test_crash_between_write_and_rename_keeps_previous_copy(store, tmp_path):
    store.create(KEY)
    work = store.open(KEY)
    (work / "Cookies").write_bytes(b"OLD login")
    store.save(KEY)
    sealed = store.home / "profiles" / "local" / "shop" / "profile.sealed"
    old = sealed.read_bytes()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(store.home), str(tmp_path / "run")],
                        cwd=ROOT, env=env, timeout=60).returncode
    assert rc == 9
    assert sealed.read_bytes() == old
    assert any(n.endswith(".tmp") for n in leftovers(sealed.parent))   # the half-done temp file
    store.close(KEY, save=False)
    again = store.open(KEY)
    assert (again / "Cookies").read_bytes() == b"OLD login"
    assert [i.key for i in store.list("local")] == [KEY]                # temp file is not a profile
    store.close(KEY, save=False)


def test_failed_seal_keeps_previous_copy(store, monkeypatch):
    store.create(KEY)
    work = store.open(KEY)
    (work / "Cookies").write_bytes(b"OLD")
    store.save(KEY)
    sealed = store.home / "profiles" / "local" / "shop" / "profile.sealed"
    old = sealed.read_bytes()
    (work / "Cookies").write_bytes(b"NEW")

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(sealing.os, "replace", boom)
    with pytest.raises(OSError):
        store.save(KEY)
    assert sealed.read_bytes() == old
    assert [n for n in leftovers(sealed.parent) if n.endswith(".tmp")] == []


def test_copied_profiles_folder_without_key_opens_nothing(store, tmp_path):
    store.create(KEY)
    work = store.open(KEY)
    (work / "Cookies").write_bytes(b"login")
    store.close(KEY)
    thief_home = tmp_path / "thief"
    thief_home.mkdir(mode=0o700)
    subprocess.run(["cp", "-a", str(store.home / "profiles"), str(thief_home / "profiles")], check=True)
    thief = LocalProfileStore(thief_home, FileKeyProvider(thief_home), runtime=tmp_path / "run2")
    assert [i.key for i in thief.list("local")] == [KEY]
    with pytest.raises(Exception, match="key"):
        thief.open(KEY)
    assert thief.unsealed() == []


@pytest.mark.parametrize("rel,excluded", [
    ("Default/Cache/Cache_Data/f_0001", True), ("Default/Code Cache/js/x", True),
    ("GrShaderCache/data", True), ("Default/Service Worker/CacheStorage/a", True),
    ("Default/Service Worker/Database/x", True), ("SingletonLock", True),
    ("Default/Cookies", False), ("Default/Local Storage/leveldb/000003.log", False),
    ("Crashpad/settings.dat", True), ("component_crx_cache/x", True),
    ("Default/Caches", False),
])
def test_exclusion_rules(rel, excluded):
    assert is_excluded(rel) is excluded


def test_store_refuses_tampered_profile_and_leaves_nothing(store, tmp_path):
    store.create(KEY)
    work = store.open(KEY)
    (work / "Cookies").write_bytes(os.urandom(50000))
    store.close(KEY)
    sealed = store.home / "profiles" / "local" / "shop" / "profile.sealed"
    data = bytearray(sealed.read_bytes())
    data[len(data) // 2] ^= 0x80
    sealed.write_bytes(bytes(data))
    with pytest.raises(SealError):
        store.open(KEY)
    assert store.unsealed() == []
    assert leftovers(tmp_path / "run" / "profiles" / "local") == []
