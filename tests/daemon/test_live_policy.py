"""The live policy lives with the guard (issue 35, section 2): a fresh home gets its sites.yaml
from the shipped template (0600 in a 0700 home) and the guard enforces it, edits to it are
live, and `sfguard policy explain|validate|test` and `sfguard validate` with --home check the
policy the running guard of that home enforces, also when it was started on another file, and
say which file they checked. Real `sfguard start` subprocesses, as an operator runs them."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from sfguard import policy
from tests.daemon.conftest import ROOT, Daemon


def guard_env(tmp_path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
            "PYTHONPATH": str(ROOT)}


def sfguard(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**guard_env(tmp_path), "SFGUARD_HOME": str(tmp_path / "elsewhere")}
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture
def fresh_guard(tmp_path):
    d = Daemon((tmp_path / "home").absolute(), guard_env(tmp_path), tmp_path / "daemon.log")
    d.start("--no-console")
    yield d
    d.finish()


def test_a_fresh_home_enforces_its_own_copy_of_the_template_and_edits_are_live(fresh_guard, tmp_path):
    home = fresh_guard.home
    live = home / "sites.yaml"
    assert live.read_bytes() == policy.default_policy_path().read_bytes()
    assert stat.S_IMODE(live.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    status, body = fresh_guard.call("GET", "/v1/status")
    assert (status, body["policy"]["file"], body["policy"]["mode"]) == (200, str(live), "enforce")
    shown = sfguard(tmp_path, "status", "--home", str(home))
    assert f"policy  {live} mode enforce" in shown.stdout, shown.stdout
    # a reviewer's edit is live, without a restart
    live.write_text(live.read_text().replace("mode: enforce", "mode: report"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if fresh_guard.call("GET", "/v1/status")[1]["policy"]["mode"] == "report":
            break
        time.sleep(0.2)
    assert fresh_guard.call("GET", "/v1/status")[1]["policy"]["mode"] == "report"
    # a restart keeps the reviewer's file (it is never replaced by the template again)
    assert fresh_guard.stop() == 0
    fresh_guard.start("--no-console")
    assert "mode: report" in live.read_text()
    assert fresh_guard.call("GET", "/v1/status")[1]["policy"]["mode"] == "report"


def test_the_policy_commands_check_what_the_running_guard_enforces(tmp_path):
    other = tmp_path / "live.yaml"
    other.write_text('version: 1\nblock:\n  - pattern: pastebin.com\n    reason: "no pastes"\n')
    cases = tmp_path / "cases.yaml"
    cases.write_text("- {host: pastebin.com, expect: deny, reason: blocked_by_policy}\n")
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text('stages:\n  - id: s\n    browser:\n      allow_domains: ["pastebin.com"]\n')
    d = Daemon((tmp_path / "home").absolute(), guard_env(tmp_path), tmp_path / "daemon.log")
    d.start("--no-console", "--policy", str(other))
    try:
        home = str(d.home)
        said = f"checked against the policy {other} (the policy the guard running on {home} enforces)"
        proc = sfguard(tmp_path, "policy", "explain", "pastebin.com", "--home", home, "--json")
        assert proc.returncode == 0, proc.stderr
        row = json.loads(proc.stdout)
        assert (row["decision"], row["reason"], row["rule"], row["policy"]) == (
            "deny", "blocked_by_policy", "live.yaml:3 pastebin.com", str(other))
        assert said in proc.stderr
        proc = sfguard(tmp_path, "policy", "validate", "--home", home)
        assert proc.returncode == 0 and proc.stdout.startswith(f"{other}: valid"), proc.stdout
        assert said in proc.stderr
        proc = sfguard(tmp_path, "policy", "test", str(cases), "--home", home)
        assert proc.returncode == 0 and "1 passed, 0 failed" in proc.stdout, proc.stdout + proc.stderr
        assert said in proc.stderr
        proc = sfguard(tmp_path, "validate", str(pipeline), "--home", home, "--no-tool-check")
        assert proc.returncode == 1 and "blocked by the site policy (live.yaml:3" in proc.stdout
        assert said in proc.stderr
    finally:
        d.finish()
    # no guard runs: what the next `sfguard start` there would enforce, named as such: the
    # template (a guard started with --policy made no HOME/sites.yaml), then the home's own file
    proc = sfguard(tmp_path, "policy", "explain", "pastebin.com", "--home", home, "--json")
    assert json.loads(proc.stdout)["reason"] == "not_allowed"
    assert f"the shipped template: no guard home with a policy at {home}" in proc.stderr
    (d.home / "sites.yaml").write_text(other.read_text())
    proc = sfguard(tmp_path, "policy", "explain", "pastebin.com", "--home", home, "--json")
    assert json.loads(proc.stdout)["rule"] == "sites.yaml:3 pastebin.com"
    assert f"the policy {home}/sites.yaml (the policy of the guard home {home}; no guard runs" in proc.stderr
    # a home that does not exist is an error, not a silent fallback
    proc = sfguard(tmp_path, "policy", "explain", "pastebin.com", "--home", str(tmp_path / "typo"))
    assert proc.returncode == 2 and "no guard home at" in proc.stderr
