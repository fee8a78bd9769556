"""Keys that rotate (issue 51) with a running guard (fake agent-browser): `sfguard keys rotate`
asks the guard, which reseals the profiles at rest at once and the leased one when its run ends;
runs go on during the rotation; retire refuses while a profile uses the old version; the audit
chain verifies across the rotation and fails on an edited segment from before it."""
from __future__ import annotations

import json
import subprocess
import sys

from sfguard.supervisor.home import runtime_path
from tests.daemon.conftest import ROOT


def sfguard(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(d.home)],
                          cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=120)


def stage(d, run: str, profile: str) -> dict:
    d.call("POST", "/v1/runs", {"run_id": run})
    st, body = d.call("POST", f"/v1/runs/{run}/stages",
                      {"stage_id": "s1", "attempt": 1,
                       "browser": {"profile": profile, "headed": False, "allow_domains": ["site-a.test"]}})
    assert st == 200 and body["state"] == "ready", body
    return body


def working_copy(d, profile: str):
    return runtime_path(d.home) / "profiles" / "local" / profile


def seed(d, profile: str, text: str) -> None:
    """A run logs in (a file in the profile) and ends: the profile rests sealed."""
    stage(d, f"seed-{profile}", profile)
    (working_copy(d, profile) / "login.txt").write_text(text)
    st, end = d.call("POST", f"/v1/runs/seed-{profile}/end", {"outcome": "succeeded"})
    assert st == 200 and end["ok"], end


def login_after(d, run: str, profile: str) -> str:
    stage(d, run, profile)
    text = (working_copy(d, profile) / "login.txt").read_text()
    assert d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[1]["ok"]
    return text


def status(d) -> dict:
    out = sfguard(d, "keys", "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_running_guard_rotates_its_keys_and_a_leased_profile_follows_at_its_run_end(daemon):
    d = daemon
    seed(d, "p1", "login one")
    seed(d, "p2", "login two")
    stage(d, "held", "p3")
    (working_copy(d, "p3") / "login.txt").write_text("written by the held run")
    out = sfguard(d, "keys", "rotate")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("rotated by the running guard: key version 2 is current (was 1); "
                                 "2 profile(s) resealed at rest"), out.stdout
    assert "waiting: local/p3 is leased by run held: resealed when that run ends" in out.stdout
    s = status(d)
    assert s["current"] == 2 and s["rotation"]["remaining"] == [
        {"profile": "p3", "scope": "local", "leased_by": "held", "version": 1}]
    assert [(v["version"], v["state"], v["profiles"]) for v in s["versions"]] == [(1, "old", 1),
                                                                                  (2, "current", 2)]
    refused = sfguard(d, "keys", "retire", "1")
    assert refused.returncode == 1
    assert "local/p3 (leased by run held: resealed when it ends)" in refused.stderr
    assert login_after(d, "during", "p1") == "login one"          # runs go on meanwhile
    assert d.call("POST", "/v1/runs/held/end", {"outcome": "succeeded"})[1]["ok"]
    s = status(d)
    assert s["rotation"] is None and s["old_profiles"] == []
    assert [(v["version"], v["profiles"]) for v in s["versions"]] == [(1, 0), (2, 3)]
    assert sfguard(d, "keys", "retire", "1").returncode == 0
    assert login_after(d, "after-3", "p3") == "written by the held run"
    assert login_after(d, "after-2", "p2") == "login two"
    assert not (d.home / "keys" / "p1.key").exists() and not (d.home / "keys" / "local.key").exists()
    assert sfguard(d, "audit", "verify").returncode == 0
    shown = sfguard(d, "audit", "show").stdout
    for line in ("key_rotation_started by=api from_version=1", "key_rotated", "profile=p3 run=held",
                 "key_rotation_finished profiles=3 to_version=2", "key_retired          version=1"):
        assert line in shown, (line, shown)
    # an edited segment from before the rotation is found (its records were keyed by version 1,
    # now retired: the key_rotated record, keyed by version 2, covers them)
    (segment,) = sorted((d.home / "audit.d").glob("*.log"))
    segment.write_text(segment.read_text().replace('"profile":"p1"', '"profile":"p9"', 1))
    broken = sfguard(d, "audit", "verify")
    assert broken.returncode == 1 and f"audit.d/{segment.name}" in broken.stderr, broken.stderr


def test_rotate_again_with_nothing_new_starts_the_next_version(daemon):
    d = daemon
    seed(d, "p1", "login one")
    for version in (2, 3):
        out = sfguard(d, "keys", "rotate", "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (report["to_version"], report["finished"], report["resealed"]) == (version, True, ["p1"])
    assert [v["state"] for v in status(d)["versions"]] == ["old", "old", "current"]
    assert login_after(d, "r", "p1") == "login one"
    assert sfguard(d, "audit", "verify").returncode == 0


def test_a_damaged_key_state_is_refused_by_the_guard(daemon):
    d = daemon
    seed(d, "p1", "login one")
    state = d.home / "keys.json"
    state.write_text("{not json")
    st, body = d.call("POST", "/v1/keys/rotate")
    assert st == 409 and body["error"]["code"] == "key_state" and "keys.json is damaged" in body["error"]["message"]
    out = sfguard(d, "keys", "rotate")
    assert out.returncode == 1 and "keys.json is damaged" in out.stderr
    assert state.read_text() == "{not json"          # left as it is, for the operator
    state.unlink()                                  # no state: version 1, as before
    assert login_after(d, "r", "p1") == "login one"


def test_a_crash_with_unusable_keys_keeps_the_login_until_they_are_repaired(daemon):
    """After a kill, neither the sweep nor a start drops a working copy because the key state
    cannot be read: they stop, say why and leave it; the start after the repair reseals it."""
    import signal
    d = daemon
    seed(d, "p1", "login one")
    stage(d, "r1", "p1")
    (working_copy(d, "p1") / "login.txt").write_text("renewed by r1 before the crash")
    d.stop(signal.SIGKILL)
    state = d.home / "keys.json"
    state.write_text("{damaged")
    swept = sfguard(d, "sweep")
    assert swept.returncode == 2 and "keys.json is damaged" in swept.stderr, swept.stderr
    start = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(d.home)],
                           cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=120)
    assert start.returncode == 2 and "keys.json is damaged" in start.stderr, start.stderr
    assert (working_copy(d, "p1") / "login.txt").read_text() == "renewed by r1 before the crash"
    state.unlink()                                  # the operator's repair (here: version 1 only)
    d.start()
    assert login_after(d, "after", "p1") == "renewed by r1 before the crash"
