"""`sfguard status` as monitors and operators read it (issue 35, sections 3 and 6): `--tcp 0`
names the port it got (banner and status), `--check` exits 1 while something needs the
operator (an invalid policy edit) and 0 otherwise, and an ended run's proxy reads `stopped`,
not like an alert."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.daemon.conftest import ROOT
from tests.daemon.test_audit_order import GOOD, wait_policy
from tests.daemon.test_runs import stage, wait_ready


def status(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", "status", "--home",
                           str(daemon.home), *args], cwd=ROOT, env=daemon.env,
                          capture_output=True, text=True, timeout=60)


def test_status_names_the_tcp_port_and_check_exits_1_on_an_invalid_edit(daemon, tmp_path):
    live = tmp_path / "live.yaml"
    live.write_text(GOOD)
    daemon.stop()
    daemon.start("--tcp", "0", "--policy", str(live))
    port = int(re.search(r"API on http://127\.0\.0\.1:(\d+) ", daemon.banner).group(1))
    assert port != 0, "the banner names port 0 (the token line is not shown: a secret)"
    try:                                      # the API listens there (and wants its token)
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=10)
        raise AssertionError("answered without a token")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
    out = status(daemon, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["guard"]["tcp_port"] == port

    # an ended run: its proxy is stopped, which is no alert
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    stage(daemon, "r1", "s1", profile=None)
    wait_ready(daemon, "r1", "s1")
    daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
    out = status(daemon, "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("run     r1"))
    assert "stopped" in line and "DOWN" not in line, line
    assert "ALERT" not in out.stdout

    time.sleep(1.1)
    live.write_text(GOOD + "mode: sideways\n")
    wait_policy(daemon, "error")
    plain, check, check_json = status(daemon), status(daemon, "--check"), status(daemon, "--check", "--json")
    assert plain.returncode == 0 and "INVALID EDIT" in plain.stdout
    assert check.returncode == 1, check.stdout + check.stderr
    assert re.search(r"^ALERT +invalid policy edit of .*live\.yaml", check.stdout, re.M), check.stdout
    assert check_json.returncode == 1 and json.loads(check_json.stdout)["policy"]["state"] == "error"
    assert "ALERT invalid policy edit" in check_json.stderr

    # the guard's log: one format for every line (the daemon's and its run proxies'), the
    # refused edit once, on one line
    time.sleep(1.5)                        # the spare run proxy polls the same file too
    lines = [l for l in daemon.log.read_text().splitlines() if l.strip()]
    fmt = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                     r"[\w.]+: ")
    assert [l for l in lines if not fmt.match(l)] == []
    assert len([l for l in lines if "sideways" in l]) == 1, [l for l in lines if "sideways" in l]
