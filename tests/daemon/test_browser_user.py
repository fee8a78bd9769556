"""Layer 2 of issue 13, through a real `sfguard start` as root with real Chromium: every browser
runs as the browser user with Chromium's sandbox on, owns only its profile (and its HOME), and
cannot read the guard's home, keys, run records or control socket.

Checked from outside as a user would: process uids and command lines, the kernel's seccomp
state of the renderers, file owners and modes, and attempts made AS the browser user (a
subprocess dropped to its uid) to open the guard's files."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.browsers.browser_user import DEFAULT_BROWSER_USER
from sfguard.supervisor.home import runtime_path
from sfguard.supervisor.stage.sandbox import lookup_user
from sfguard.supervisor.stage.stage_bridge import bridge_root_for
from tests.daemon.conftest import ROOT, Daemon, start_real_guard
from tests.daemon.test_real_browser import request_stage

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(os.geteuid() != 0, reason="a browser user exists only under a root guard")]

#: a Python the browser user can run (the venv's may live under root's home)
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
#: run as the browser user: try each (what, kind, path); print {what: "denied" | "allowed"}
PROBE = r"""
import json, os, socket, sys
out = {}
for what, kind, path in json.loads(sys.argv[1]):
    try:
        if kind == "list":
            os.listdir(path)
        elif kind == "read":
            with open(path, "rb") as fh:
                fh.read(1)
        elif kind == "write":
            with open(os.path.join(path, ".probe"), "wb") as fh:
                fh.write(b"x")
            os.unlink(os.path.join(path, ".probe"))
        elif kind == "connect":
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(path)
            s.close()
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


def as_user(user, checks: list[tuple[str, str, str]]) -> dict[str, str]:
    res = subprocess.run([PYTHON, "-I", "-c", PROBE, json.dumps(checks)],
                         user=user.uid, group=user.gid, extra_groups=[], cwd="/",
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def browser_tree(runtime: Path) -> list[psutil.Process]:
    """Every process of this guard's browsers: the Chromium main processes (their profile is
    under the runtime folder), all their descendants, and anything else naming the runtime
    folder in its command line (the crash handler double-forks out of the tree)."""
    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if any(str(runtime) in a for a in cmd) and "chrom" in " ".join(cmd[:1]).lower():
                procs[p.pid] = p
                for c in p.children(recursive=True):
                    procs[c.pid] = c
        except psutil.Error:
            continue
    return [p for p in procs.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def proc_groups(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Groups:"):
            return [int(g) for g in line.split()[1:]]
    return [-1]


def seccomp_mode(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Seccomp:"):
            return int(line.split()[1])
    return -1


def test_browsers_run_as_the_browser_user_sandboxed_and_cannot_read_the_guard(root_daemon, site):
    d = root_daemon
    user = lookup_user(DEFAULT_BROWSER_USER)
    assert user is not None and user.uid != 0, "a root guard creates its browser user at start"
    assert f"browsers run as {user.name} (uid {user.uid}), Chromium's sandbox on" in d.banner
    rt = runtime_path(d.home)

    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    env = request_stage(d, "r1", "s1", [f"site-a.test:{site}"], profile="acct")
    request_stage(d, "r1", "s2", [f"site-a.test:{site}"], profile=None)   # a throw-away browser
    assert env["AGENT_BROWSER_CDP"].startswith("ws://127.0.0.1:")

    # -- processes: all of the browser user, none with --no-sandbox, renderers in seccomp
    procs = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:   # renderers come up shortly after the main process
        procs = browser_tree(rt)
        if sum(1 for p in procs if "--type=renderer" in p.cmdline()) >= 2:
            break
        time.sleep(0.3)
    mains = [p for p in procs if not any(a.startswith("--type=") for a in p.cmdline())
             and "--user-data-dir=" in " ".join(p.cmdline())]
    assert len(mains) == 2, [p.cmdline()[:3] for p in procs]          # the anchor and the throw-away
    renderers = [p for p in procs if "--type=renderer" in p.cmdline()]
    assert len(renderers) >= 2
    for p in procs:
        uids, gids = p.uids(), p.gids()
        assert (uids.real, uids.effective, uids.saved) == (user.uid,) * 3, p.cmdline()[:2]
        assert gids.real == user.gid and gids.effective == user.gid
        assert "--no-sandbox" not in p.cmdline()
        assert proc_groups(p.pid) == [], "a browser process kept supplementary groups"
    for r in renderers:
        assert seccomp_mode(r.pid) == 2, "a renderer without its seccomp sandbox"

    # -- files: the unsealed profile and the throw-away profile are the browser user's, 0700
    unsealed = rt / "profiles" / "local" / "acct"
    st = unsealed.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (user.uid, 0o700)
    owned_inside = {p.stat(follow_symlinks=False).st_uid for p in unsealed.rglob("*")}
    assert owned_inside == {user.uid}, "something in the profile is not the browser user's"
    temp = [Path(a.split("=", 1)[1]) for p in mains for a in p.cmdline()
            if a.startswith("--user-data-dir=") and "/tp-" in a]
    assert len(temp) == 1
    tst = temp[0].stat()
    assert (tst.st_uid, stat.S_IMODE(tst.st_mode)) == (user.uid, 0o700)
    # the guard's own files stay root's and private
    for path, mode in ((d.home, 0o700), (d.home / "keys", 0o700), (d.home / "guard.sock", 0o600),
                       (d.home / "runs", 0o700)):
        pst = path.stat()
        assert (pst.st_uid, stat.S_IMODE(pst.st_mode)) == (0, mode), path
    keyfile = d.home / "keys" / "local.key"
    assert keyfile.exists() and stat.S_IMODE(keyfile.stat().st_mode) == 0o600
    rst = rt.stat()
    assert (rst.st_uid, rst.st_gid, stat.S_IMODE(rst.st_mode)) == (0, user.gid, 0o710)

    # -- as the browser user: nothing of the guard is readable; its own profile is (control)
    run_record = next((d.home / "runs").glob("*.json"))
    got = as_user(user, [
        ("home", "list", str(d.home)),
        ("key file", "read", str(keyfile)),
        ("keys", "list", str(d.home / "keys")),
        ("run record", "read", str(run_record)),
        ("audit", "read", str(d.home / "audit.log")),
        ("sealed profiles", "list", str(d.home / "profiles")),
        ("control socket", "connect", str(d.home / "guard.sock")),
        ("leases", "list", str(d.home / "leases")),
        ("stage bridges", "list", str(bridge_root_for(rt))),
        ("runtime listing", "list", str(rt)),
        ("session sockets", "list", str(rt / "ab")),
        ("pinned config", "read", str(rt / "ab-config.json")),
        ("runtime write", "write", str(rt)),
        ("profiles listing", "list", str(rt / "profiles" / "local")),
        ("own profile", "list", str(unsealed)),
        ("own profile write", "write", str(unsealed)),
    ])
    own = {"own profile", "own profile write"}
    assert {k: v for k, v in got.items() if k not in own} == {k: "denied" for k in got if k not in own}, got
    assert got["own profile"] == got["own profile write"] == "allowed", got

    # -- end the run: resealed by root, the working copy gone, no browser user process left
    assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
    assert not unsealed.exists() and not temp[0].exists()
    assert browser_tree(rt) == []
    assert [p.pid for p in psutil.process_iter(["uids", "cmdline"])
            if p.info["uids"] and p.info["uids"].real == user.uid
            and str(rt) in " ".join(p.info["cmdline"] or [])] == []


SLEEPER = "import sys, time\nprint('ready', flush=True)\ntime.sleep(120)\n"


def spawn_as(user, *argv: str) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, "-c", SLEEPER, *argv], user=user.uid, group=user.gid,
                            extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_sweep_ends_the_browser_users_orphans_of_this_guard_only(tmp_path):
    """A browser of a dead guard runs as the browser user, with no record left: `sfguard
    sweep` (what start does first) must find it by the runtime folder it names; the same
    user's process naming another folder, and another user's process naming this one, stay."""
    home = (tmp_path / "home").absolute()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--no-console")
    assert d.stop() == 0
    user = lookup_user(DEFAULT_BROWSER_USER)
    stage_user = lookup_user("sfguard-stage")
    assert user is not None and stage_user is not None
    rt = runtime_path(home)
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
