"""The person in the loop, told (issue 46), through a real `sfguard start`, Chromium and
agent-browser: a stage's form POST is held and a receiver on 127.0.0.1 gets `write_held` (run,
stage, profile, site, method, path, the approval's console link; never the password, the form or
the query), `status` lists the approval with its age and `status --check --max-wait` alerts on it;
the receiver goes down, the person denies, and `write_denied` arrives once it is back (a later
attempt); a live-view login handoff gives `handoff_waiting`, shows in status and alerts, and
`handoff_ended` when its stage ends. Every delivery passes the operator guide's signature check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.daemon.conftest import ROOT
from tests.daemon.test_metrics import parse, scrape_unix, value
from tests.daemon.test_real_browser import as_stage
from tests.daemon.test_write_gate_daemon import pending, stage
from tests.webhook_receiver import Receiver, doc_verify

pytestmark = pytest.mark.browser

QUERY_SECRET = "qv-7f3e9a1c"          # a query value of the tab: never in a notification


def status(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", "status", "--home", str(d.home), *args],
                          cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=60)


def test_held_writes_and_handoffs_reach_the_operator(real_daemon, site):
    d = real_daemon
    hooks = Receiver().up()
    d.stop()
    notify = d.home / "notify.yaml"
    notify.write_text(f"version: 1\nwebhooks:\n  - url: {hooks.url()}\n    retry_for_s: 300\n")
    notify.chmod(0o600)
    d.start(*d.last_args)
    secret = (d.home / "notify.secret").read_bytes().strip()
    verify = doc_verify()
    assert d.call("POST", "/v1/runs", {"run_id": "p1"})[0] == 201
    env = stage(d, "p1", "s1", "gate")
    assert as_stage(env, "open", f"http://site-a.test:{site}/login?hint={QUERY_SECRET}").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    as_stage(env, "click", "button[type=submit]", timeout=60)
    ap = pending(d)[0]

    held = hooks.wait("write_held")[0].event
    assert {k: held[k] for k in ("approval", "run", "stage", "profile", "site", "method", "path", "why")} == {
        "approval": ap["id"], "run": "p1", "stage": "s1", "profile": "acct", "site": "site-a.test",
        "method": "POST", "path": "/login", "why": "stage_mode"}, held
    console = d.call("GET", "/v1/status")[1]["console"]["url"]
    assert held["link"] == f"{console}/approvals#{ap['id']}"

    # status shows it waiting, with its age; --check alerts once it is older than --max-wait
    time.sleep(2.2)
    plain = status(d)
    shown = f"approval {ap['id']} POST site-a.test/login run p1 stage s1: waiting"
    assert plain.returncode == 0 and shown in plain.stdout, plain.stdout
    check = status(d, "--check", "--max-wait", "2")
    assert check.returncode == 1 and f"ALERT   approval {ap['id']}" in check.stdout, check.stdout
    assert status(d, "--check", "--max-wait", "600").returncode == 0
    answer = d.call("GET", "/v1/status")[1]
    assert [a["id"] for a in answer["approvals"]] == [ap["id"]] and answer["approvals"][0]["age_s"] >= 2
    fams = parse(scrape_unix(d)[2])
    assert value(fams, "sfguard_approvals_pending") == 1
    assert value(fams, "sfguard_oldest_pending_seconds", kind="approval") >= 2

    # the receiver is down while the person denies; it gets the decision once it is back
    hooks.down()
    assert d.call("POST", f"/v1/approvals/{ap['id']}", {"decision": "deny", "reason": "not tonight"})[0] == 200
    time.sleep(4)
    assert hooks.events("write_denied") == []
    hooks.up()
    denied = hooks.wait("write_denied", bound=60)[0].event
    import pwd
    me = f"user:{pwd.getpwuid(os.getuid()).pw_name}"        # the control socket's caller
    assert (denied["approval"], denied["decided_by"], denied["reason"]) == (ap["id"], me, "not tonight")
    last = d.call("GET", "/v1/status")[1]["notifications"]["webhooks"][0]["last"]
    assert last["event"] == "write_denied" and last["result"] == "delivered" and last["attempts"] >= 2, last
    assert d.call("GET", "/v1/status")[1]["approvals"] == []

    # a live-view login: waiting, in status, alerting; ended with its stage
    assert d.call("POST", "/v1/runs/p1/stages", {"stage_id": "login", "attempt": 1, "browser": {
        "profile": "acct", "headed": False, "allow_domains": ["site-a.test"]}})[0] == 200
    code, payload = d.call("POST", "/v1/runs/p1/handoff", {
        "profile": "acct", "site": "site-a.test", "reason": "Sign in again, please.", "kind": "live_view",
        "url": f"http://site-a.test:{site}/login", "stage_id": "login"})
    assert code == 200 and payload["kind"] == "live_view", payload
    waiting = hooks.wait("handoff_waiting")[0].event
    assert {k: waiting[k] for k in ("kind", "run", "stage", "profile", "site", "reason")} == {
        "kind": "live_view", "run": "p1", "stage": "login", "profile": "acct", "site": "site-a.test",
        "reason": "Sign in again, please."}, waiting
    assert waiting["link"] == f"{console}/"
    time.sleep(2.2)
    check = status(d, "--check", "--max-wait", "2")
    assert check.returncode == 1 and "ALERT   the live_view login handoff of run p1" in check.stdout, check.stdout
    assert "handoff live_view run p1 stage login profile acct site site-a.test: waiting" in check.stdout
    assert d.call("POST", "/v1/runs/p1/stages/login/end", {"outcome": "succeeded"})[0] == 200
    ended = hooks.wait("handoff_ended")[0].event
    assert (ended["kind"], ended["run"], ended["outcome"]) == ("live_view", "p1", "ended")
    assert d.call("POST", "/v1/runs/p1/end", {"outcome": "succeeded"})[0] == 200

    # signed as the guide says; nothing secret in any of it
    everything = b"".join(g.body for g in hooks.got)
    for got in hooks.got:
        assert verify(secret, got.headers["X-Sfguard-Signature"], got.body)
    for needle in (b"correct-horse", b"operator", QUERY_SECRET.encode(), b"?t=", secret, payload["url"].encode()):
        assert needle not in everything, needle
    assert sorted({g.event["event"] for g in hooks.got}) == [
        "handoff_ended", "handoff_waiting", "write_denied", "write_held"]
    assert all(set(json.loads(g.body)) <= {"event", "about", "delivery", "ts", "guard", "link", "run", "stage",
                                          "attempt", "profile", "site", "method", "path", "approval", "state",
                                          "why", "reason", "decided_by", "expires", "kind", "outcome"}
               for g in hooks.got)
    hooks.down()
