"""`kill -9` of the daemon at each phase of a run, then a restart: the section-1 promises hold.

Fast cases use the fake agent-browser (real daemon, real proxy child, real sealing, leases and
audit); the real-browser case (login survives) is in test_fault_real_browser.py.
"""
from __future__ import annotations

import signal
import threading
import time

import pytest

from sfguard.supervisor.home import runtime_path
from tests.reliability.conftest import (
    assert_promises,
    guard_processes,
    request_stage,
    wait_for,
)

pytestmark = pytest.mark.reliability

SEALED = ("profiles", "local", "acct", "profile.sealed")


def sealed_path(d):
    return d.home.joinpath(*SEALED)


def unsealed_dir(d):
    return runtime_path(d.home) / "profiles" / "local" / "acct"


def open_profile_after(d) -> dict:
    """A new run on the restarted guard gets the profile: it unseals (the sealed copy is
    intact and authentic) and the stage is ready."""
    assert d.call("POST", "/v1/runs", {"run_id": "after"})[0] == 201
    st, body = request_stage(d, "after", "s1")
    assert st == 200 and body["state"] == "ready", body
    return body


def marker_survived(d, expect: bool) -> None:
    m = unsealed_dir(d) / "Default" / "marker.txt"
    assert m.exists() == expect, f"marker in unsealed profile: {m.exists()}"


def seed_profile(d) -> None:
    """Run 'seed' puts a marker in the profile and ends cleanly: the last good sealed copy."""
    d.call("POST", "/v1/runs", {"run_id": "seed"})
    assert request_stage(d, "seed", "s1")[0] == 200
    (unsealed_dir(d) / "Default").mkdir(exist_ok=True)
    (unsealed_dir(d) / "Default" / "marker.txt").write_text("logged in")
    st, body = d.call("POST", "/v1/runs/seed/end", {"outcome": "succeeded"})
    assert st == 200 and body["ok"], body


def crash_and_restart(d) -> None:
    before = guard_processes(d.home, {d.proc.pid})
    assert before, "the run's processes should be visible before the crash"
    d.stop(signal.SIGKILL)
    d.start(*d.start_args)
    # what the dead daemon had running is gone (by the guard's records and by the scan)
    alive = [p for p in before if p.is_running() and p.status() != "zombie"]
    assert alive == [], [p.pid for p in alive]


@pytest.mark.slow
def test_kill9_while_a_stage_waits_for_a_lease(make_fake_guard):
    d = make_fake_guard()
    seed_profile(d)
    for r in ("holder", "waiter"):
        d.call("POST", "/v1/runs", {"run_id": r})
    assert request_stage(d, "holder", "s1")[0] == 200
    st, body = request_stage(d, "waiter", "s1")
    assert st == 202 and body["holder_run"] == "holder"
    crash_and_restart(d)
    assert_promises(d)
    open_profile_after(d)
    marker_survived(d, True)
    d.call("POST", "/v1/runs/after/end", {"outcome": "succeeded"})


@pytest.mark.slow
def test_kill9_while_an_anchor_launches(make_fake_guard):
    d = make_fake_guard()
    seed_profile(d)
    d.control(hang="launch")          # the anchor's browser never answers its pipe
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    t = threading.Thread(target=lambda: _swallow(request_stage, d, "r1", "s1"), daemon=True)
    t.start()
    n0 = len(d.browser_log())
    wait_for(lambda: any("argv" in c for c in d.browser_log()[n0:]), 30,
             what="the anchor launch to start")
    time.sleep(0.3)
    assert unsealed_dir(d).is_dir(), "the profile should be unsealed during the launch"
    d.control()                       # the restarted guard's browsers work again
    crash_and_restart(d)
    t.join(10)
    assert_promises(d)
    open_profile_after(d)
    marker_survived(d, True)
    d.call("POST", "/v1/runs/after/end", {"outcome": "succeeded"})


def test_kill9_while_a_stage_is_active(make_fake_guard):
    d = make_fake_guard()
    seed_profile(d)
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    assert request_stage(d, "r1", "s1")[0] == 200
    assert request_stage(d, "r1", "s2", profile=None)[0] == 200   # and a throw-away browser
    (unsealed_dir(d) / "Default" / "during.txt").write_text("written by the active run")
    crash_and_restart(d)
    assert_promises(d)
    open_profile_after(d)
    marker_survived(d, True)
    # the sweep resealed what the crashed run had written (nothing lost, nothing left open)
    assert (unsealed_dir(d) / "Default" / "during.txt").exists()
    d.call("POST", "/v1/runs/after/end", {"outcome": "succeeded"})


def test_kill9_while_a_profile_is_resealed(make_fake_guard):
    d = make_fake_guard()
    seed_profile(d)
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    assert request_stage(d, "r1", "s1")[0] == 200
    # a big profile makes the reseal take a while: kill the daemon in the middle of it
    bulk = unsealed_dir(d) / "Default" / "bulk"
    bulk.mkdir()
    for i in range(6000):
        (bulk / f"f{i}").write_bytes(b"x" * 2048)
    t = threading.Thread(target=lambda: _swallow(d.call, "POST", "/v1/runs/r1/end",
                                                  {"outcome": "succeeded"}), daemon=True)
    t.start()
    folder = sealed_path(d).parent
    wait_for(lambda: list(folder.glob(".profile.sealed.*.tmp")), 30, 0.005,
             what="the reseal to begin")
    crash_and_restart(d)
    t.join(10)
    assert not list(folder.glob(".profile.sealed.*.tmp")), "a half-written seal was left"
    assert_promises(d)
    # the sealed copy is authentic: either the previous one, or the sweep's complete reseal
    body = open_profile_after(d)
    assert body["state"] == "ready"
    marker_survived(d, True)
    assert sealed_path(d).read_bytes() != b""
    d.call("POST", "/v1/runs/after/end", {"outcome": "succeeded"})


def _swallow(fn, *args):
    try:
        fn(*args)
    except Exception:
        pass
