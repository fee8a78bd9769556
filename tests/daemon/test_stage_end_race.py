"""A stage ended (POST .../end) while the guard is still making its browser session: nothing of
that session may stay open until the run ends, and the stage request gets an answer, not a 500."""
from __future__ import annotations

import json
import threading
import time

import psutil

from sfguard.supervisor.home import runtime_path


def session_daemons(name: str) -> list[int]:
    """The fake agent-browser daemons of session `name` (cmdline: agent-browser-fake-daemon NAME)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
        except psutil.Error:
            continue
        if "agent-browser-fake-daemon" in cmd and name in cmd:
            out.append(p.info["pid"])
    return out


def stage_starts(d) -> list[dict]:
    return [c for c in d.calls() if c.get("argv", [])[-2:] == ["stream", "disable"]]


def test_a_stage_ended_while_its_session_starts_leaves_nothing_open(daemon):
    control = runtime_path(daemon.home) / "ab" / "fake-control.json"
    conf = json.loads(control.read_text())
    control.write_text(json.dumps({**conf, "slow": "stream disable", "slow_seconds": "3"}))
    assert daemon.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    answers: list = []
    body = {"stage_id": "s1", "attempt": 1, "browser": {"allow_domains": ["site-a.test"], "headed": False}}
    t = threading.Thread(target=lambda: answers.append(daemon.call("POST", "/v1/runs/r1/stages", body)))
    t.start()
    deadline = time.monotonic() + 30
    while not stage_starts(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    starts = stage_starts(daemon)
    assert starts, "the stage's session never started"
    session = starts[0]["env"].get("AGENT_BROWSER_SESSION") or next(
        a for a in starts[0]["argv"] if a.startswith("sfs-"))
    status, ended = daemon.call("POST", "/v1/runs/r1/stages/s1/end", {"outcome": "cancelled"})
    assert status == 200, ended
    t.join(60)
    assert not t.is_alive()
    assert answers and answers[0][0] < 500, answers
    status, got = daemon.call("GET", "/v1/runs/r1/stages/s1")
    assert got["state"] == "ended" and got["outcome"] == "cancelled", got
    deadline = time.monotonic() + 15
    while session_daemons(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_daemons(session) == [], "the ended stage's session outlived it"
    # and the run still ends cleanly
    assert daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
