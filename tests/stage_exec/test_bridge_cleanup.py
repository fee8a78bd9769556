"""A guard's stage bridge folder (`sfb-...` beside its runtime folder, see
supervisor/stage/stage_bridge.py) goes with the guard on every way out: a stop, a start that fails
after the guard started (a port it cannot bind), and a kill followed by `sfguard sweep`."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from sfguard.supervisor.home import runtime_path
from sfguard.supervisor.stage.stage_bridge import bridge_root_for
from tests.daemon.conftest import ROOT
from tests.shm_leftovers import left_by
from tests.stage_exec.conftest import start_fake_daemon


def bridge_root(d):
    return bridge_root_for(runtime_path(d.home))


def ready_stage(d, run="r1", sid="s1"):
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    status, answer = d.call("POST", f"/v1/runs/{run}/stages", {
        "stage_id": sid, "attempt": 1, "browser": {"headed": False, "allow_domains": ["site-a.test"]}})
    assert status == 200, answer


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_guard_leaves_no_bridge_folder(tmp_path, fake_cdp, sig):
    d = start_fake_daemon(tmp_path, fake_cdp)
    try:
        ready_stage(d)
        stage_dirs = [p for p in bridge_root(d).iterdir()]
        assert len(stage_dirs) == 1 and {p.name for p in stage_dirs[0].iterdir()} == {"gate.sock", "proxy.sock"}
        assert d.stop(sig) == 0
        assert not bridge_root(d).exists()
    finally:
        d.finish()


def test_a_killed_guard_then_sfguard_sweep_leaves_no_bridge_folder(tmp_path, fake_cdp):
    d = start_fake_daemon(tmp_path, fake_cdp)
    try:
        ready_stage(d)
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        assert bridge_root(d).exists()             # nothing can clean up inside a SIGKILL
        r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "sweep", "--home", str(d.home), "--json"],
                           cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert '"bridges_removed": true' in r.stdout, r.stdout
        assert not bridge_root(d).exists()
        assert left_by(tmp_path, ("sfb", "sfg")) == []    # the runtime folder went too
    finally:
        d.finish()


@pytest.mark.parametrize("flag", ["--tcp", "--console"])
def test_a_guard_that_cannot_bind_its_port_stops_and_leaves_no_bridge_folder(tmp_path, fake_cdp, flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        d = start_fake_daemon(tmp_path, fake_cdp, flag, f"127.0.0.1:{port}" if flag == "--console" else str(port),
                              expect_ready=False)
        try:
            code = d.proc.wait(120)
        finally:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait(10)
    assert code != 0
    assert not bridge_root(d).exists()
    # the guard stopped itself: nothing of it is left, not even its runtime folder's files
    assert left_by(tmp_path, ("sfb",)) == []
    d.finish()
