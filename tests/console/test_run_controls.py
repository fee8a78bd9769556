"""The console's controls over a running run (issue 48), against a real `sfguard start` with
the fake browser: a signed-in person restarts a run's browser, cancels a stage and ends the run;
each needs the page's CSRF token (without it nothing happens), each is audited before it acts
with who did it (console:NAME), and each is an entry of the run's record. A run page answers
for a run the guard no longer has, from its record."""
from __future__ import annotations

import re
import time

import pytest

from sfguard.supervisor.console.server import CONSOLE_COOKIE
from sfguard.supervisor.profiles.audit import LocalAuditSink
from sfguard.supervisor.record import files
from tests.console.test_console_scope import csrf_of, open_handoff, redeem, request


def person(d, name: str) -> str:
    status, body = d.call("POST", "/v1/console/link", {"ttl_s": 600, "person": name})
    assert status == 200, body
    return f"{CONSOLE_COOKIE}={redeem(d.console, body['url'])}"


def post(d, path: str, cookie: str, csrf: str | None) -> tuple[int, str]:
    return request(d.console, "POST", path, cookie=cookie, origin=d.console,
                   body=f"csrf={csrf}" if csrf else "csrf=")


def run_page(d, run: str, cookie: str) -> tuple[int, str]:
    return request(d.console, "GET", f"/runs/{run}", cookie=cookie)


@pytest.mark.parametrize("action,path", [
    ("restart", "/runs/ctl-1/browsers/acct-c/restart"), ("cancel", "/runs/ctl-1/stages/login/cancel"),
    ("end", "/runs/ctl-1/end")])
def test_a_control_without_its_csrf_token_does_nothing(fake_guard, action, path):
    d = fake_guard()
    open_handoff(d, "ctl-1", "acct-c")
    cookie = person(d, "ana")
    assert post(d, path, cookie, None)[0] == 403
    assert post(d, path, cookie, "made-up")[0] == 403
    run = d.call("GET", "/v1/runs/ctl-1")[1]
    assert run["state"] == "active" and run["browsers"][0]["restarts"] == 0
    assert run["stages"][0]["state"] == "ready"
    assert not [r for r in LocalAuditSink(d.home, read_only=True).records(run="ctl-1")
                if r["event"].startswith("console_")]


def test_restart_a_browser_cancel_a_stage_and_end_the_run(fake_guard):
    d = fake_guard()
    assert d.call("POST", "/v1/runs", {"run_id": "ctl-2"})[0] == 201
    for sid in ("one", "two"):
        status, _ = d.call("POST", "/v1/runs/ctl-2/stages", {"stage_id": sid, "attempt": 1, "browser": {
            "profile": "acct-d", "headed": False, "allow_domains": ["site-a.test"]}})
        assert status == 200
    cookie = person(d, "ana")
    status, html = run_page(d, "ctl-2", cookie)
    assert status == 200 and "Restart browser acct-d" in html and 'id="end-run"' in html
    csrf = csrf_of(html)
    assert post(d, "/runs/ctl-2/browsers/acct-d/restart", cookie, csrf)[0] == 303
    run = d.call("GET", "/v1/runs/ctl-2")[1]
    assert run["browsers"][0]["restarts"] == 1
    events = [e for s in run["stages"] for e in s["events"]]
    assert any("restarted by console:ana" in e["message"] for e in events), events
    deadline = time.monotonic() + 30     # the stages get new sessions on the new browser
    while d.call("GET", "/v1/runs/ctl-2/stages/one")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert post(d, "/runs/ctl-2/stages/one/cancel", cookie, csrf)[0] == 303
    run = d.call("GET", "/v1/runs/ctl-2")[1]
    assert [(s["stage_id"], s["state"], s["outcome"]) for s in run["stages"]][0] == ("one", "ended", "cancelled")
    status, html = post(d, "/runs/ctl-2/stages/one/cancel", cookie, csrf)
    assert status == 409 and "Nothing was changed" in html
    assert post(d, "/runs/ctl-2/end", cookie, csrf)[0] == 303
    run = d.call("GET", "/v1/runs/ctl-2")[1]
    assert (run["state"], run["outcome"]) == ("ended", "cancelled")
    audit = [(r["event"], r["fields"]) for r in LocalAuditSink(d.home, read_only=True).records(run="ctl-2")]
    done = [(e, f.get("by"), f.get("stage"), f.get("profile")) for e, f in audit if e.startswith("console_")]
    assert done == [("console_browser_restarted", "console:ana", None, "acct-d"),
                    ("console_stage_cancelled", "console:ana", "one", None),
                    ("console_run_ended", "console:ana", None, None)], audit
    entries = files.read_entries(d.home / "records" / "ctl-2")[0]
    assert [e["event"] for e in entries if e["kind"] == "console"] == [e for e, *_ in done]
    assert [e for e in entries if e["kind"] == "stage_ended" and e["stage"] == "one"][0]["outcome"] == "cancelled"
    # the run page of an ended run: its record, no controls
    status, html = run_page(d, "ctl-2", cookie)
    assert status == 200 and 'id="end-run"' not in html and "console_run_ended" in html
    assert re.search(r"record</dt><dd><code>ctl-2</code>", html)
