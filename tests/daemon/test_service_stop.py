"""A service stop (systemd's SIGTERM, docs/sfguard.service) tears every open run down before
TimeoutStopSec: each anchor closed, each profile resealed, each lease released, the guard gone."""
from __future__ import annotations

import json
import time

import pytest

from sfguard.supervisor.daemon.service_unit import STOP_TIMEOUT_S
from tests.daemon.test_real_browser import as_stage, browser_processes, request_stage

pytestmark = pytest.mark.browser

RUNS = 3


def test_sigterm_tears_several_open_runs_down_within_the_units_stop_timeout(real_daemon, site):
    d = real_daemon
    for i in range(RUNS):
        d.call("POST", "/v1/runs", {"run_id": f"r{i}"})
        env = request_stage(d, f"r{i}", "s", ["site-a.test"], profile=f"p{i}")
        res = as_stage(env, "open", f"http://site-a.test:{site}/", timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
    procs = browser_processes(d)
    assert procs
    started = time.monotonic()
    assert d.stop(timeout=STOP_TIMEOUT_S) == 0          # killed (not 0) past the timeout
    took = time.monotonic() - started
    print(f"stop of a guard with {RUNS} open runs took {took:.2f} s")
    assert took < STOP_TIMEOUT_S
    assert not list((d.home / "runs").glob("*.json")), "a run record outlived the stop"
    for i in range(RUNS):   # every profile at rest, sealed, and no lease holder or queue left
        assert any(p.is_dir() for p in (d.home / "profiles").rglob(f"p{i}")), f"profile p{i} is not at rest"
        lease = json.loads(next((d.home / "leases").rglob(f"p{i}.lease")).read_text())
        assert lease["holder"] is None and lease["queue"] == [], lease
