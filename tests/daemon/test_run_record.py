"""The record of a run, with real Chromium and agent-browser (issue 48, the proof):

* a run whose stage browses, is refused a host, has a write held and approved and a command
  refused produces a record with each of those entries, in the order they happened, the held
  write with its screenshot; typed text is its length and field (a password's value never);
* the secret scan: no secret the run used (the password, the site's login cookies, a query
  value, the stage's gate token) is anywhere in the record or its export;
* `sfguard runs verify` finds an edit of the record the guard sealed;
* the export opens in a real browser without the guard and shows the timeline;
* a guard killed mid-run leaves a record readable up to the kill, sealed `abandoned` at the
  next start and verified."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import aiohttp
import pytest

from sfguard.fixtures.login_server.server import DEFAULT_PASSWORD, STATE_KEY, start_login_server
from sfguard.supervisor.console.viewer import Viewer
from sfguard.supervisor.record import files
from tests.console.conftest import ARTIFACTS
from tests.daemon.conftest import ROOT, start_real_guard
from tests.daemon.test_real_browser import as_stage

pytestmark = pytest.mark.browser

QUERY_SECRET = "QV-" + os.urandom(6).hex()


@contextlib.contextmanager
def site_in_process():
    """The fixture login site in this process (its login tokens: the cookies' values, which
    are the secrets a scan must not find), on a loop of its own."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        box["runner"], box["url"] = loop.run_until_complete(start_login_server())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield box
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def sfguard(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(home)],
                          capture_output=True, text=True, env=env, timeout=120)


def entries_of(home: Path, run: str) -> list[dict]:
    r = sfguard(home, "runs", "show", run, "--json")
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


def first(entries: list[dict], **want) -> dict:
    for e in entries:
        if all(e.get(k) == v for k, v in want.items()):
            return e
    raise AssertionError(f"no entry {want} in {[(x['seq'], x['kind'], x.get('method')) for x in entries]}")


def wait_pending(d, run: str, bound: float = 30) -> str:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        pending = d.call("GET", f"/v1/approvals?run={run}&state=pending&wait=5")[1]["approvals"]
        if pending:
            return pending[0]["id"]
    raise AssertionError("no write was held")


async def refused_command(env: dict) -> str:
    """A raw CDP client with the stage's gate URL asks for every cookie: refused by the gate."""
    async with aiohttp.ClientSession() as s, s.ws_connect(env["AGENT_BROWSER_CDP"]) as ws:
        await ws.send_json({"id": 1, "method": "Storage.getCookies"})
        return (await ws.receive_json(timeout=20))["error"]["message"]


def test_a_run_is_recorded_step_by_step_and_nothing_secret_is_in_it(tmp_path):
    with site_in_process() as site:
        port = int(site["url"].rsplit(":", 1)[1])
        d = start_real_guard(tmp_path, port, "site-a.test", "site-b.test")
        try:
            a, run = f"http://site-a.test:{port}", "rec-proof"
            pipeline = str(tmp_path / "record-pipeline.yaml")
            assert d.call("POST", "/v1/runs", {"run_id": run, "pipeline": pipeline})[0] == 201
            status, ans = d.call("POST", f"/v1/runs/{run}/stages", {"stage_id": "browse", "attempt": 1, "browser": {
                "profile": "acct", "headed": False, "allow_domains": [f"site-a.test:{port}"], "writes": "gate"}})
            assert status == 200, ans
            env = ans["env"]
            assert as_stage(env, "open", f"{a}/login?next=/account&token={QUERY_SECRET}").returncode == 0
            as_stage(env, "open", f"http://site-b.test:{port}/")                   # refused by the proxy
            assert as_stage(env, "open", f"{a}/login").returncode == 0
            assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
            assert as_stage(env, "fill", "input[name=password]", DEFAULT_PASSWORD).returncode == 0
            assert as_stage(env, "click", "button[type=submit]").returncode == 0     # held for a person
            approval = wait_pending(d, run)
            assert d.call("POST", f"/v1/approvals/{approval}", {"decision": "approve", "reason": "expected"})[0] == 200
            assert as_stage(env, "wait", "--load", "load", timeout=90).returncode == 0
            assert "refused Storage.getCookies" in asyncio.run(refused_command(env))
            time.sleep(1.0)                 # the decision log is read every 250 ms
            assert d.call("POST", f"/v1/runs/{run}/stages/browse/end", {"outcome": "succeeded"})[0] == 200
            assert d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[1]["ok"]
            state = site["runner"].app[STATE_KEY]
            cookies = set(state.persist_tokens) | set(state.session_tokens)
        finally:
            d.stop()
    assert cookies, "the login set no cookie: the scan below would prove nothing"
    entries = entries_of(d.home, run)
    by_t = sorted(entries, key=lambda e: e["t"])
    steps = [first(by_t, kind="loaded", url=f"{a}/login?next=...&token=..."),
             first(by_t, kind="proxy", verdict="deny", host="site-b.test"),
             first(by_t, kind="command", method="Input.insertText", field="input[name=password]"),
             first(by_t, kind="write", verdict="held", approval=approval),
             first(by_t, kind="write", verdict="approved", approval=approval),
             first(by_t, kind="loaded", url=f"{a}/account"),
             first(by_t, kind="command", method="Storage.getCookies")]
    assert [by_t.index(s) for s in steps] == sorted(by_t.index(s) for s in steps), \
        [(s["seq"], s["kind"]) for s in steps]
    _, refused_host, password, held, approved, _, refused = steps
    assert refused_host["stage"] == "browse" and refused_host["links"]["command"] == first(
        entries, kind="command", method="Page.navigate", url=f"http://site-b.test:{port}/")["seq"]
    assert password["chars"] == len(DEFAULT_PASSWORD) and password["secret"] and "text" not in password
    assert first(entries, kind="command", method="Input.insertText", field="input[name=user]")["text"] == "operator"
    folder = d.home / "records" / run
    shot = folder / "shots" / held["links"]["shot"]
    assert shot.read_bytes()[:4] == b"\x89PNG" and approved["links"]["held"] == held["seq"]
    assert approved["by"] == "user:root" if os.geteuid() == 0 else approved["by"].startswith("user:")
    assert refused["refused"].startswith("cookie and storage dumps")
    assert any(e["kind"] == "screenshot" and e["why"] == "navigation" for e in entries)
    # nothing secret: the password, the login cookies, the query value, the gate token
    secrets = {DEFAULT_PASSWORD, QUERY_SECRET, env["AGENT_BROWSER_CDP"].rsplit("/", 1)[1], *cookies}
    out = tmp_path / "export.zip"
    assert sfguard(d.home, "runs", "export", run, "--out", str(out)).returncode == 0
    with zipfile.ZipFile(out) as z:
        exported = {n: z.read(n) for n in z.namelist()}
    scanned = {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()} | exported
    assert len(scanned) >= 8
    found = [(name, s[:4]) for name, data in scanned.items() for s in secrets if s.encode() in data]
    assert found == [], found
    # sealed: verified against the audit chain; an edit is found
    assert sfguard(d.home, "runs", "verify", run).returncode == 0
    assert sfguard(d.home, "audit", "verify").returncode == 0
    timeline = folder / files.TIMELINE
    kept = timeline.read_bytes()
    timeline.write_bytes(kept.replace(b'"verdict":"approved"', b'"verdict":"denied"', 1))
    r = sfguard(d.home, "runs", "verify", run)
    assert r.returncode == 1 and "does not match the chain" in r.stdout, r.stdout
    timeline.write_bytes(kept)
    asyncio.run(open_export(out, run, len(entries)))


async def open_export(archive: Path, run: str, count: int) -> None:
    """The export in a real browser, as a file: no guard, no server."""
    where = Path(tempfile.mkdtemp(prefix="sfg-export-"))
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(where)
        for p in [where, *where.rglob("*")]:         # the viewer may run as the browser user
            p.chmod(0o755 if p.is_dir() else 0o644)
        async with Viewer() as v:
            await v.goto((where / run / "index.html").as_uri())
            await v.wait_for("document.querySelectorAll('#timeline tbody tr').length > 0", 20, "the timeline")
            rows = await v.eval("document.querySelectorAll('#timeline tbody tr').length")
            text = await v.eval("document.body.innerText")
            pictures = await v.wait_for("[...document.images].filter(i => i.complete && i.naturalWidth > 0).length",
                                        20, "the screenshots")
            assert 0 < rows <= count and f"{count} (timeline.jsonl" in text      # repeats are one line
            assert "write held" in text and "REFUSED by the gate" in text
            assert pictures >= 2
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            await v.screenshot(ARTIFACTS / "run-export.png")
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_killed_guard_leaves_a_record_readable_up_to_the_kill(tmp_path, site):
    d = start_real_guard(tmp_path, site, "site-a.test")
    a, run = f"http://site-a.test:{site}", "rec-kill"
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    env = d.call("POST", f"/v1/runs/{run}/stages", {"stage_id": "s1", "attempt": 1, "browser": {
        "profile": "acct", "headed": False, "allow_domains": ["site-a.test"]}})[1]["env"]
    assert as_stage(env, "open", f"{a}/login").returncode == 0
    assert as_stage(env, "get", "title").returncode == 0
    deadline = time.monotonic() + 20        # the load's screenshot is written in the background
    while not list((d.home / "records" / run / "shots").glob("*.jpg")) and time.monotonic() < deadline:
        time.sleep(0.2)
    d.stop(signal.SIGKILL)
    # the guard is dead: the CLI reads the record as it was written
    entries = entries_of(d.home, run)
    assert [e["kind"] for e in entries][:2] == ["run_started", "stage_requested"]
    assert first(entries, kind="loaded", url=f"{a}/login")
    assert first(entries, kind="command", method="Runtime.evaluate", script="document.title")
    shots = [e for e in entries if e["kind"] == "screenshot"]
    assert shots and all((d.home / "records" / run / "shots" / e["shot"]).stat().st_size > 0 for e in shots)
    assert files.read_index(d.home / "records" / run)["state"] == "active"
    d.start("--policy", str(tmp_path / "sites.yaml"), "--resolve", "site-a.test=127.0.0.1")
    try:
        index = files.read_index(d.home / "records" / run)
        assert index["state"] == "abandoned" and index["entries"] == len(entries)
        r = sfguard(d.home, "runs", "verify", run)
        assert r.returncode == 0, r.stdout
    finally:
        d.stop()
