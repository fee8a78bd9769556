"""A root guard runs each browser as a user of its own pool (issue 50): a full pool queues a
stage that needs another browser, like a busy profile, with the reason in the stage answer; a
browser's end gives its user back and the waiting stage starts.

A real `sfguard start` as root with the fake agent-browser and fake Chromium, and a pool of
one user of its own (prefix `sfgtest-pool`: no other guard on this machine uses it). That user
is the guard's pool, created by the guard at start; the fixture removes it afterwards."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from sfguard.supervisor.browsers.browser_pool import lock_dir
from sfguard.supervisor.home import runtime_dir
from sfguard.supervisor.procs import uid_processes
from sfguard.supervisor.stage.sandbox import lookup_user
from tests.daemon.conftest import FAKE_AB, ROOT, Daemon, fake_browser_for, write_home_policy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="browser users exist only under a root guard")

PREFIX = "sfgtest-pool"


@pytest.fixture
def one_user_guard(tmp_path, fake_cdp):
    home = (tmp_path / "home").absolute()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "SFGUARD_AGENT_BROWSER": str(FAKE_AB), "SFGUARD_BROWSER": str(fake_browser_for(tmp_path)),
           "PYTHONPATH": str(ROOT)}
    rt = runtime_dir(home)
    (rt / "ab").mkdir(mode=0o700, exist_ok=True)
    (rt / "ab" / "fake-control.json").write_text(json.dumps(
        {"cdp_url": fake_cdp.url, "log": str(tmp_path / "fake-ab.jsonl")}))
    write_home_policy(home)
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--browser-users", PREFIX, "--browser-pool-size", "1", "--no-console")
    try:
        yield d
    finally:
        d.finish()
        user = lookup_user(f"{PREFIX}1")
        if user is not None:
            assert uid_processes([user.uid]) == [], "a process of the test's browser user outlived the guard"
            subprocess.run(["userdel", user.name], check=True, capture_output=True, timeout=30)
        (lock_dir() / f"{PREFIX}1.lock").unlink(missing_ok=True)


def stage(sid: str, profile: str | None) -> dict:
    browser: dict = {"headed": False, "allow_domains": ["site-a.test"]}
    if profile is not None:
        browser["profile"] = profile
    return {"stage_id": sid, "attempt": 1, "browser": browser}


@pytest.mark.parametrize("first, second", [(None, None), ("acct", "other"), (None, "acct")],
                         ids=["throwaway-then-throwaway", "profile-then-profile", "throwaway-then-profile"])
def test_a_full_pool_queues_the_stage_with_its_reason_until_a_browser_ends(one_user_guard, first, second):
    d = one_user_guard
    assert "browsers run each as a user of its own (1: sfgtest-pool1 uid" in d.banner
    for run in ("r1", "r2"):
        assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    status, ready = d.call("POST", "/v1/runs/r1/stages", stage("s1", first))
    assert status == 200 and ready["state"] == "ready", ready
    status, waiting = d.call("POST", "/v1/runs/r2/stages", stage("s1", second))
    assert status == 202, waiting
    assert waiting["state"] == "waiting" and waiting["reason"] == "browser_pool_full", waiting
    assert "all 1 browser users of this guard are in use" in waiting["message"]
    if second is not None:      # waiting for a user, the run holds no profile meanwhile
        leases = {l["profile"]: l for l in d.call("GET", "/v1/status")[1]["leases"]}
        assert leases.get(second, {}).get("holder_run") in (None, ""), leases
    # the same run's stage on its running browser does not need another user
    if first is not None:
        assert d.call("POST", "/v1/runs/r1/stages", stage("s2", first))[0] == 200
    assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[1]["ok"]
    status, now = d.call("GET", "/v1/runs/r2/stages/s1?wait=20")
    assert status == 200 and now["state"] == "ready", now
    assert d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})[1]["ok"]
