"""A login handoff in a run's record (issue 48), real browsers: a stage's tab is pictured as the
live view opens and after it ends, never the login tab the person types into, and nothing while
the handoff is open; the person's password is nowhere in the record; the handoff, its viewer
and the guard's login check are entries of the run."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from sfguard.fixtures.login_server.server import DEFAULT_PASSWORD
from sfguard.supervisor.console.viewer import scripted_login
from sfguard.supervisor.record import files
from tests.console.test_live_view_browser import browser
from tests.daemon.test_real_browser import as_stage

pytestmark = pytest.mark.browser


def test_a_live_view_login_is_recorded_without_a_picture_of_the_login(guard):
    d, port = guard, guard.site
    run = "rec-lv"
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    status, ans = d.call("POST", f"/v1/runs/{run}/stages", {"stage_id": "login", "attempt": 1,
                                                           "browser": browser(port)})
    assert status == 200, ans
    assert as_stage(ans["env"], "open", f"http://site-a.test:{port}/login").returncode == 0
    folder = d.home / "records" / run
    deadline = time.monotonic() + 15   # the load's picture: once the stage has been quiet 0.3 s
    while time.monotonic() < deadline and not any(
            e["kind"] == "screenshot" and e.get("why") == "navigation" for e in files.read_entries(folder)[0]):
        time.sleep(0.2)
    status, payload = d.call("POST", f"/v1/runs/{run}/handoff", {
        "profile": "fixture", "site": "site-a.test", "reason": "please sign in",
        "url": f"http://site-a.test:{port}/login", "kind": "live_view", "stage_id": "login"})
    assert status == 200 and payload["kind"] == "live_view", payload
    out = asyncio.run(scripted_login(payload["url"], "operator", DEFAULT_PASSWORD))
    assert "logged in" in out["result"] and "NOT" not in out["result"], out
    deadline = time.monotonic() + 20
    while d.call("GET", f"/v1/runs/{run}/handoff")[1]["state"] == "open" and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)               # the end's picture is written in the background
    assert d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[0] == 200
    entries = sorted(files.read_entries(folder)[0], key=lambda e: e["t"])
    events = [e.get("event") for e in entries if e["kind"] in ("handoff", "login_check", "console")]
    assert events[:1] == ["handoff_opened"] and "handoff_viewed" in events and "handoff_confirmed" in events
    assert any(e["kind"] == "console" and e.get("mode") == "live_view" for e in entries)
    check = next(e for e in entries if e["kind"] == "login_check")
    assert check["logged_in"] is True and check["profile"] == "fixture"
    opened = next(e for e in entries if e.get("event") == "handoff_opened")
    ended = next(e for e in entries if e.get("event") == "handoff_confirmed")
    stage_tabs = {e["tab"] for e in entries if e["kind"] == "command" and e.get("tab")}
    shots = [e for e in entries if e["kind"] == "screenshot"]
    assert {s["why"] for s in shots} >= {"navigation", "handoff_start", "handoff_end"}, shots
    assert all(s["tab"] in stage_tabs for s in shots), (shots, stage_tabs)        # never the login tab
    during = [s for s in shots if opened["t"] < s["t"] < ended["t"] and s["why"] != "handoff_start"]
    assert during == [], during
    assert next(s for s in shots if s["why"] == "handoff_start")["links"]["for"] == opened["seq"]
    assert next(s for s in shots if s["why"] == "handoff_end")["links"]["for"] == ended["seq"]
    for path in [p for p in folder.rglob("*") if p.is_file()]:
        assert DEFAULT_PASSWORD.encode() not in path.read_bytes(), path
    assert json.loads((folder / files.INDEX).read_text())["state"] == "ended"
