"""`sfguard start --log-format json`: every line the guard and its run proxies write to stderr
is one JSON object (ts, level, logger, event, pid), masked like the text log: a stage's gate
token never appears."""
from __future__ import annotations

import json

from tests.daemon.test_api_contract import stage_body


def test_json_log_lines_from_the_daemon_and_its_run_proxies(daemon):
    d = daemon
    d.stop()
    d.log.write_text("")
    d.start("--log-format", "json")
    assert d.call("POST", "/v1/runs", {"run_id": "j1"})[0] == 201
    status, ready = d.call("POST", "/v1/runs/j1/stages", stage_body("s"))
    assert status == 200, ready
    token = ready["env"]["AGENT_BROWSER_CDP"].rsplit("/", 1)[1]
    d.call("POST", "/v1/runs/j1/end", {"outcome": "succeeded"})
    assert d.stop() == 0
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
    assert any("run j1 created" in r["event"] for r in records)
