"""The `local_window` handoff route end to end, on a real X display (issue 36).

A real `sfguard start` (root guard, browsers as the browser user) runs in the "desktop
session" of an Xvfb the test starts (DISPLAY and XAUTHORITY in its environment, as a
session or a container given a display would have). The runner asks
POST /v1/runs/{run}/handoff kind local_window; the window shows on the display, titled with
site and profile, on the login page; the person types into it with xdotool (keys and clicks,
no CDP); the guard's login check says logged in; the window goes when the run ends; the next
run finds the login in the profile. Pictures in .ci-artifacts/handoff/.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sfguard.supervisor.browsers import xdisplay
from tests.daemon.conftest import Daemon
from tests.handoff.test_window import (  # noqa: F401  (xserver is a fixture)
    _x,
    find_window,
    grab,
    person_logs_in_until,
    save_png,
    xserver,
)

pytestmark = pytest.mark.browser
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def x_daemon(tmp_path, site, xserver):  # noqa: F811
    home = (tmp_path / "home").absolute()
    pol = tmp_path / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHONPATH": ROOT, "DISPLAY": xserver.display, "XAUTHORITY": str(xserver.auth)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1")
    yield d
    d.finish()


def _check(d, run, a):
    check = {"url": f"{a}/account", "logged_in": f"{a}/account", "logged_out": [f"{a}/login*"]}
    status, res = d.call("POST", f"/v1/runs/{run}/login-check", {"profile": "acct", "login_check": check})
    assert status == 200, res
    return res["logged_in"]


def _stage(d, run, headed):
    body = {"stage_id": "login", "attempt": 1,
            "browser": {"profile": "acct", "headed": headed, "allow_domains": ["site-a.test"]}}
    status, answer = d.call("POST", f"/v1/runs/{run}/stages", body)
    assert status == 200, answer


def test_local_window_handoff_through_the_guard(x_daemon, site, xserver):  # noqa: F811
    d = x_daemon
    a = f"http://site-a.test:{site}"
    env = {"PATH": os.environ["PATH"], "DISPLAY": xserver.display, "XAUTHORITY": str(xserver.auth)}
    assert d.call("POST", "/v1/runs", {"run_id": "login1"})[0] == 201
    _stage(d, "login1", headed=False)   # the handoff reopens the anchor as a window
    assert not _check(d, "login1", a)
    started = time.monotonic()
    status, payload = d.call("POST", "/v1/runs/login1/handoff",
                             {"profile": "acct", "site": "site-a.test", "reason": "log in, please",
                              "url": f"{a}/login?next=/account", "kind": "local_window"})
    assert status == 200, payload
    assert payload["kind"] == "local_window" and payload["url"] == f"{a}/login?next=/account"
    title = xdisplay.window_title("acct", "site-a.test")
    wid = find_window(title, env)
    info = _x("xwininfo", "-id", wid, env=env)
    assert f'"{title}"' in info and "IsViewable" in info
    # the stage keeps waiting: the run and its stage are still there
    status, stage = d.call("GET", "/v1/runs/login1/stages/login")
    assert status == 200 and stage["state"] == "ready", stage
    person_logs_in_until(lambda: _check(d, "login1", a), wid, env, "operator", "correct-horse", "route")
    w, h, rows = grab(wid, env)
    save_png("route-logged-in", w, h, rows)
    assert time.monotonic() - started < 120
    assert d.call("POST", "/v1/runs/login1/end", {"outcome": "succeeded"})[0] == 200
    assert find_window(title, env, present=False) is None   # the window goes with the run
    # the next run, headless: the login is in the profile
    assert d.call("POST", "/v1/runs", {"run_id": "next1"})[0] == 201
    _stage(d, "next1", headed=False)
    assert _check(d, "next1", a), "the login did not stay in the profile"
    d.call("POST", "/v1/runs/next1/end", {"outcome": "succeeded"})


def _headless(d, run) -> bool:
    status, body = d.call("GET", f"/v1/runs/{run}")
    assert status == 200, body
    return all(not b["headed"] for b in body["browsers"])


def test_a_window_handoff_expires_or_ends_with_its_stage(x_daemon, site, xserver):  # noqa: F811
    d = x_daemon
    a = f"http://site-a.test:{site}"
    env = {"PATH": os.environ["PATH"], "DISPLAY": xserver.display, "XAUTHORITY": str(xserver.auth)}
    title = xdisplay.window_title("acct", "site-a.test")
    assert d.call("POST", "/v1/runs", {"run_id": "tw1"})[0] == 201
    _stage(d, "tw1", headed=False)
    body = {"profile": "acct", "site": "site-a.test", "reason": "log in, please", "url": f"{a}/login",
            "kind": "local_window", "stage_id": "login", "timeout_s": 10}
    status, payload = d.call("POST", "/v1/runs/tw1/handoff", body)
    assert status == 200 and payload["kind"] == "local_window", payload
    find_window(title, env)
    assert d.call("GET", "/v1/runs/tw1/handoff")[1] == {"state": "open", "kind": "local_window",
                                                        "site": "site-a.test", "profile": "acct"}
    assert not _headless(d, "tw1")
    # nobody logs in: the handoff expires, the window goes, the anchor is headless again
    started = time.monotonic()
    status, state = d.call("GET", "/v1/runs/tw1/handoff?wait=30")
    assert status == 200 and state["state"] == "expired", state
    assert 5 < time.monotonic() - started < 25
    assert find_window(title, env, present=False) is None
    assert _headless(d, "tw1")
    status, stage = d.call("GET", "/v1/runs/tw1/stages/login")
    assert status == 200 and stage["state"] == "ready", stage   # the stage works on
    # a second handoff ends with its login stage
    status, payload = d.call("POST", "/v1/runs/tw1/handoff", {**body, "timeout_s": 600})
    assert status == 200, payload
    find_window(title, env)
    assert d.call("POST", "/v1/runs/tw1/stages/login/end", {"outcome": "succeeded"})[0] == 200
    status, state = d.call("GET", "/v1/runs/tw1/handoff?wait=20")
    assert state["state"] == "ended", state
    assert find_window(title, env, present=False) is None
    assert _headless(d, "tw1")
    d.call("POST", "/v1/runs/tw1/end", {"outcome": "succeeded"})
    audit = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "show", "--run", "tw1",
                            "--home", str(d.home)], cwd=ROOT, env=d.env, capture_output=True, text=True,
                           timeout=60).stdout
    closed = [line for line in audit.splitlines() if "handoff_closed" in line]
    assert len(closed) == 2 and "expired" in closed[0] and "ended" in closed[1], audit


def test_a_person_logs_in_through_a_headed_stages_window(x_daemon, site, xserver):  # noqa: F811
    from tests.daemon.test_real_browser import as_stage
    d = x_daemon
    a = f"http://site-a.test:{site}"
    env = {"PATH": os.environ["PATH"], "DISPLAY": xserver.display, "XAUTHORITY": str(xserver.auth)}
    assert d.call("POST", "/v1/runs", {"run_id": "hs1"})[0] == 201
    body = {"stage_id": "work", "attempt": 1,
            "browser": {"profile": "acct", "headed": True, "allow_domains": ["site-a.test"]}}
    status, answer = d.call("POST", "/v1/runs/hs1/stages", body)
    assert status == 200, answer
    assert not _check(d, "hs1", a)
    assert as_stage(answer["env"], "open", f"{a}/login?next=/account").returncode == 0
    title = xdisplay.window_title("acct")
    wid = find_window(title, env)
    assert "IsViewable" in _x("xwininfo", "-id", wid, env=env)
    person_logs_in_until(lambda: _check(d, "hs1", a), wid, env, "operator", "correct-horse", "headed-stage")
    w, h, rows = grab(wid, env)
    save_png("headed-stage-logged-in", w, h, rows)
    assert d.call("POST", "/v1/runs/hs1/end", {"outcome": "succeeded"})[0] == 200
    assert find_window(title, env, present=False) is None
