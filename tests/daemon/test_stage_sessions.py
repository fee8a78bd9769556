"""The stage session a shared anchor starts ahead (supervisor/daemon/stage_sessions.py), with the real
tools: the next stage of the run gets it, with a token, session and tab of its own; it is
given once; stage end still cuts the stage off at once; the run's crash record lists it; run
end leaves nothing behind."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sfguard.supervisor.daemon.stage_sessions import SPARE_NICE
from sfguard.supervisor.home import runtime_path
from tests.daemon.test_real_browser import as_stage, browser_processes, request_stage

pytestmark = pytest.mark.browser


def sessions_running(d) -> set[str]:
    """Names of the agent-browser sessions with a daemon pid file in the guard's socket dir."""
    return {p.stem for p in (runtime_path(d.home) / "ab").glob("sfs-*.pid")}


def session_nice(d, session: str) -> int:
    """The niceness of a session's agent-browser daemon (from its pid file)."""
    pid = int((runtime_path(d.home) / "ab" / f"{session}.pid").read_text().strip())
    return os.getpriority(os.PRIO_PROCESS, pid)


def wait_for(pred, what: str, bound: float = 60.0):
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {bound:.0f} s: {what}")


def gate_status(env: dict) -> int:
    url = env["AGENT_BROWSER_CDP"].replace("ws://", "http://", 1) + "/json/version"
    try:
        with urllib.request.urlopen(url, timeout=10) as res:
            return res.status
    except urllib.error.HTTPError as exc:
        return exc.code


def pinned_tab(env: dict) -> str:
    sock = Path(env["AGENT_BROWSER_SOCKET_DIR"])
    target = json.loads((sock / f"{env['AGENT_BROWSER_SESSION']}.target").read_text())
    assert target["pinned"] is True
    return target["targetId"]


def tab_ids(env: dict) -> set[str]:
    out = as_stage(env, "--json", "tab", "list")
    assert out.returncode == 0, out.stderr
    return {t["targetId"] for t in json.loads(out.stdout)["data"]["tabs"]}


def test_next_stage_gets_the_session_started_ahead_once_and_alone(real_daemon, site):
    d = real_daemon
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    a = request_stage(d, "r1", "a", ["site-a.test"])
    # the anchor's next session is started ahead: a session no stage has yet, in the crash record
    spare = wait_for(lambda: sessions_running(d) - {a["AGENT_BROWSER_SESSION"]},
                     "a session started ahead")
    wait_for(lambda: set(json.loads((d.home / "runs" / "r1.json").read_text())["sessions"])
             >= spare | {a["AGENT_BROWSER_SESSION"]}, "the run record lists the spare session")
    # started ahead at the guard's priority plus SPARE_NICE (nice adds to it)
    (spare_name,) = spare
    own = session_nice(d, a["AGENT_BROWSER_SESSION"])
    assert session_nice(d, spare_name) == min(own + SPARE_NICE, 19)
    b = request_stage(d, "r1", "b", ["site-a.test"])
    assert {b["AGENT_BROWSER_SESSION"]} == spare           # b got the one started ahead
    if os.geteuid() == 0:   # taken: back to the guard's priority (only root may raise it)
        assert session_nice(d, spare_name) == session_nice(d, a["AGENT_BROWSER_SESSION"])
    assert b["AGENT_BROWSER_CDP"] != a["AGENT_BROWSER_CDP"]
    assert set(b) == set(a)                                 # the same DESIGN 4.3 variables
    # each stage works in its own pinned tab and sees none of the other's
    tab_a, tab_b = pinned_tab(a), pinned_tab(b)
    assert tab_a != tab_b
    # each session was bound to one tab before it started (a: the browser's start-up tab; b:
    # one the gate made for it) and made none of its own
    assert tab_ids(a) == {tab_a} and tab_ids(b) == {tab_b}
    assert as_stage(a, "open", f"http://site-a.test:{site}/").returncode == 0
    assert as_stage(b, "open", f"http://site-a.test:{site}/cookies").returncode == 0
    assert as_stage(a, "get", "url").stdout.strip() == f"http://site-a.test:{site}/"
    assert as_stage(b, "get", "url").stdout.strip() == f"http://site-a.test:{site}/cookies"
    assert tab_b in tab_ids(b) and tab_a not in tab_ids(b)
    # the next spare is a new session again (given once, never shared)
    c_spare = wait_for(lambda: sessions_running(d) - {a["AGENT_BROWSER_SESSION"],
                                                     b["AGENT_BROWSER_SESSION"]}, "a new spare")
    assert not c_spare & {a["AGENT_BROWSER_SESSION"], b["AGENT_BROWSER_SESSION"]}
    # ending b cuts it off at once: its token is refused as soon as the call returns
    assert gate_status(b) == 200
    assert d.call("POST", "/v1/runs/r1/stages/b/end", {"outcome": "succeeded"})[0] == 200
    assert gate_status(b) == 403
    assert gate_status(a) == 200
    c = request_stage(d, "r1", "c", ["site-a.test"])
    assert {c["AGENT_BROWSER_SESSION"]} == c_spare
    assert as_stage(c, "get", "url").returncode == 0
    # run end: the spare nobody took goes too, with every session file and process
    assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[1]["ok"]
    for env in (a, c):
        assert gate_status(env) == 403
    wait_for(lambda: not browser_processes(d), "no browser or agent-browser process left", 15)
    assert sessions_running(d) == set()
    assert not list((runtime_path(d.home) / "ab").glob("sfs-*"))


def test_profileless_stages_start_no_spare(real_daemon, site):
    """A throw-away browser serves one stage: nothing is started ahead for it."""
    d = real_daemon
    d.call("POST", "/v1/runs", {"run_id": "r2"})
    status, answer = d.call("POST", "/v1/runs/r2/stages", {
        "stage_id": "t", "attempt": 1, "browser": {"headed": False, "allow_domains": ["site-a.test"]}})
    assert status == 200, answer
    env = answer["env"]
    assert as_stage(env, "get", "url").returncode == 0
    time.sleep(2)   # a spare would have started by now (it starts with the stage's own session)
    assert sessions_running(d) == {env["AGENT_BROWSER_SESSION"]}
    assert d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})[1]["ok"]
    wait_for(lambda: not browser_processes(d), "no browser or agent-browser process left", 15)
