"""Layer 2 (issues 13 and 50), through a real `sfguard start` as root with real Chromium: each
browser runs as a user of its own from the guard's pool with Chromium's sandbox on, owns only
its folders, and cannot read the guard's files, nor another run's profile, HOME, environment or
processes.

Checked from outside as a user or an attacker would: process uids and command lines, the
kernel's seccomp state of the renderers, file owners, modes and ACLs, and attempts made AS a
browser's uid (a subprocess the test starts with that uid, as a taken-over browser would be)
to open, list, read and signal. The users are the guard's own pool (sfguard-browser1..16),
created by the guard at its first start and kept, as a deployment keeps them."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.browsers.browser_pool import PoolConfig, existing_uids, lock_dir
from sfguard.supervisor.home import acl_uids, runtime_path
from sfguard.supervisor.procs import uid_processes
from sfguard.supervisor.stage.sandbox import lookup_user
from sfguard.supervisor.stage.stage_bridge import bridge_root_for
from tests.daemon.conftest import ROOT, Daemon, start_real_guard
from tests.daemon.test_real_browser import as_stage, request_stage

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(os.geteuid() != 0, reason="browser users exist only under a root guard")]

#: a Python a browser user can run (the venv's may live under root's home)
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
#: run as a browser's uid: try each (what, kind, target); print {what: "denied" | "allowed" | ...}
PROBE = r"""
import json, os, socket, sys
out = {}
for what, kind, target in json.loads(sys.argv[1]):
    try:
        if kind == "list":
            os.listdir(target)
        elif kind == "read":
            with open(target, "rb") as fh:
                fh.read(1)
        elif kind == "write":
            with open(os.path.join(target, ".probe"), "wb") as fh:
                fh.write(b"x")
            os.unlink(os.path.join(target, ".probe"))
        elif kind == "connect":
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(target)
            s.close()
        elif kind == "signal":
            os.kill(int(target), 0)
        out[what] = "allowed"
    except PermissionError:
        out[what] = "denied"
    except OSError as exc:
        out[what] = f"error {exc.errno}"
print(json.dumps(out))
"""


@pytest.fixture
def root_daemon(tmp_path, site):
    d = start_real_guard(tmp_path, site, "site-a.test")
    yield d
    d.finish()


def as_uid(uid: int, gid: int, checks: list[tuple[str, str, str]]) -> dict[str, str]:
    res = subprocess.run([PYTHON, "-I", "-c", PROBE, json.dumps(checks)],
                         user=uid, group=gid, extra_groups=[], cwd="/",
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def main_browsers(runtime: Path) -> dict[str, psutil.Process]:
    """user-data-dir -> the Chromium main process of this guard using it."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            data = [a.split("=", 1)[1] for a in cmd if a.startswith("--user-data-dir=")]
            if data and data[0].startswith(str(runtime)) and not any(a.startswith("--type=") for a in cmd) \
                    and "chrom" in os.path.basename(cmd[0]).lower():
                out[data[0]] = p
        except psutil.Error:
            continue
    return out


def tree(main: psutil.Process, profile: str) -> list[psutil.Process]:
    """A browser's processes: its descendants and whatever names its profile (the crash handler
    double-forks out of the tree)."""
    procs = {main.pid: main, **{c.pid: c for c in main.children(recursive=True)}}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(profile in a for a in p.info["cmdline"] or []):
                procs[p.pid] = p
        except psutil.Error:
            continue
    return [p for p in procs.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def proc_status(pid: int, key: str) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return [int(g) for g in line.split()[1:]]
    return [-1]


def wait_renderers(main: psutil.Process, profile: str, n: int = 1) -> list[psutil.Process]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:   # renderers come up shortly after the main process
        procs = tree(main, profile)
        if sum(1 for p in procs if "--type=renderer" in p.cmdline()) >= n:
            return procs
        time.sleep(0.3)
    raise AssertionError(f"no renderer of {profile}")


def held_by(runtime: Path) -> dict[str, str]:
    """Browser user -> what the guard of `runtime` wrote in its lock file (its users in use)."""
    out = {}
    for f in lock_dir().glob("*.lock"):
        try:
            mark = json.loads(f.read_text() or "{}")
        except (OSError, ValueError):
            continue
        if mark.get("runtime") == str(runtime):
            out[f.name.removesuffix(".lock")] = mark.get("what", "")
    return out


def test_each_browser_runs_as_a_user_of_its_own_sandboxed_and_cannot_read_the_guard(root_daemon, site):
    d = root_daemon
    pool = [lookup_user(n) for n in PoolConfig().names()]
    assert all(pool), "a root guard creates its browser users at start"
    assert "browsers run each as a user of its own (16: sfguard-browser1 uid" in d.banner
    rt = runtime_path(d.home)

    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    env = request_stage(d, "r1", "s1", [f"site-a.test:{site}"], profile="acct")
    request_stage(d, "r1", "s2", [f"site-a.test:{site}"], profile=None)   # a throw-away browser
    assert env["AGENT_BROWSER_CDP"].startswith("ws://127.0.0.1:")
    mains = main_browsers(rt)
    assert len(mains) == 2, mains          # the anchor and the throw-away
    unsealed = rt / "profiles" / "local" / "acct"
    (temp,) = [Path(p) for p in mains if "/tp-" in p]
    users = {}
    for profile, main in mains.items():
        procs = wait_renderers(main, profile)
        uid = main.uids().real
        user = next(u for u in pool if u.uid == uid)
        users[profile] = user
        for p in procs:   # every process of that browser is its user's, none sandbox-less
            uids, gids = p.uids(), p.gids()
            assert (uids.real, uids.effective, uids.saved) == (uid,) * 3, p.cmdline()[:2]
            assert gids.real == user.gid and gids.effective == user.gid
            assert "--no-sandbox" not in p.cmdline()
            assert proc_status(p.pid, "Groups") == [], "a browser process kept supplementary groups"
        for r in (p for p in procs if "--type=renderer" in p.cmdline()):
            assert proc_status(r.pid, "Seccomp") == [2], "a renderer without its seccomp sandbox"
        home = Path(main.environ()["HOME"])
        for folder in (Path(profile), home, home / "downloads"):   # its own, 0700
            st = folder.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o700), folder
        ext = Path(next(a.split("=", 1)[1] for a in main.cmdline() if a.startswith("--disable-extensions-except=")))
        est = ext.stat()                                            # the guard's, its group only
        assert (est.st_uid, est.st_gid, stat.S_IMODE(est.st_mode)) == (0, user.gid, 0o750)
    assert len({u.uid for u in users.values()}) == 2, "two browsers share a user"
    owned_inside = {p.stat(follow_symlinks=False).st_uid for p in unsealed.rglob("*")}
    assert owned_inside == {users[str(unsealed)].uid}, "something in the profile is not its browser user's"
    assert sorted(held_by(rt)) == sorted(u.name for u in users.values())
    # the guard's own files stay root's and private; the runtime folder crossable by the pool only
    for path, mode in ((d.home, 0o700), (d.home / "keys", 0o700), (d.home / "guard.sock", 0o600),
                       (d.home / "runs", 0o700)):
        pst = path.stat()
        assert (pst.st_uid, stat.S_IMODE(pst.st_mode)) == (0, mode), path
    keyfile = d.home / "keys" / "local.key"
    assert keyfile.exists() and stat.S_IMODE(keyfile.stat().st_mode) == 0o600
    for folder in (rt, rt / "profiles", rt / "profiles" / "local", temp.parent):
        fst = folder.stat()
        assert (fst.st_uid, fst.st_gid, stat.S_IMODE(fst.st_mode)) == (0, 0, 0o710), folder
        assert sorted(acl_uids(folder)) == sorted(u.uid for u in pool), folder

    # -- as each browser's uid: nothing of the guard is readable; its own profile is (control)
    run_record = next((d.home / "runs").glob("*.json"))
    for profile, user in users.items():
        got = as_uid(user.uid, user.gid, [
            ("home", "list", str(d.home)), ("key file", "read", str(keyfile)),
            ("keys", "list", str(d.home / "keys")), ("run record", "read", str(run_record)),
            ("audit", "read", str(d.home / "audit.log")), ("sealed profiles", "list", str(d.home / "profiles")),
            ("control socket", "connect", str(d.home / "guard.sock")), ("leases", "list", str(d.home / "leases")),
            ("stage bridges", "list", str(bridge_root_for(rt))), ("runtime listing", "list", str(rt)),
            ("session sockets", "list", str(rt / "ab")), ("pinned config", "read", str(rt / "ab-config.json")),
            ("runtime write", "write", str(rt)), ("profiles listing", "list", str(rt / "profiles" / "local")),
            ("run folder listing", "list", str(temp.parent)),
            ("own profile", "list", profile), ("own profile write", "write", profile),
        ])
        own = {"own profile", "own profile write"}
        assert {k: v for k, v in got.items() if k not in own} == {k: "denied" for k in got if k not in own}, got
        assert got["own profile"] == got["own profile write"] == "allowed", got

    # -- end the run: resealed by root, the working copies gone, both users back in the pool
    assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
    assert not unsealed.exists() and not temp.exists()
    assert main_browsers(rt) == {}
    assert uid_processes([u.uid for u in users.values()]) == []
    assert held_by(rt) == {}


def login(env: dict, site: int) -> None:
    a = f"http://site-a.test:{site}"
    assert as_stage(env, "open", f"{a}/login").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    assert as_stage(env, "click", "button[type=submit]").returncode == 0
    as_stage(env, "wait", "1000")
    assert as_stage(env, "get", "url").stdout.strip().endswith("/account")


def cookies(env: dict, site: int) -> str:
    assert as_stage(env, "open", f"http://site-a.test:{site}/cookies").returncode == 0
    return as_stage(env, "get", "text", "#cookies").stdout


def test_two_runs_on_two_profiles_a_browser_user_cannot_reach_the_other_run(root_daemon, site):
    d = root_daemon
    rt = runtime_path(d.home)
    envs = {}
    for run, profile in (("ra", "pa"), ("rb", "pb")):
        assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
        envs[run] = request_stage(d, run, "s1", [f"site-a.test:{site}"], profile=profile)
        login(envs[run], site)
    mains = main_browsers(rt)
    side = {}
    for run, profile in (("ra", "pa"), ("rb", "pb")):
        pdir = str(rt / "profiles" / "local" / profile)
        main = mains[pdir]
        procs = wait_renderers(main, pdir)
        renderer = next(p for p in procs if "--type=renderer" in p.cmdline())
        user = lookup_user(next(n for n, what in held_by(rt).items() if what == f"run {run}"))
        assert user is not None and main.uids().real == user.uid
        home = main.environ()["HOME"]
        ext = next(a.split("=", 1)[1] for a in main.cmdline() if a.startswith("--disable-extensions-except="))
        side[run] = {"user": user, "checks": [
            ("profile", "list", pdir), ("cookie database", "read", f"{pdir}/Default/Cookies"),
            ("HOME", "list", home), ("downloads", "list", f"{home}/downloads"),
            ("NSS and caches in HOME", "list", f"{home}/.cache"), ("extension copy", "list", ext),
            ("browser environ", "read", f"/proc/{main.pid}/environ"),
            ("renderer environ", "read", f"/proc/{renderer.pid}/environ"),
            ("signal the browser", "signal", str(main.pid)), ("signal a renderer", "signal", str(renderer.pid)),
        ]}
        rec = json.loads((d.home / "runs" / f"{run}.json").read_text())   # the sweep's knowledge
        assert [u["uid"] for u in rec["browser_users"]] == [user.uid]
    assert side["ra"]["user"].uid != side["rb"]["user"].uid
    for me, other in (("ra", "rb"), ("rb", "ra")):
        user = side[me]["user"]
        theirs = as_uid(user.uid, user.gid, side[other]["checks"])
        assert theirs == {what: "denied" for what, _, _ in side[other]["checks"]}, (me, theirs)
        # the positive control: the same probe reaches its own run's browser (a taken-over
        # browser holds all of that, and no more)
        own = as_uid(user.uid, user.gid, [c for c in side[me]["checks"] if c[0] not in (
            "renderer environ", "NSS and caches in HOME")])
        assert set(own.values()) == {"allowed"}, (me, own)
    # both logins seal at their run's end and come back in the next run on the profile
    for run in ("ra", "rb"):
        assert d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[1]["ok"]
    assert held_by(rt) == {} and main_browsers(rt) == {}
    for run, profile in (("ra2", "pa"), ("rb2", "pb")):
        d.call("POST", "/v1/runs", {"run_id": run})
        text = cookies(request_stage(d, run, "s1", [f"site-a.test:{site}"], profile=profile), site)
        assert "sf_persist" in text and "sf_session" not in text, (run, text)
        assert d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[1]["ok"]


def test_kill_9_of_the_guard_then_a_start_returns_both_users_to_the_pool(root_daemon, site):
    d = root_daemon
    rt = runtime_path(d.home)
    for run, profile in (("ra", "pa"), ("rb", "pb")):
        d.call("POST", "/v1/runs", {"run_id": run})
        request_stage(d, run, "s1", [f"site-a.test:{site}"], profile=profile)
    names = sorted(held_by(rt))
    users = [lookup_user(n) for n in names]
    assert len(users) == 2 and all(users)
    uids = [u.uid for u in users]
    assert uid_processes(uids), "the two browsers run as their users"
    d.stop(signal.SIGKILL)
    assert uid_processes(uids), "a killed guard leaves its browsers running"
    assert sorted(held_by(rt)) == names    # ... and its users marked: no other guard takes them
    d.start(*d.last_args)
    assert "2 browser user(s) returned to the pool" in d.banner, d.banner
    assert uid_processes(uids) == [], "the sweep ended every process of both users"
    assert held_by(rt) == {}
    assert not [p for p in rt.rglob("*") if p.name == "Cookies"]
    # and they serve again: two new runs start at once
    for run, profile in (("rc", "pa"), ("rd", "pb")):
        d.call("POST", "/v1/runs", {"run_id": run})
        request_stage(d, run, "s1", [f"site-a.test:{site}"], profile=profile)
        assert d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[1]["ok"]


SLEEPER = "import sys, time\nprint('ready', flush=True)\ntime.sleep(120)\n"


def spawn_as(user, *argv: str) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, "-c", SLEEPER, *argv], user=user.uid, group=user.gid,
                            extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_sweep_ends_the_browser_users_orphans_of_this_guard_only(tmp_path):
    """A browser of a dead guard runs as a browser user, with no record left: `sfguard sweep`
    (what start does first) must find it by the runtime folder it names; the same user's
    process naming another folder, and another user's process naming this one, stay. The
    test holds that user's lock meanwhile (as a guard would), so no other guard takes it."""
    import fcntl
    home = (tmp_path / "home").absolute()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--no-console")
    assert d.stop() == 0
    stage_user = lookup_user("sfguard-stage")
    assert stage_user is not None and existing_uids()
    rt = runtime_path(home)
    for name in PoolConfig().names():
        fd = os.open(lock_dir() / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            user = lookup_user(name)
            break
        except BlockingIOError:
            os.close(fd)
    else:
        pytest.skip("every browser user is in use by other guards")
    try:
        orphan = spawn_as(user, "--fake-chromium", f"--user-data-dir={rt}/r-dead/tp-1")
        other_folder = spawn_as(user, "--fake-chromium", f"--user-data-dir={rt}-other/tp-1")
        other_user = spawn_as(stage_user, "--fake-chromium", f"--user-data-dir={rt}/r-dead/tp-2")
        try:
            res = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "sweep", "--home", str(home), "--json"],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            assert json.loads(res.stdout)["orphans"] == 1
            assert orphan.wait(timeout=10) is not None
            assert other_folder.poll() is None and other_user.poll() is None
        finally:
            for p in (orphan, other_folder, other_user):
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
    finally:
        os.close(fd)
