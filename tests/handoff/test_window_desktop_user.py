"""The `local_window` handoff through a guard run by an ordinary desktop user (issue 36): the
guard (`sfguard start`) runs as an unprivileged user in that user's X session (its own DISPLAY
and X cookie), so its browsers run as that user with Chromium's sandbox on. The person types
into the window with xdotool (keys and clicks only); the guard's login check says logged in;
the window goes with the run; the next run finds the login in the profile.

This machine's Python lives under /root (mode 0700), out of an ordinary user's reach: the guard
is started through bubblewrap with an empty /root holding only that interpreter, read-only,
then `setpriv` to the user. Nothing else of root's is visible to it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.browsers import xdisplay
from sfguard.supervisor.stage.sandbox import ensure_system_user
from tests.daemon.conftest import ROOT, Daemon
from tests.handoff.test_window import (  # noqa: F401  (xserver is a fixture)
    find_window,
    grab,
    person_logs_in_until,
    save_png,
    xserver,
)

pytestmark = pytest.mark.browser
DESKTOP_USER = "sfg-desktop"


def as_user(uid: int, gid: int) -> list[str]:
    """The argv prefix that starts the guard as the desktop user: bubblewrap with an empty /root
    holding only this interpreter (read-only), then setpriv."""
    # --die-with-parent: a safety net only; the fixture stops the guard itself (stop_guard)
    prefix = ["bwrap", "--die-with-parent", "--dev-bind", "/", "/", "--tmpfs", "/root"]
    python_home = Path(os.path.realpath(sys.executable)).parents[3]     # /root/.pyenv
    if str(python_home).startswith("/root/"):
        prefix += ["--ro-bind", str(python_home), str(python_home)]
    return [*prefix, "--", "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


def stop_guard(home: Path, bound: float = 60) -> None:
    """Stop the guard as its operator would, by the pid it wrote into its lock file: bwrap
    does not pass a signal on to what it runs, so signalling the Daemon's process (bwrap)
    would leave the guard running after the test."""
    try:
        pid = int((home / "guard.lock").read_text().strip() or 0)
        proc = psutil.Process(pid)
        if "sfguard" not in " ".join(proc.cmdline()) or str(home) not in " ".join(proc.cmdline()):
            return
        proc.terminate()
    except (OSError, ValueError, psutil.NoSuchProcess):
        return
    try:
        proc.wait(bound)
    except psutil.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the guard (pid {proc.pid}) did not stop within {bound:.0f} s of SIGTERM") from None


@pytest.fixture
def desktop(site, xserver):  # noqa: F811
    if os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, bubblewrap and setpriv to start a guard as another user")
    user = ensure_system_user(DESKTOP_USER, "desktop")
    base = Path(tempfile.mkdtemp(prefix="sfg-desk-", dir="/tmp"))
    os.chown(base, user.uid, user.gid)
    os.chmod(base, 0o700)
    xauth = base / "session.xauth"                  # the desktop user's own X cookie
    shutil.copy(xserver.auth, xauth)
    os.chown(xauth, user.uid, user.gid)
    pol = base / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    os.chown(pol, user.uid, user.gid)
    env = {"PATH": os.environ["PATH"], "HOME": str(base), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT),
           "DISPLAY": xserver.display, "XAUTHORITY": str(xauth)}
    d = Daemon(base / "home", env, base / "daemon.log")
    d.argv_prefix, d.ready_timeout = as_user(user.uid, user.gid), 60.0
    d.start("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1", "--no-console")

    def stop(sig=None, timeout: float = 60) -> int:
        """The Daemon's own stop signals its process, bwrap, which neither passes the signal on
        nor takes the guard with it: teardown (and the sweep's start and stop in `finish`)
        stops the guard by its pid, then waits for bwrap to end with the guard's status."""
        stop_guard(d.home, timeout)
        if d.proc is None:
            return 0
        try:
            return d.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            return d.proc.wait(10)

    d.stop = stop  # type: ignore[method-assign]
    yield d, user
    d.finish()
    subprocess.run(["chown", "-R", "root:root", str(base)], check=False)
    shutil.rmtree(base, ignore_errors=True)


def _check(d, run, a):
    check = {"url": f"{a}/account", "logged_in": f"{a}/account", "logged_out": [f"{a}/login*"]}
    status, res = d.call("POST", f"/v1/runs/{run}/login-check", {"profile": "acct", "login_check": check})
    assert status == 200, res
    return res["logged_in"]


def _stage(d, run):
    body = {"stage_id": "login", "attempt": 1,
            "browser": {"profile": "acct", "headed": False, "allow_domains": ["site-a.test"]}}
    status, answer = d.call("POST", f"/v1/runs/{run}/stages", body)
    assert status == 200, answer


def test_a_desktop_users_guard_shows_the_login_window_as_that_user(desktop, site, xserver):  # noqa: F811
    d, user = desktop
    a = f"http://site-a.test:{site}"
    env = {"PATH": os.environ["PATH"], "DISPLAY": xserver.display, "XAUTHORITY": str(xserver.auth)}
    assert d.call("POST", "/v1/runs", {"run_id": "desk1"})[0] == 201
    _stage(d, "desk1")
    assert not _check(d, "desk1", a)
    status, payload = d.call("POST", "/v1/runs/desk1/handoff",
                             {"profile": "acct", "site": "site-a.test", "reason": "log in, please",
                              "url": f"{a}/login?next=/account", "kind": "local_window"})
    assert status == 200 and payload["kind"] == "local_window", payload
    title = xdisplay.window_title("acct", "site-a.test")
    wid = find_window(title, env)
    # the browser runs as the desktop user, with Chromium's sandbox on
    browsers = [p for p in psutil.process_iter(["uids", "cmdline"])
                if p.info["cmdline"] and "--window-name=" + title in p.info["cmdline"]]
    assert browsers, "the window's browser process was not found"
    for p in browsers:
        assert p.info["uids"].real == user.uid and "--no-sandbox" not in p.info["cmdline"]
    person_logs_in_until(lambda: _check(d, "desk1", a), wid, env, "operator", "correct-horse", "desktop-user")
    time.sleep(1.0)
    w, h, rows = grab(wid, env)
    save_png("desktop-user-logged-in", w, h, rows)
    assert d.call("POST", "/v1/runs/desk1/end", {"outcome": "succeeded"})[0] == 200
    assert find_window(title, env, present=False) is None
    assert d.call("POST", "/v1/runs", {"run_id": "desk2"})[0] == 201
    _stage(d, "desk2")
    assert _check(d, "desk2", a), "the login did not stay in the profile"
    d.call("POST", "/v1/runs/desk2/end", {"outcome": "succeeded"})
