"""The browser users' pool (supervisor/browsers/browser_pool.py) without a browser: one user per
running browser, shared safely by several guards through lock files, a user given back only
once nothing of it is left, a crashed guard's users taken again only by its own sweep.

Users here are records with uids no account has (4000001...): nothing is created on the
machine. Where a test needs a process of such a uid it starts one itself (root only) and ends it
by pid if the pool did not."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfguard.supervisor.browsers import browser_pool as bp
from sfguard.supervisor.home import acl_uids, grant_traverse, open_for_traverse, revoke_traverse
from sfguard.supervisor.procs import uid_processes
from sfguard.supervisor.stage.sandbox import StageUser

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another uid's process, chown)")
#: a Python another uid can run (the venv's may live under root's home)
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def users(n: int = 3, base: int = 4_000_001) -> list[StageUser]:
    return [StageUser(f"sfgt-user{i}", base + i, base + i) for i in range(n)]


@pytest.fixture
def locks(tmp_path):
    return tmp_path / "locks"


def pool(tmp_path, locks, name="rt-a", n=3) -> bp.BrowserPool:
    rt = tmp_path / name
    rt.mkdir(exist_ok=True)
    return bp.BrowserPool(users(n), rt, locks)


def test_each_running_browser_has_its_own_user_and_a_full_pool_says_so(tmp_path, locks):
    p = pool(tmp_path, locks)
    taken = [p.take(f"run {i}") for i in range(3)]
    assert len({u.uid for u in taken if u}) == 3 and p.in_use() == 3
    assert p.take("run 4") is None
    assert "all 3 browser users of this guard are in use" in p.full_reason()
    assert p.give_back(taken[1])
    again = p.take("run 5")
    assert again == taken[1] and p.take("run 6") is None


def test_two_guards_never_share_a_user(tmp_path, locks):
    a, b = pool(tmp_path, locks, "rt-a"), pool(tmp_path, locks, "rt-b")
    mine = [a.take("run a1"), a.take("run a2")]
    theirs = b.take("run b1")
    assert theirs is not None and theirs.uid not in {u.uid for u in mine if u}
    assert b.take("run b2") is None            # the third was the only free one
    a.give_back(mine[0])
    assert b.take("run b3") == mine[0]


@pytest.mark.parametrize("mark, taken_by_other, claimed_by_own", [
    (None, True, False),                           # given back clean
    ("own", False, True),                          # this guard died: only its sweep takes it
    ("other-existing", False, False),              # another dead guard's files may be there
    ("gone", True, False),                         # that guard's runtime folder is gone
])
def test_a_user_a_dead_guard_left_is_taken_only_when_its_files_cannot_be_there(tmp_path, locks, mark,
                                                                               taken_by_other, claimed_by_own):
    (tmp_path / "elsewhere").mkdir()
    own = pool(tmp_path, locks, "rt-own", n=1)
    where = {"own": own.runtime, "other-existing": str(tmp_path / "elsewhere"),
             "gone": str(tmp_path / "removed-runtime")}.get(mark or "")
    own.close()
    (locks / "sfgt-user0.lock").write_text(json.dumps({"runtime": where, "pid": 1}) if where else "")
    other = pool(tmp_path, locks, "rt-other", n=1)
    got = other.take("run x")
    assert (got is not None) == taken_by_other
    if got:
        other.give_back(got)
    other.close()
    own = pool(tmp_path, locks, "rt-own", n=1)
    claimed = own.claim_left()
    assert bool(claimed) == claimed_by_own
    for u in claimed:
        assert own.give_back(u)
        assert (locks / "sfgt-user0.lock").read_text() == ""     # back in the pool: no mark


def test_a_recorded_user_is_claimed_by_the_sweep_and_the_mark_names_the_holder(tmp_path, locks):
    p = pool(tmp_path, locks, n=2)
    u = p.take("run r1")
    mark = json.loads((locks / f"{u.name}.lock").read_text())
    assert mark == {"runtime": p.runtime, "pid": os.getpid(), "what": "run r1"}
    p.close()                                      # the guard died holding it: the mark stays
    again = pool(tmp_path, locks, n=2)
    assert [c.name for c in again.claim_left(recorded=[u.uid])] == [u.name]


@ROOT_ONLY
def test_a_user_goes_back_only_without_processes_and_with_its_folders_taken_back(tmp_path, locks):
    p = pool(tmp_path, locks, n=1)
    u = p.take("run r1")
    left = tmp_path / "rt-a" / "working-copy"
    (left / "Default").mkdir(parents=True)
    (left / "Default" / "Cookies").write_bytes(b"x")
    for path in (left, left / "Default", left / "Default" / "Cookies"):
        os.chown(path, u.uid, u.gid)
    (left / "link").symlink_to("/etc/passwd")
    os.lchown(left / "link", u.uid, u.gid)
    stray = Path("/dev/shm") / f"sfgt-stray-{os.getpid()}"
    stray.write_bytes(b"x")
    os.chown(stray, u.uid, u.gid)
    proc = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"], user=u.uid, group=u.gid,
                            extra_groups=[], cwd="/", start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not uid_processes([u.uid]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.give_back(u, [left])
        assert proc.wait(timeout=10) is not None, "the user's process was left running"
        for path in (left, left / "Default", left / "Default" / "Cookies", left / "link"):
            assert path.lstat().st_uid == 0, path
        assert stat.S_IMODE(left.stat().st_mode) == 0o700
        assert Path("/etc/passwd").stat().st_uid == 0       # the link was not followed
        assert not stray.exists(), "a file the user left in /dev/shm"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        stray.unlink(missing_ok=True)


@pytest.mark.parametrize("config, ok", [
    (bp.PoolConfig(), True), (bp.PoolConfig("web-b", 1), True), (bp.PoolConfig("b_", 256), True),
    (bp.PoolConfig("Root", 4), False), (bp.PoolConfig("../x", 4), False), (bp.PoolConfig("", 4), False),
    (bp.PoolConfig("a" * 29, 4), False), (bp.PoolConfig("web", 0), False), (bp.PoolConfig("web", 257), False),
])
def test_pool_config_is_checked_at_the_edge(config, ok):
    if ok:
        config.check()
        assert config.names()[0] == f"{config.prefix}1" and len(config.names()) == config.size
    else:
        with pytest.raises(bp.PoolError):
            config.check()


STAGE = StageUser("sfgt-stage", 4_100_000, 4_100_000)


@pytest.mark.parametrize("user, primary, refused", [
    (StageUser("sfgt-ok", 4_000_010, 4_000_010), {}, None),
    (StageUser("sfgt-root", 0, 4_000_011), {}, "uid or gid 0"),
    (StageUser("sfgt-rootgroup", 4_000_012, 0), {}, "uid or gid 0"),
    (StageUser("sfgt-stageuid", STAGE.uid, 4_000_013), {}, "stage user"),
    (StageUser("sfgt-stagegid", 4_000_014, STAGE.gid), {}, "stage user"),
    (StageUser("sfgt-shared", 4_000_015, 4_000_015), {4_000_015: ["sfgt-shared", "someone"]}, "group of its own"),
])
def test_a_browser_user_must_be_unprivileged_and_alone_in_its_group(user, primary, refused):
    if refused is None:
        bp._check(user, STAGE, primary)
    else:
        with pytest.raises(bp.PoolError, match=refused):
            bp._check(user, STAGE, primary)


@pytest.fixture
def crossable():
    """A folder every user may cross (pytest's own folders are root's, 0700), removed after."""
    import shutil
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="sfgt-acl-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@ROOT_ONLY
def test_the_runtime_folder_is_crossed_by_exactly_the_browser_users(crossable):
    rt = crossable / "rt"
    (rt / "inner").mkdir(parents=True, mode=0o700)
    granted, other = [4_000_021, 4_000_022], 4_000_023
    grant_traverse(rt, granted)
    try:
        open_for_traverse(rt)
    finally:
        revoke_traverse(rt)
    st = rt.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o710)
    assert sorted(acl_uids(rt)) == granted
    probe = "import os, sys\ntry:\n os.stat(sys.argv[1]); print('crossed')\nexcept PermissionError: print('denied')"
    got = {uid: subprocess.run([PYTHON, "-I", "-c", probe, str(rt / "inner")], user=uid, group=uid,
                               extra_groups=[], cwd="/", capture_output=True, text=True, timeout=30).stdout.strip()
           for uid in (*granted, other)}
    assert got == {4_000_021: "crossed", 4_000_022: "crossed", other: "denied"}
    listing = subprocess.run([PYTHON, "-I", "-c", "import os, sys; os.listdir(sys.argv[1])", str(rt)],
                             user=granted[0], group=granted[0], extra_groups=[], cwd="/",
                             capture_output=True, text=True, timeout=30)
    assert listing.returncode != 0 and "PermissionError" in listing.stderr     # cross, never list
