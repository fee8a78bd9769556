"""GET /metrics as an operator's Prometheus would scrape it: the text format, parsed with
prometheus_client's own parser; authenticated on every listener; names and labels by the
Prometheus conventions (units in names, `_total` counters, no unbounded labels); the figures
follow what the guard does (runs, a lease wait, a stage start, a refused CDP call in the
decision log)."""
from __future__ import annotations

import asyncio
import http.client
import json
import re

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sfguard.supervisor.client.guard_client import _UnixConnection, socket_path
from tests.conftest import free_port
from tests.daemon.test_api_contract import stage_body

UNBOUNDED = {"host", "run", "run_id", "profile", "stage", "stage_id", "url", "path", "client", "addr"}


def scrape_unix(d) -> tuple[int, str, str]:
    conn = _UnixConnection(str(socket_path(d.home)), 30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read().decode()
    finally:
        conn.close()


def scrape_tcp(port: int, auth: str | None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": auth} if auth else {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def parse(text: str) -> dict[str, list]:
    """family name -> its samples; the parser raises on anything that is not the format."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, fam.samples)
    return out


def value(fams, family: str, suffix: str = "", **labels) -> float:
    _type, samples = fams[family]
    hits = [s.value for s in samples if s.name == family + suffix
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, suffix, labels, samples)
    return hits[0]


async def refused_cdp_call(gate_url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.ws_connect(gate_url) as ws:
        await ws.send_json({"id": 1, "method": "Storage.getCookies", "params": {}})
        return json.loads((await ws.receive(timeout=20)).data)


def test_metrics_follow_the_guard_and_keep_to_the_conventions(daemon, tmp_path):
    d = daemon
    d.stop()
    port, token_file = free_port(), tmp_path / "token"
    d.start("--tcp", str(port), "--token-file", str(token_file))
    token = token_file.read_text().strip()
    # never without authentication on TCP
    assert scrape_tcp(port, None)[0] == 401
    assert scrape_tcp(port, "Bearer wrong")[0] == 401
    status, ctype, text = scrape_unix(d)
    assert status == 200 and ctype.startswith("text/plain") and "version=0.0.4" in ctype
    before = parse(text)
    assert value(before, "sfguard_runs", state="active") == 0
    assert value(before, "sfguard_processes", kind="guard") == 1

    # run a holds the profile; run b's stage queues behind it; a's stage calls a refused method
    d.call("POST", "/v1/runs", {"run_id": "a"})
    d.call("POST", "/v1/runs", {"run_id": "b"})
    st, ready = d.call("POST", "/v1/runs/a/stages", stage_body("s"))
    assert st == 200, ready
    assert d.call("POST", "/v1/runs/b/stages", stage_body("s"))[0] == 202
    answer = asyncio.run(refused_cdp_call(ready["env"]["AGENT_BROWSER_CDP"]))
    assert "error" in answer

    status, text = scrape_tcp(port, f"Bearer {token}")
    assert status == 200
    assert token not in text
    fams = parse(text)
    assert value(fams, "sfguard_runs", state="active") == 2
    assert value(fams, "sfguard_stages", state="ready") == 1
    assert value(fams, "sfguard_stages", state="waiting") == 1
    assert value(fams, "sfguard_lease_queue_depth") == 1
    assert value(fams, "sfguard_lease_waits", "_total") == 1
    assert value(fams, "sfguard_stage_start_seconds", "_count") == 1
    assert value(fams, "sfguard_stage_start_seconds", "_sum") > 0
    refused = [s for s in fams["sfguard_decisions"][1] if s.labels.get("decision") == "deny"]
    assert sum(s.value for s in refused) >= 1, fams["sfguard_decisions"]
    assert value(fams, "sfguard_processes", kind="proxy") >= 1
    assert value(fams, "sfguard_process_resident_memory_bytes", kind="guard") > 10_000_000
    assert value(fams, "sfguard_disk_free_bytes", folder="home") > 0
    assert value(fams, "sfguard_disk_low", folder="home") in (0, 1)
    assert value(fams, "sfguard_audit_chain_ok") == 1
    assert value(fams, "sfguard_policy_edit_invalid") == 0
    assert value(fams, "sfguard_login_checks", "_total", result="logged_in") == 0
    # what waits for a person, restarts, webhooks, the version (also in status)
    assert value(fams, "sfguard_approvals_pending") == 0
    assert value(fams, "sfguard_oldest_pending_seconds", kind="approval") == 0
    assert value(fams, "sfguard_oldest_pending_seconds", kind="handoff") == 0
    assert value(fams, "sfguard_handoffs_open") == 0
    assert value(fams, "sfguard_restarts", "_total", kind="browser") == 0
    assert value(fams, "sfguard_restarts", "_total", kind="proxy") == 0
    assert value(fams, "sfguard_webhook_deliveries", "_total", result="failed") == 0
    assert value(fams, "sfguard_webhook_attempt_failures", "_total") == 0
    version = d.call("GET", "/v1/status")[1]["guard"]["version"]
    assert version and version != "unknown"
    assert value(fams, "sfguard_build_info", version=version) == 1

    # conventions: our prefix, units in names, _total counters, bounded labels only
    for name, (mtype, samples) in fams.items():
        if not name.startswith("sfguard_"):
            continue
        assert re.fullmatch(r"sfguard_[a-z_]+", name), name
        if mtype == "counter":
            assert any(s.name == name + "_total" for s in samples), name
        if "seconds" in name or "bytes" in name:
            assert name.endswith(("_seconds", "_bytes")), name
        for s in samples:
            assert not UNBOUNDED & set(s.labels), (s.name, s.labels)
            assert "a" != s.labels.get("run") and "acct" not in s.labels.values()
    for run in ("a", "b"):
        d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})
    fams = parse(scrape_unix(d)[2])
    assert value(fams, "sfguard_runs", state="active") == 0
    assert value(fams, "sfguard_lease_queue_depth") == 0


def test_browser_and_proxy_restarts_are_counted(daemon):
    """The watchdog restarts a run's browser and proxy that died (killed here by pid: processes
    of this test's guard); each restart is one more in sfguard_restarts_total{kind}."""
    import os
    import signal
    import time

    import psutil
    d = daemon
    d.call("POST", "/v1/runs", {"run_id": "k"})
    st, _ready = d.call("POST", "/v1/runs/k/stages", stage_body("s"))
    assert st == 200

    def run() -> dict:
        return d.call("GET", "/v1/runs/k")[1]

    def wait(pred, what: str) -> None:
        deadline = time.monotonic() + 30
        while not pred():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    browser_pid = [c["pid"] for c in d.browser_log() if "argv" in c][-1]
    os.kill(browser_pid, signal.SIGKILL)
    wait(lambda: run()["browsers"][0]["restarts"] == 1, "the browser was not restarted")
    port = run()["proxy"]["port"]
    def listens(p: psutil.Process) -> bool:
        try:
            return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                       for c in p.net_connections("tcp"))
        except psutil.Error:      # a child that ended meanwhile (a command the guard ran)
            return False
    tree = psutil.Process(d.proc.pid).children(recursive=True)
    proxy = next(p for p in tree if listens(p))
    proxy.kill()
    wait(lambda: run()["proxy"]["restarts"] == 1 and run()["proxy"]["alive"], "the proxy was not restarted")
    fams = parse(scrape_unix(d)[2])
    assert value(fams, "sfguard_restarts", "_total", kind="browser") == 1
    assert value(fams, "sfguard_restarts", "_total", kind="proxy") == 1
    d.call("POST", "/v1/runs/k/end", {"outcome": "succeeded"})
