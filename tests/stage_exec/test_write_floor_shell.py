"""The reviewers' write floor (sites.yaml `writes`) through a real `sfguard start`, Chromium,
agent-browser and `sfguard stage-exec`:

- a pipeline stage that asks `writes: allow` cannot loosen a `gate` floor: its browser's form POST
  is held for a person, and a GET the policy names a write (`GET /logout`) too;
- the stage's own shell, with its proxy credential, cannot reach the floored host at all
  (`writes_guarded_host`: a stolen bearer token cannot be `curl -X POST`ed past the gate), while
  a host without a floor stays reachable;
- an edit of the live policy takes effect on the running browser and shell without a restart:
  the floor moved to another host gates that one and frees the first."""
from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from sfguard.supervisor.browsers import tools
from tests.daemon.conftest import ROOT, Daemon
from tests.daemon.test_real_browser import as_stage
from tests.stage_exec.conftest import stage_exec

pytestmark = pytest.mark.browser

POLICY = """version: 1
mode: enforce
ports: [80, 443, {port}]
block: []
private_networks:
  allow: [127.0.0.1/32]
writes:
  - pattern: {floored}
    mode: {mode}
    reason: "the reviewers hold this site's writes"
    writes:
      - "GET /logout"
"""


@pytest.fixture
def guard(tmp_path, site):
    home = (tmp_path / "home").absolute()
    pol = tmp_path / "sites.yaml"
    pol.write_text(POLICY.format(port=site, floored="site-a.test", mode="gate"))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1", "--resolve", "site-b.test=127.0.0.1")
    d.policy_file = pol
    yield d
    d.finish()


def hits(port: int, host: str, path: str | None = None) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hits.json", timeout=10) as r:
        rows = json.load(r)["hits"]
    return sum(r["count"] for r in rows if r["host"].split(":")[0] == host and path in (None, r["path"]))


def submits(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/submits.json", timeout=10) as r:
        return len(json.load(r)["submits"])


BODY = {"stage_id": "s1", "attempt": 1,
        "browser": {"profile": "acct", "headed": False, "allow_domains": ["site-a.test", "site-b.test"],
                    "writes": "allow"}}


def pending(d, bound: int = 20) -> list[dict]:
    status, body = d.call("GET", f"/v1/approvals?state=pending&wait={bound}")
    assert status == 200, body
    return body["approvals"]


def timed(env: dict, *args: str):
    started = time.monotonic()
    done = as_stage(env, *args, timeout=60)
    return time.monotonic() - started, done


def shell(d, ws, script: str):
    r = stage_exec(d.home, ws, "r1", "s1", "sh", "-c", script, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stdout


def test_a_floor_holds_the_browser_and_shuts_the_shell_and_follows_live_edits(guard, site, workspace):
    d = guard
    a, b = f"http://site-a.test:{site}", f"http://site-b.test:{site}"
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    status, answer = d.call("POST", "/v1/runs/r1/stages", BODY)
    assert status == 200, answer
    assert answer["writes"] == {"site-a.test": "gate", "site-b.test": "allow"}   # the floor wins
    env = answer["env"]

    # the shell: the floored host is out of reach (a stolen token cannot be POSTed past the
    # gate); a host without a floor is reachable; the site saw nothing from the refused one
    curl = "curl -sS -o /dev/null -D - -X POST --data token=stolen "
    out = shell(d, workspace, f"{curl}{a}/login; curl -sS -o /dev/null -w 'b=%{{http_code}}\\n' {b}/")
    assert "403" in out and "X-Sfguard-Decision: deny; reason=writes_guarded_host" in out, out
    assert "b=200" in out
    assert hits(site, "site-a.test") == 0 and submits(site) == 0

    # the browser reads the floored site; its form POST is held though the stage asked allow
    assert as_stage(env, "open", f"{a}/login").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    as_stage(env, "click", "button[type=submit]", timeout=60)
    held = pending(d)
    assert [(x["method"], x["host"], x["path"]) for x in held] == [("POST", "site-a.test", "/login")]
    assert d.call("POST", f"/v1/approvals/{held[0]['id']}", {"decision": "deny"})[0] == 200
    time.sleep(1.0)
    assert submits(site) == 0
    # speculation rules (prefetch, prerender) fetch in the browser where its interception does
    # not look (measured); the guard turns preloading off in every profile, so a listed GET
    # write cannot go that way either
    rules = ("{prefetch: [{source: 'list', urls: ['/logout?via=prefetch']}], "
             "prerender: [{source: 'list', urls: ['/logout?via=prerender']}]}")
    assert as_stage(env, "eval", "const s = document.createElement('script'); s.type = 'speculationrules'; "
                    f"s.textContent = JSON.stringify({rules}); document.head.append(s); 'added'").returncode == 0
    time.sleep(3.0)
    assert hits(site, "site-a.test", "/logout") == 0
    # a GET the policy names a write is held too, and sent once when approved; the stage's
    # `open` is answered at once with the held write (Chromium would keep it until the decision,
    # and agent-browser gives up after 30 s)
    took, opened = timed(env, "open", f"{a}/logout")
    held = pending(d)
    assert [(x["method"], x["path"]) for x in held] == [("GET", "/logout")], held
    assert took < 10 and opened.returncode != 0, (took, opened)
    assert f"write_held: approval {held[0]['id']}" in opened.stderr + opened.stdout, opened
    assert hits(site, "site-a.test", "/logout") == 0
    assert d.call("POST", f"/v1/approvals/{held[0]['id']}", {"decision": "approve"})[0] == 200
    deadline = time.monotonic() + 20
    while hits(site, "site-a.test", "/logout") == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hits(site, "site-a.test", "/logout") == 1
    # denied, the tab shows the refusal at that address; a reload of it is held again (Chromium
    # answers Page.reload itself; agent-browser then waits for the page's load, 10 s at most)
    for decision, command in (("deny", ("open", f"{a}/logout")), ("approve", ("reload",))):
        took, done = timed(env, *command)
        held = pending(d)
        assert [(x["method"], x["path"]) for x in held] == [("GET", "/logout")], (command, held)
        assert took < 20, (command, took, done)
        if command[0] == "open":
            assert f"write_held: approval {held[0]['id']}" in done.stderr + done.stdout, done
        assert d.call("POST", f"/v1/approvals/{held[0]['id']}", {"decision": decision})[0] == 200
        assert as_stage(env, "wait", "--load", "load").returncode == 0
        if decision == "deny":
            assert "refused" in as_stage(env, "get", "text", "body").stdout
            assert as_stage(env, "get", "url").stdout.strip() == f"{a}/logout"
    deadline = time.monotonic() + 20
    while hits(site, "site-a.test", "/logout") == 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hits(site, "site-a.test", "/logout") == 2       # the approved reload, once

    # the reviewers move the floor to site-b.test, as deny: in force without a restart
    d.policy_file.write_text(POLICY.format(port=site, floored="site-b.test", mode="deny"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        answer = d.call("POST", "/v1/runs/r1/stages", BODY)[1]
        if answer.get("writes") == {"site-a.test": "allow", "site-b.test": "deny"}:
            break
        time.sleep(0.3)
    assert answer["writes"] == {"site-a.test": "allow", "site-b.test": "deny"}, answer
    time.sleep(1.5)      # the run's proxy re-reads the file itself, within a second
    out = shell(d, workspace, f"curl -sS -o /dev/null -w 'a=%{{http_code}}\\n' {a}/; {curl}{b}/login")
    assert "a=200" in out and "reason=writes_guarded_host" in out, out
    assert as_stage(env, "open", f"{b}/login").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    as_stage(env, "click", "button[type=submit]", timeout=60)
    time.sleep(1.0)
    assert "refused" in as_stage(env, "get", "text", "body").stdout
    assert submits(site) == 0 and pending(d, 1) == []
    # ... and site-a.test's writes are sent again
    assert as_stage(env, "open", f"{a}/login").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    as_stage(env, "click", "button[type=submit]", timeout=60)
    deadline = time.monotonic() + 20
    while submits(site) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert submits(site) == 1 and pending(d, 1) == []

    log = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    reasons = {(x.get("decision"), x.get("reason")) for x in log}
    assert ("deny", "writes_guarded_host") in reasons
    assert ("write_held", "site_floor") in reasons and ("write_held", "site_write_get") in reasons
    assert ("write_refused", "site_floor") in reasons
    assert "correct-horse" not in (d.home / "logs" / "decisions.log").read_text() + d.log.read_text()
    assert tools.find_agent_browser().found
