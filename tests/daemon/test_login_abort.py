"""`sfguard profiles login NAME` aborted (issue 35, section 6): a profile the login created is
removed again; an existing profile is kept. The guard has no screen here, so the login is a
live view that nobody confirms within --wait."""
from __future__ import annotations

import subprocess
import sys
import time

from tests.daemon.conftest import ROOT


def login(daemon, name: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "profiles", "login", name,
                          "--url", "https://site-a.test/", "--wait", "1", "--home",
                          str(daemon.home)], cwd=ROOT, env=daemon.env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    # --wait is kept: the login ends after about a second, not after the guard's 30 s long-poll
    assert time.monotonic() - started < 20, (time.monotonic() - started, out.stdout)
    return out


def names(daemon) -> list[str]:
    return [p["name"] for p in daemon.call("GET", "/v1/profiles")[1]["profiles"]]


def test_an_aborted_login_leaves_no_empty_profile(daemon):
    out = login(daemon, "newsite")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not confirmed" in out.stdout
    assert names(daemon) == []
    assert daemon.call("POST", "/v1/runs", {"run_id": "keep"})[0] == 201    # an existing one stays
    daemon.call("POST", "/v1/runs/keep/stages", {"stage_id": "s", "attempt": 1,
                                                 "browser": {"profile": "kept", "headed": False}})
    daemon.call("POST", "/v1/runs/keep/end", {"outcome": "succeeded"})
    assert login(daemon, "kept").returncode == 1
    assert names(daemon) == ["kept"]
