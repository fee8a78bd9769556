"""Write gates through a real `sfguard start`, Chromium and agent-browser: a stage whose
`browser.writes` is `gate` sends the login form; the site receives nothing until a person
approves it with `sfguard approvals approve`, then exactly one POST; a denied one never
arrives and the page says so; a `deny` stage's write is refused at once; every decision is in
the decision log and the held ones in the audit chain."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import ROOT
from .test_real_browser import as_stage

pytestmark = pytest.mark.browser


def submits(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/submits.json", timeout=10) as r:
        return json.load(r)["submits"]


def stage(d, run: str, sid: str, writes: str, attempt: int = 1) -> dict:
    body = {"stage_id": sid, "attempt": attempt,
            "browser": {"profile": "acct", "headed": False, "allow_domains": ["site-a.test"], "writes": writes}}
    status, answer = d.call("POST", f"/v1/runs/{run}/stages", body)
    assert status == 200, answer
    assert answer["writes"] == {"site-a.test": writes}
    return answer["env"]


def send_login_form(env: dict, port: int) -> None:
    assert as_stage(env, "open", f"http://site-a.test:{port}/login").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    as_stage(env, "click", "button[type=submit]", timeout=60)


def pending(d, bound: float = 20) -> list[dict]:
    status, body = d.call("GET", f"/v1/approvals?state=pending&wait={int(bound)}")
    assert status == 200, body
    return body["approvals"]


def cli(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(d.home)], cwd=ROOT,
                          env=d.env, capture_output=True, text=True, timeout=60)


def test_gate_holds_until_a_person_decides_and_deny_refuses(real_daemon, site):
    d = real_daemon
    assert d.call("POST", "/v1/runs", {"run_id": "w1"})[0] == 201
    env = stage(d, "w1", "s1", "gate")
    before = len(submits(site))
    send_login_form(env, site)
    held = pending(d)
    assert len(held) == 1, held
    ap = held[0]
    assert (ap["method"], ap["host"], ap["path"], ap["stage_id"]) == ("POST", "site-a.test", "/login", "s1")
    assert ["password", "********"] in ap["form"] and ["user", "operator"] in ap["form"]
    time.sleep(1.0)
    assert len(submits(site)) == before                  # nothing reached the site while held
    listed = cli(d, "approvals", "list")
    assert listed.returncode == 0 and ap["id"] in listed.stdout, listed.stdout + listed.stderr
    ok = cli(d, "approvals", "approve", ap["id"])
    assert ok.returncode == 0 and "approved" in ok.stdout, ok.stderr
    deadline = time.monotonic() + 20
    while len(submits(site)) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    assert len(submits(site)) == before + 1              # exactly once
    again = cli(d, "approvals", "deny", ap["id"])
    assert again.returncode == 1 and "already approved" in again.stderr
    # denied: never sent, the page is told
    send_login_form(env, site)
    second = pending(d)
    assert len(second) == 1 and second[0]["id"] != ap["id"]
    assert cli(d, "approvals", "deny", second[0]["id"], "--reason", "not now").returncode == 0
    time.sleep(1.5)
    assert len(submits(site)) == before + 1
    assert "refused" in as_stage(env, "get", "text", "body").stdout
    assert d.call("POST", "/v1/runs/w1/end", {"outcome": "succeeded"})[0] == 200
    # a deny stage: refused at once, nothing held, nothing sent
    assert d.call("POST", "/v1/runs", {"run_id": "w2"})[0] == 201
    env2 = stage(d, "w2", "s1", "deny")
    send_login_form(env2, site)
    time.sleep(1.0)
    assert "refused" in as_stage(env2, "get", "text", "body").stdout
    assert len(submits(site)) == before + 1 and pending(d, 1) == []
    assert d.call("POST", "/v1/runs/w2/end", {"outcome": "succeeded"})[0] == 200
    # the decision log has every write decision; the audit chain the held ones and who decided
    lines = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    writes = [(x["run"], x["decision"]) for x in lines if str(x.get("decision", "")).startswith("write_")]
    assert ("w1", "write_held") in writes and ("w1", "write_approved") in writes
    assert ("w1", "write_denied") in writes and ("w2", "write_refused") in writes
    audit = cli(d, "audit", "show", "--run", "w1")
    assert "write_held" in audit.stdout and "write_approved" in audit.stdout and "write_denied" in audit.stdout
    assert "correct-horse" not in (d.home / "logs" / "decisions.log").read_text() + audit.stdout + d.log.read_text()


def test_a_retry_of_a_replay_unsafe_stage_is_held_with_what_the_first_attempt_sent(real_daemon, site):
    d = real_daemon

    def attempt(run: str, n: int, replay_safe: bool) -> dict:
        body = {"stage_id": "submit", "attempt": n, "replay_safe": replay_safe,
                "browser": {"profile": "acct", "headed": False, "allow_domains": ["site-a.test"]}}
        status, answer = d.call("POST", f"/v1/runs/{run}/stages", body)
        assert status == 200, answer
        return answer["env"]

    def until_submits(n: int) -> int:
        deadline = time.monotonic() + 20
        while len(submits(site)) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        return len(submits(site))

    before = len(submits(site))
    assert d.call("POST", "/v1/runs", {"run_id": "rp1"})[0] == 201
    # attempt 1 sends the form (writes: allow): it reaches the site
    send_login_form(attempt("rp1", 1, False), site)
    assert until_submits(before + 1) == before + 1
    assert d.call("POST", "/v1/runs/rp1/stages/submit/end", {"outcome": "failed"})[0] == 200
    # attempt 2 of the same stage: the same form is held, showing what attempt 1 sent
    send_login_form(attempt("rp1", 2, False), site)
    held = pending(d)
    assert len(held) == 1 and held[0]["why"] == "replay_unsafe_retry" and held[0]["attempt"] == 2, held
    assert [(e["method"], e["url"].split("?")[0]) for e in held[0]["earlier"]] == [
        ("POST", f"http://site-a.test:{site}/login")]
    time.sleep(1.0)
    assert len(submits(site)) == before + 1                 # nothing sent twice
    assert d.call("POST", f"/v1/approvals/{held[0]['id']}", {"decision": "deny"})[0] == 200
    assert d.call("POST", "/v1/runs/rp1/end", {"outcome": "failed"})[0] == 200
    # a replay-safe retry is not held
    assert d.call("POST", "/v1/runs", {"run_id": "rp2"})[0] == 201
    send_login_form(attempt("rp2", 1, True), site)
    assert until_submits(before + 2) == before + 2
    assert d.call("POST", "/v1/runs/rp2/stages/submit/end", {"outcome": "failed"})[0] == 200
    send_login_form(attempt("rp2", 2, True), site)
    assert until_submits(before + 3) == before + 3 and pending(d, 1) == []
    assert d.call("POST", "/v1/runs/rp2/end", {"outcome": "succeeded"})[0] == 200


def test_stages_sharing_a_browser_a_write_follows_its_host(real_daemon, site):
    """A write is judged by the strictest mode any stage of the browser has for its host: the
    allow stage's form to the host the gate stage gates is held too, labelled with the stage
    whose tab sent it (the attack tests: tests/daemon/test_write_gate_attacks.py)."""
    d = real_daemon
    assert d.call("POST", "/v1/runs", {"run_id": "sh1"})[0] == 201
    env_allow = stage(d, "sh1", "poster", "allow")      # both on profile acct: one browser
    env_gate = stage(d, "sh1", "reader", "gate")
    before = len(submits(site))
    send_login_form(env_gate, site)
    held = pending(d)
    assert [(x["stage_id"], x["path"]) for x in held] == [("reader", "/login")], held
    send_login_form(env_allow, site)
    deadline = time.monotonic() + 20
    while len(pending(d, 1)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    held = pending(d, 1)
    assert sorted(x["stage_id"] for x in held) == ["poster", "reader"], held
    time.sleep(1.0)
    assert len(submits(site)) == before                   # nothing reached the site
    assert d.call("POST", "/v1/runs/sh1/stages/reader/end", {"outcome": "succeeded"})[0] == 200
    assert [x["stage_id"] for x in pending(d, 1)] == ["poster"]      # its end denied what it held
    for x in pending(d, 1):
        assert d.call("POST", f"/v1/approvals/{x['id']}", {"decision": "deny"})[0] == 200
    time.sleep(1.0)
    assert len(submits(site)) == before
    lines = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    writes = {(x["client"], x["decision"]) for x in lines if x.get("run") == "sh1"
              and str(x.get("decision", "")).startswith("write_")}
    assert ("writes:reader", "write_held") in writes and ("writes:poster", "write_held") in writes, writes
    assert d.call("POST", "/v1/runs/sh1/end", {"outcome": "succeeded"})[0] == 200
