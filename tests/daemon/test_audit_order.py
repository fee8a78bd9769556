"""The audit log of a guard (issue 35, section 4): the first run of a new profile is recorded
in causal order (created, leased, released, its record sealed; a second stage of the run
leases nothing new),
and a refused edit of the live policy is recorded like an applied one. Read as `sfguard audit
show` reads it, and checked with `sfguard audit verify`."""
from __future__ import annotations

import subprocess
import sys
import time

from sfguard.supervisor.profiles.audit import LocalAuditSink
from tests.daemon.conftest import ROOT
from tests.daemon.test_runs import stage, wait_ready

GOOD = "version: 1\nmode: enforce\nblock: []\n"


def audit(daemon) -> list[dict]:
    """The records as `sfguard audit show` reads them (the home's log, read-only)."""
    return LocalAuditSink(daemon.home, read_only=True).records()


def wait_policy(daemon, state: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pol = daemon.call("GET", "/v1/status")[1]["policy"]
        if pol["state"] == state:
            return pol
        time.sleep(0.1)
    raise AssertionError(f"the policy did not become {state}: {pol}")


def test_a_first_run_and_a_refused_policy_edit_are_audited_in_order(daemon, tmp_path):
    live = tmp_path / "live.yaml"
    live.write_text(GOOD)
    daemon.stop()
    daemon.start("--policy", str(live))
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    stage(daemon, "r1", "s1", profile="fresh")
    wait_ready(daemon, "r1", "s1")
    stage(daemon, "r1", "s2", profile="fresh")
    wait_ready(daemon, "r1", "s2")
    for sid in ("s1", "s2"):
        daemon.call("POST", f"/v1/runs/r1/stages/{sid}/end", {"outcome": "succeeded"})
    assert daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
    run = [(r["event"], r["fields"].get("profile"), r["fields"].get("run"))
           for r in audit(daemon) if r["fields"].get("run") == "r1"]
    assert run == [("profile_created", "fresh", "r1"), ("profile_leased", "fresh", "r1"),
                   ("profile_released", "fresh", "r1"), ("run_recorded", None, "r1")]   # its record sealed last

    # an invalid edit: refused, kept out of force, and audited once (the watchdog keeps
    # seeing the same bad file every second)
    time.sleep(1.1)                 # a new mtime for the watcher
    live.write_text(GOOD + "mode: sideways\n")
    wait_policy(daemon, "error")
    time.sleep(1.5)
    refused = [r for r in audit(daemon) if r["event"] == "policy_edit_refused"]
    assert len(refused) == 1, refused
    assert refused[0]["fields"]["reason"] == "invalid"
    assert len(refused[0]["fields"]["policy_sha256"]) == 64
    live.write_text(GOOD)
    wait_policy(daemon, "ok")
    events = [r["event"] for r in audit(daemon)]
    assert events.index("policy_edit_refused") < len(events) - 1 - events[::-1].index("policy_reloaded")
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "verify",
                          "--home", str(daemon.home)], cwd=ROOT, env=daemon.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
