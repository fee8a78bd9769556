"""`sfguard profiles check` and `profiles login` against a real running guard (Chromium,
agent-browser, mitmproxy, the fixture login site)."""
from __future__ import annotations

import os
import subprocess

import pytest

from sfguard.supervisor.browsers import tools
from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.protocols import LOCAL_SCOPE, Granted, ProfileKey
from tests.demo.conftest import sfguard

pytestmark = pytest.mark.browser


def as_stage(env: dict, *args: str) -> subprocess.CompletedProcess:
    stage_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env}
    return subprocess.run([tools.find_agent_browser().path, *args], env=stage_env,
                          capture_output=True, text=True, timeout=60)


def check_args(guard, port, *extra):
    a = f"http://site-a.test:{port}"
    return ["profiles", "check", "acct", "--url", f"{a}/account", "--logged-in", f"{a}/account",
            "--logged-out", f"{a}/login*", "--home", str(guard.home), *extra]


def login_as_a_stage(guard, port):
    a = f"http://site-a.test:{port}"
    assert guard.call("POST", "/v1/runs", {"run_id": "prep"})[0] == 201
    status, ans = guard.call("POST", "/v1/runs/prep/stages", {
        "stage_id": "login", "attempt": 1,
        "browser": {"profile": "acct", "headed": False, "allow_domains": ["site-a.test"]}})
    assert status == 200, ans
    env = ans["env"]
    for args in (("open", f"{a}/login"), ("fill", "input[name=user]", "operator"),
                 ("fill", "input[name=password]", "correct-horse"), ("click", "button[type=submit]")):
        assert as_stage(env, *args).returncode == 0, args[0]
    as_stage(env, "wait", "1000")
    guard.call("POST", "/v1/runs/prep/stages/login/end", {"outcome": "succeeded"})
    assert guard.call("POST", "/v1/runs/prep/end", {"outcome": "succeeded"})[1]["ok"]


def runs_all_ended(guard) -> bool:
    st = guard.call("GET", "/v1/status")[1]
    return (all(r["state"] != "active" for r in st["runs"])
            and all(l["holder_run"] is None and not l["queue"] for l in st["leases"]))


def test_check_before_and_after_a_login(guard, site):
    # no such profile yet: an error (2), and the check did not create one
    r = sfguard(*check_args(guard, site))
    assert r.returncode == 2 and "no profile 'acct'" in r.stderr, (r.stdout, r.stderr)
    assert guard.call("GET", "/v1/profiles")[1]["profiles"] == []

    assert sfguard("profiles", "create", "acct", "--home", str(guard.home)).returncode == 0
    r = sfguard(*check_args(guard, site))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "NOT logged in" in r.stdout and f"http://site-a.test:{site}/login?next=…" in r.stdout
    assert runs_all_ended(guard)

    login_as_a_stage(guard, site)

    # (extra args, exit code): the selector can only turn "logged in" into "logged out"
    for extra, code in (((), 0), (("--selector", "#signed-in"), 0), (("--selector", "#nope"), 1)):
        r = sfguard(*check_args(guard, site, *extra))
        assert r.returncode == code, (extra, r.stdout, r.stderr)
    r = sfguard(*check_args(guard, site))
    assert f"logged in (final address http://site-a.test:{site}/account)" in r.stdout, (r.stdout, r.stderr)
    # patterns that match neither address: an error, not a guess
    a = f"http://site-a.test:{site}"
    r = sfguard("profiles", "check", "acct", "--url", f"{a}/account", "--logged-in", f"{a}/elsewhere",
                "--logged-out", f"{a}/nowhere", "--home", str(guard.home))
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert runs_all_ended(guard)
    audit = (guard.home / "audit.log").read_text()
    assert audit.count('"login_checked"') >= 5 and "correct-horse" not in audit


def test_check_of_a_profile_in_use_fails_without_waiting(guard, site):
    assert sfguard("profiles", "create", "acct", "--home", str(guard.home)).returncode == 0
    lease = LocalProfileLease(guard.home)
    key = ProfileKey(LOCAL_SCOPE, "acct")
    assert isinstance(lease.try_acquire(key, "other-run"), Granted)
    try:
        r = sfguard(*check_args(guard, site))
        assert r.returncode == 2 and "in use by run 'other-run'" in r.stderr, (r.stdout, r.stderr)
        assert [q.run for q in lease.queue(key)] == []  # our run left the queue
    finally:
        lease.release(key, "other-run")


def test_login_without_a_display_or_console_fails_clearly(tmp_path, site):
    from tests.daemon.conftest import Daemon
    from tests.demo.conftest import ROOT
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    guard = Daemon((tmp_path / "nc").absolute(), env, tmp_path / "nc.log")
    pol = tmp_path / "nc-sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    guard.start("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1", "--no-console")
    try:
        _login_refused(guard, site)
    finally:
        guard.stop()


def _login_refused(guard, site):
    r = sfguard("profiles", "login", "acct", "--url", f"http://site-a.test:{site}/login",
                "--home", str(guard.home))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "cannot open a login window" in r.stderr
    assert "DISPLAY" in r.stderr or "container" in r.stderr
    assert "Traceback" not in r.stderr
    assert runs_all_ended(guard)
