"""`sfguard start --log-format json`: every line the guard writes is one JSON object: its log
and its run proxies' on stderr (ts, level, logger, event, pid), and the start banner and the
stop line on stdout; the lines about a run or a stage carry `run` and `stage` as the operator
guide promises; masked like the text log: a stage's gate token never appears."""
from __future__ import annotations

import json

from tests.daemon.test_api_contract import stage_body


def test_json_log_lines_from_the_daemon_and_its_run_proxies(daemon):
    d = daemon
    d.stop()
    d.log.write_text("")
    d.start("--log-format", "json")
    banner = [json.loads(x) for x in d.banner.splitlines() if x.strip()]   # every line JSON
    assert banner[-1]["event"] == "ready" and len(banner) >= 8
    assert any(b["event"].startswith("API on unix:") for b in banner), banner
    assert {b["logger"] for b in banner} == {"sfguard.start"}
    assert d.call("POST", "/v1/runs", {"run_id": "j1"})[0] == 201
    status, ready = d.call("POST", "/v1/runs/j1/stages", stage_body("s"))
    assert status == 200, ready
    token = ready["env"]["AGENT_BROWSER_CDP"].rsplit("/", 1)[1]
    d.call("POST", "/v1/runs/j1/end", {"outcome": "succeeded"})
    assert d.stop() == 0
    rest = d.proc.stdout.read().decode().splitlines()          # the stop line
    stop = [json.loads(x) for x in rest if x.strip()]
    assert [s["event"] for s in stop] == ["stopping; every run is torn down as abandoned"], rest
    lines = [x for x in d.log.read_text().splitlines() if x.strip()]
    assert lines
    records = [json.loads(x) for x in lines]          # every line is one JSON object
    for r in records:
        assert {"ts", "level", "logger", "event", "pid"} <= set(r), r
        assert r["ts"].endswith("Z") and r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    loggers = {r["logger"] for r in records}
    assert any(n.startswith("sfguard.proxy") for n in loggers), loggers     # a run proxy's line
    assert any(n == "sfguard.guard" for n in loggers), loggers
    assert len({r["pid"] for r in records}) >= 2                            # daemon and proxy
    assert token not in d.log.read_text()
    # the documented ids: every line about run j1 names it, stage lines name their stage
    about_run = [r for r in records if "run j1 " in r["event"] or "stage j1/" in r["event"]]
    assert {r["event"].split(" ")[0] for r in about_run} >= {"run", "stage"}, about_run
    assert all(r.get("run") == "j1" for r in about_run), about_run
    assert all(r.get("stage") == "s" for r in about_run if r["event"].startswith("stage j1/s ")), about_run


def test_a_refused_start_writes_its_error_as_json(daemon, tmp_path):
    """A start that cannot happen (a second guard on the home): the one error line is JSON too."""
    import subprocess
    import sys

    from tests.daemon.conftest import ROOT
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(daemon.home),
                           "--log-format", "json"], cwd=ROOT, env=daemon.env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3
    records = [json.loads(x) for x in proc.stderr.splitlines() if x.strip()]
    assert records and records[-1]["level"] == "ERROR" and "already running" in records[-1]["event"], proc.stderr
    assert proc.stdout.strip() == ""
