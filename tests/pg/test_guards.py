"""Two guard daemons (homes of their own) on one PostgreSQL: sharing, expiry and fencing.

The "browser" is the fake Chromium; what a login leaves in the profile is a cookie marker the
test writes into the holding guard's unsealed working copy (where Chromium would write its
cookie database), and reads back from the working copy of the guard that gets the profile next.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

from sfguard.supervisor.client.guard_client import GuardClient
from sfguard.supervisor.home import runtime_path
from tests.daemon.test_runs import stage, wait_ready
from tests.pg.conftest import ROOT, TTL

PROFILE = "acct"


def cookies(d):
    """The cookie file in guard `d`'s working copy of the profile (what its browser sees)."""
    return runtime_path(d.home) / "profiles" / "local" / PROFILE / "Default" / "Cookies"


def log_in(d, marker: bytes) -> None:
    """What a login does to the profile: the browser writes its cookie database."""
    path = cookies(d)
    assert path.parent.parent.is_dir(), "the profile is not open on this guard"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(marker)


def new_run(d, run: str) -> None:
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201


def end_run(d, run: str, outcome: str = "succeeded") -> dict:
    status, body = d.call("POST", f"/v1/runs/{run}/end", {"outcome": outcome})
    assert status == 200, body
    return body


def lease_of(d) -> dict:
    st = d.call("GET", "/v1/status")[1]
    return next((l for l in st["leases"] if l["profile"] == PROFILE), {})


def test_second_guard_waits_names_the_holder_and_gets_the_login(guards):
    g1, g2 = guards.start("g1"), guards.start("g2")
    assert "store PostgreSQL" in g1.banner and "shared key file" in g1.banner
    new_run(g1, "r1")
    assert stage(g1, "r1", "s1")[0] == 200
    log_in(g1, b"sid=logged-in-on-guard-1")
    guard1_id = lease_of(g1)["holder_guard"]
    assert guard1_id

    new_run(g2, "r2")
    status, body = stage(g2, "r2", "s1")
    assert status == 202 and body["state"] == "waiting"
    assert (body["holder_run"], body["holder_guard"], body["holder_host"]) == \
        ("r1", guard1_id, socket.gethostname())
    seen_by_2 = lease_of(g2)
    assert (seen_by_2["holder_run"], seen_by_2["holder_guard"]) == ("r1", guard1_id)
    assert [q["run"] for q in lease_of(g1)["queue"]] == ["r2"]   # guard 1 sees guard 2's run queued
    assert not cookies(g2).exists()

    end_run(g1, "r1")
    assert wait_ready(g2, "r2", "s1", timeout=30)["state"] == "ready"
    assert cookies(g2).read_bytes() == b"sid=logged-in-on-guard-1"   # still logged in
    assert lease_of(g1)["holder_run"] == "r2"
    end_run(g2, "r2")

    env = guards.env(guards.tmp)
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "verify", "--json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"ok": true' in out.stdout
    shown = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "show", "--profile", PROFILE],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60).stdout
    leased = [l for l in shown.splitlines() if "profile_leased" in l]
    assert [("run=r1" in l, "run=r2" in l) for l in leased] == [(True, False), (False, True)]


class Watcher:
    """Polls both guards: how many of them have a run with a ready stage on the profile."""

    def __init__(self, daemons):
        self.daemons = daemons
        self.clients = [GuardClient(d.home, timeout=10) for d in daemons]
        self.samples: list[tuple[str, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _holders(self) -> tuple[str, ...]:
        out = []
        for d, client in zip(self.daemons, self.clients, strict=True):
            if d.proc.poll() is not None:
                continue                       # a dead guard holds nothing it can use
            try:
                st = client.call("GET", "/v1/status")[1]
            except Exception:
                continue
            for r in st["runs"]:
                if any(s["profile"] == PROFILE and s["state"] == "ready" for s in r["stages"]):
                    out.append(f"{d.home.parent.name}:{r['run_id']}")
        return tuple(out)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._holders())
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def test_kill_9_of_the_holder_hands_the_last_sealed_login_over_after_the_ttl(guards):
    g1, g2 = guards.start("g1"), guards.start("g2")
    new_run(g1, "r1")
    stage(g1, "r1", "s1")
    log_in(g1, b"sid=sealed-state")
    end_run(g1, "r1")                          # resealed into the database
    new_run(g1, "r3")
    assert stage(g1, "r3", "s1")[0] == 200
    log_in(g1, b"sid=never-sealed")            # lost with the guard
    new_run(g2, "r2")
    with Watcher([g1, g2]) as watch:
        assert stage(g2, "r2", "s1")[0] == 202
        time.sleep(0.3)
        g1.proc.send_signal(signal.SIGKILL)
        g1.proc.wait(10)
        killed = time.monotonic()
        status, body = g2.call("GET", "/v1/runs/r2/stages/s1")
        assert status == 202 and body["holder_run"] == "r3"   # not before the TTL
        ready = wait_ready(g2, "r2", "s1", timeout=TTL + 60)
        waited = time.monotonic() - killed
        time.sleep(0.3)
    assert ready["state"] == "ready"
    assert waited >= TTL / 2, waited          # its lease outlived it (TTL after its last beat)
    assert cookies(g2).read_bytes() == b"sid=sealed-state"
    assert all(len(s) <= 1 for s in watch.samples), [s for s in watch.samples if len(s) > 1]
    holders = {s[0] for s in watch.samples if s}
    assert holders == {"g1:r3", "g2:r2"}, holders
    end_run(g2, "r2")


def test_a_paused_guard_cannot_overwrite_the_newer_login(guards):
    g1, g2 = guards.start("g1"), guards.start("g2")
    new_run(g1, "r1")
    stage(g1, "r1", "s1")
    log_in(g1, b"sid=stale-state-of-guard-1")
    new_run(g2, "r2")
    assert stage(g2, "r2", "s1")[0] == 202
    g1.proc.send_signal(signal.SIGSTOP)
    try:
        ready = wait_ready(g2, "r2", "s1", timeout=TTL + 60)   # guard 1 stopped beating
        assert ready["state"] == "ready"
        log_in(g2, b"sid=newer-state-of-guard-2")
        end_run(g2, "r2")                                       # resealed with the newer token
    finally:
        g1.proc.send_signal(signal.SIGCONT)
    body = end_run(g1, "r1")                                    # its late reseal
    assert body["ok"] is False
    assert any("refused" in p and "fencing token" in p for p in body["problems"]), body
    log = g1.log.read_text()
    assert "late reseal of profile local/acct refused" in log
    assert "stale-state" not in log                             # never the profile's contents
    new_run(g1, "r3")
    if stage(g1, "r3", "s1")[0] != 200:
        wait_ready(g1, "r3", "s1", timeout=30)       # raises unless it gets the profile
    assert cookies(g1).read_bytes() == b"sid=newer-state-of-guard-2"
    end_run(g1, "r3")


def test_a_pipeline_profile_keeps_its_workflow_identity_on_every_host(guards, tmp_path):
    """`@pipeline` of one pipeline path is one profile, made with its workflow identity; every
    guard and every host's CLI shows that identity (a named profile has none)."""
    from sfguard.supervisor.profiles.local_store import pipeline_profile_name
    pipeline = "/srv/pipelines/login-pipeline.yaml"
    name = pipeline_profile_name(pipeline)
    g1, g2 = guards.start("g1"), guards.start("g2")
    assert g1.call("POST", "/v1/runs", {"run_id": "r1", "pipeline": pipeline})[0] == 201
    assert stage(g1, "r1", "s1", profile="@pipeline")[0] == 200
    assert stage(g1, "r1", "s2", profile="named")[0] == 200
    end_run(g1, "r1")
    assert g2.call("POST", "/v1/runs", {"run_id": "r2", "pipeline": pipeline})[0] == 201
    assert stage(g2, "r2", "s1", profile="@pipeline")[0] == 200    # the same profile
    end_run(g2, "r2")
    listed = {p["name"]: p["identity"] for p in g2.call("GET", "/v1/profiles")[1]["profiles"]}
    assert listed == {name: name, "named": None}
    env = guards.env(guards.tmp)
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "profiles", "list", "--json", "--home",
                          str(tmp_path / "another-host")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json
    assert {p["name"]: p["identity"] for p in json.loads(out.stdout)["profiles"]} == listed
    shown = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "profiles", "show", name], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60).stdout
    assert f"identity:      {name}" in shown
