"""`sfguard start` with one proxy process for every run (SFGUARD_PROXIES=shared, the default of
`--proxies`), real Chromium and agent-browser: two runs browse at once, each through its own
listener of the one process; the end of one closes its listener and leaves the other browsing."""
from __future__ import annotations

import socket

import psutil
import pytest

from tests.daemon.conftest import start_real_guard
from tests.daemon.test_real_browser import as_stage, hits, request_stage

pytestmark = pytest.mark.browser


def listening(port: int) -> set[int]:
    """The pids listening on 127.0.0.1:port."""
    return {c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}


def test_two_runs_browse_through_their_own_listeners_of_one_proxy_process(tmp_path, site):
    d = start_real_guard(tmp_path, site, "site-a.test", "site-b.test", SFGUARD_PROXIES="shared")
    try:
        ports = {}
        for run, host, profile in (("r1", "site-a.test", "pa"), ("r2", "site-b.test", "pb")):
            assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
            env = request_stage(d, run, "s", [host], profile=profile)
            r = as_stage(env, "open", f"http://{host}:{site}/login")
            assert r.returncode == 0, r.stderr
            status, answer = d.call("GET", f"/v1/runs/{run}")
            assert status == 200 and answer["proxy"]["alive"], answer
            ports[run] = answer["proxy"]["port"]
            ports[run + "-env"] = env
        assert ports["r1"] != ports["r2"]
        owners = listening(ports["r1"]) | listening(ports["r2"])
        assert len(owners) == 1, owners          # one process listens for both runs
        assert hits(site, "site-a.test") >= 1 and hits(site, "site-b.test") >= 1
        # run r1 ends: its listener closes; r2 browses on
        assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[1]["ok"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", ports["r1"]), timeout=5).close()
        before = hits(site, "site-b.test")
        r = as_stage(ports["r2-env"], "open", f"http://site-b.test:{site}/login?again")
        assert r.returncode == 0, r.stderr
        assert hits(site, "site-b.test") > before
        assert listening(ports["r2"]) == owners
    finally:
        d.finish()
