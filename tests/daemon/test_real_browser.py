"""Whole runs with the real tools: `sfguard start`, Chromium, agent-browser, mitmproxy and the
fixture login site. The stage side uses only the env the API returned, like a stage worker."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import psutil
import pytest

from sfguard.supervisor.browsers import tools
from sfguard.supervisor.home import runtime_path

pytestmark = pytest.mark.browser


def hits(port, host):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hits.json", timeout=10) as r:
        rows = json.load(r)["hits"]
    return sum(r["count"] for r in rows if r["host"].split(":")[0] == host)


def as_stage(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    ab = tools.find_agent_browser().path
    stage_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env}
    return subprocess.run([ab, *args], env=stage_env, capture_output=True, text=True, timeout=timeout)


def request_stage(d, run, sid, allow, profile="acct"):
    body = {"stage_id": sid, "attempt": 1,
            "browser": {"profile": profile, "headed": False, "allow_domains": allow}}
    status, answer = d.call("POST", f"/v1/runs/{run}/stages", body)
    assert status == 200, answer
    return answer["env"]


def guard_processes(d) -> list[psutil.Process]:
    marks = (str(d.home), str(runtime_path(d.home)))
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if any(m in cmd for m in marks) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def browser_processes(d) -> list[psutil.Process]:
    """Chromium or agent-browser processes of this guard (its runtime dir in their args)."""
    return [p for p in guard_processes(d)
            if "chrom" in p.name().lower() or "agent-browser" in p.name()]


def test_stage_reaches_only_allowed_hosts_and_login_survives_runs(real_daemon, site):
    d = real_daemon
    a, b = f"http://site-a.test:{site}", f"http://site-b.test:{site}"
    d.call("POST", "/v1/runs", {"run_id": "run1"})
    env = request_stage(d, "run1", "login", ["site-a.test"])
    r = as_stage(env, "open", f"{a}/login")
    assert r.returncode == 0, r.stderr
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    assert as_stage(env, "click", "button[type=submit]").returncode == 0
    as_stage(env, "wait", "1000")
    assert as_stage(env, "get", "url").stdout.strip().endswith("/account")
    # outside allow_domains: refused by the guard proxy, the server never sees it
    before = hits(site, "site-b.test")
    denied = as_stage(env, "open", f"{b}/")
    if denied.returncode == 0:  # plain HTTP: the browser shows the guard's 403 page
        page = as_stage(env, "get", "text", "body").stdout
        assert "site-b.test is not in this run's allow_domains" in page, page
    assert hits(site, "site-b.test") == before == 0
    # a second stage of the same run sees the session-only cookie
    env2 = request_stage(d, "run1", "work", ["site-a.test"])
    assert as_stage(env2, "open", f"{a}/cookies").returncode == 0
    text = as_stage(env2, "get", "text", "#cookies").stdout
    assert "sf_session" in text and "sf_persist" in text
    for sid in ("login", "work"):
        assert d.call("POST", f"/v1/runs/run1/stages/{sid}/end", {"outcome": "succeeded"})[0] == 200
    assert d.call("POST", "/v1/runs/run1/end", {"outcome": "succeeded"})[1]["ok"]
    time.sleep(1)
    assert browser_processes(d) == []
    # at rest: no plaintext cookie database anywhere in the home
    assert not [p for p in d.home.rglob("*") if p.name in ("Cookies", "Cookies-journal")]
    # run 2: the persistent cookie came back from the sealed profile, the session one did not
    d.call("POST", "/v1/runs", {"run_id": "run2"})
    env3 = request_stage(d, "run2", "work", ["site-a.test"])
    assert as_stage(env3, "open", f"{a}/cookies").returncode == 0
    text = as_stage(env3, "get", "text", "#cookies").stdout
    assert "sf_persist" in text and "sf_session" not in text
    d.call("POST", "/v1/runs/run2/end", {"outcome": "succeeded"})


def test_kill_9_of_the_daemon_leaves_no_browser_after_restart(real_daemon, site):
    d = real_daemon
    d.call("POST", "/v1/runs", {"run_id": "run1"})
    env = request_stage(d, "run1", "s1", ["site-a.test"])
    assert as_stage(env, "open", f"http://site-a.test:{site}/").returncode == 0
    browsers = browser_processes(d)
    assert browsers, "the anchor's processes should be visible while the run is active"
    d.stop(signal.SIGKILL)
    d.start()
    time.sleep(1)
    left = [p for p in browsers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []
    assert not [p for p in runtime_path(d.home).rglob("*") if p.name == "Cookies"]
    st = d.call("GET", "/v1/status")[1]
    assert all(l["holder_run"] is None for l in st["leases"])


def test_login_check_is_computed_by_the_guard_and_envelopes_are_verified(real_daemon, site):
    d = real_daemon
    a = f"http://site-a.test:{site}"
    check = {"url": f"{a}/account", "logged_in": f"{a}/account", "logged_out": [f"{a}/login*"]}
    d.call("POST", "/v1/runs", {"run_id": "run1"})
    env = request_stage(d, "run1", "check", ["site-a.test"])
    status, res = d.call("POST", "/v1/runs/run1/login-check", {"profile": "acct", "login_check": check})
    assert status == 200 and res == {"logged_in": False, "url": f"{a}/login?next=…"}, res   # values hidden
    # the stage reports something else: refused, naming the field
    status, body = d.call("POST", "/v1/runs/run1/login-check/verify",
                          {"profile": "acct", "reported": {"logged_in": True, "url": f"{a}/account"}})
    assert status == 409 and body["error"]["code"] == "envelope_mismatch"
    assert body["error"]["field"] == "reported.logged_in"
    assert d.call("POST", "/v1/runs/run1/login-check/verify",
                  {"profile": "acct", "reported": res})[0] == 200
    # a stage that saw the whole address reports the same login
    assert d.call("POST", "/v1/runs/run1/login-check/verify", {"profile": "acct", "reported": {
        "logged_in": False, "url": f"{a}/login?next=/account"}})[0] == 200
    # log in as the stage, check again
    as_stage(env, "open", f"{a}/login")
    as_stage(env, "fill", "input[name=user]", "operator")
    as_stage(env, "fill", "input[name=password]", "correct-horse")
    as_stage(env, "click", "button[type=submit]")
    as_stage(env, "wait", "1000")
    status, res = d.call("POST", "/v1/runs/run1/login-check", {"profile": "acct", "login_check": check})
    assert status == 200 and res == {"logged_in": True, "url": f"{a}/account"}, res
    # a check address the run may not reach is refused before any browser work
    bad = dict(check, url=f"http://site-b.test:{site}/account")
    status, body = d.call("POST", "/v1/runs/run1/login-check", {"profile": "acct", "login_check": bad})
    assert status == 403 and body["error"]["field"] == "login_check.url"
    # handoff without a display: a clear refusal
    status, body = d.call("POST", "/v1/runs/run1/handoff",
                          {"profile": "acct", "site": "site-a.test", "reason": "login expired"})
    msg = body["error"]["message"]
    assert status == 409 and ("DISPLAY" in msg or "container" in msg), msg
    d.call("POST", "/v1/runs/run1/end", {"outcome": "succeeded"})
    audit = (d.home / "audit.log").read_text()
    assert '"login_checked"' in audit and "sf_persist" not in audit
