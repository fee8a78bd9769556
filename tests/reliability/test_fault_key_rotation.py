"""`kill -9` of the guard in the middle of a key rotation (issue 51), then a start: every
profile opens (the logins in them survive), the audit chain verifies, and the start finished the
rotation. The guard is held at each step by the test hook $SFGUARD_TEST_ROTATION_PAUSE (it logs
where it waits), killed there, and started again without it.

Not marked `reliability`: these run in the default suite (`./dev test`), as the issue's proof
asks; each takes a few seconds with the fake agent-browser.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest

from sfguard.supervisor.home import runtime_path
from sfguard.supervisor.profiles.rotation import ENV_PAUSE
from tests.reliability.conftest import ROOT, assert_promises, request_stage, wait_for

#: where the rotation is held, and what the store shows there (before the kill)
STEPS = {
    "prepared": "version 2's keys made, still version 1 current",
    "switched": "version 2 current, nothing resealed yet",
    "resealed-one": "one profile at rest on version 2, one still on 1",
    "resealed": "every profile at rest on version 2, the leased one on 1",
}


def sfguard(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(d.home)],
                          cwd=ROOT, env={k: v for k, v in d.env.items() if k != ENV_PAUSE},
                          capture_output=True, text=True, timeout=120)


def working_copy(d, profile: str):
    return runtime_path(d.home) / "profiles" / "local" / profile


def hold(d, run: str, profile: str, text: str) -> None:
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    st, body = request_stage(d, run, "s1", profile=profile)
    assert st == 200, body
    (working_copy(d, profile) / "login.txt").write_text(text)


def key_versions(d) -> dict[str, int]:
    s = json.loads(sfguard(d, "keys", "status", "--json").stdout)
    return {p["profile"]: p["version"] for p in s["old_profiles"]}, s


@pytest.mark.parametrize("step", list(STEPS))
def test_kill9_during_a_rotation_then_start_finishes_it(make_fake_guard, step):
    d = make_fake_guard(start=False)
    d.env[ENV_PAUSE] = step
    d.start(*d.start_args)
    for name in ("p1", "p2"):            # two at rest, so one is left half-way at resealed-one
        hold(d, f"seed-{name}", name, f"login {name}")
        assert d.call("POST", f"/v1/runs/seed-{name}/end", {"outcome": "succeeded"})[1]["ok"]
    hold(d, "held", "p3", "written by the held run")
    answers: list = []
    t = threading.Thread(target=lambda: answers.append(_call(d, "POST", "/v1/keys/rotate")), daemon=True)
    t.start()
    wait_for(lambda: f"key rotation paused at step {step}" in d.log.read_text(), 60, 0.1,
             f"the rotation to be held at {step}")
    if step == "switched":     # a second rotation meanwhile is refused, not run beside it
        st, body = d.call("POST", "/v1/keys/rotate")
        assert st == 409 and body["error"]["code"] == "keys_busy", body
    old, _status = key_versions(d)
    expect = {"prepared": {"p1": 1, "p2": 1, "p3": 1}, "switched": {"p1": 1, "p2": 1, "p3": 1},
              "resealed-one": {"p2": 1, "p3": 1}, "resealed": {"p3": 1}}[step]
    if step == "prepared":      # version 1 still current: nothing is "old" yet
        expect = {}
    assert old == expect, (step, STEPS[step], old)
    d.stop(signal.SIGKILL)
    d.env.pop(ENV_PAUSE)
    d.start(*d.start_args)
    assert_promises(d)         # no leftover process, unsealed copy or lease; the chain verifies
    old, status = key_versions(d)
    assert status["current"] == 2 and status["rotation"] is None and old == {}, status
    assert [(v["version"], v["state"]) for v in status["versions"]] == [(1, "old"), (2, "current")]
    for name, text in (("p1", "login p1"), ("p2", "login p2"), ("p3", "written by the held run")):
        assert d.call("POST", "/v1/runs", {"run_id": f"after-{name}"})[0] == 201
        st, body = request_stage(d, f"after-{name}", "s1", profile=name)
        assert st == 200, body                          # it opens under version 2
        assert (working_copy(d, name) / "login.txt").read_text() == text
        assert d.call("POST", f"/v1/runs/after-{name}/end", {"outcome": "succeeded"})[1]["ok"]
    shown = sfguard(d, "audit", "show", "--json").stdout.splitlines()
    events = [json.loads(line)["event"] for line in shown]
    assert events.count("key_rotated") == 1 and events.count("key_rotation_finished") == 1, events
    assert sfguard(d, "audit", "verify").returncode == 0
    t.join(1)


def _call(d, method: str, path: str):
    try:
        return d.call(method, path)
    except Exception as exc:  # noqa: BLE001 - the guard is killed under this call
        return exc
