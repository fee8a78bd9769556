"""A run's record through a real `sfguard start` with the fake agent-browser and Chromium (no
real browser): what a stage sends over its gate is recorded, and no credential the run used is
in the record (the proxy credential the guard answered the browser's challenge with, the gate
token, a secret in a command's parameters); `--record off` keeps no record (issue 48)."""
from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys

import aiohttp

from sfguard.supervisor.record import files
from tests.daemon.conftest import ROOT
from tests.daemon.test_runs import launches, stage

SECRET = "pw-" + os.urandom(8).hex()


async def send(url: str, *calls: tuple[str, dict]) -> list[dict]:
    """Raw CDP through the stage's gate URL: attach to its tab, then each call in its session."""
    out = []
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
        async def call(i: int, method: str, params: dict, session: str | None = None) -> dict:
            extra = {"sessionId": session} if session else {}
            await ws.send_json({"id": i, "method": method, "params": params, **extra})
            while True:
                msg = await ws.receive_json(timeout=20)
                if msg.get("id") == i:
                    return msg
        tabs = (await call(1, "Target.getTargets", {}))["result"]["targetInfos"]
        attached = await call(2, "Target.attachToTarget", {"targetId": tabs[0]["targetId"], "flatten": True})
        sid = attached["result"]["sessionId"]
        for n, (method, params) in enumerate(calls, 3):
            out.append(await call(n, method, params, sid))
    return out


def test_a_record_holds_each_command_and_none_of_the_runs_credentials(daemon):
    assert daemon.call("POST", "/v1/runs", {"run_id": "rf1"})[0] == 201
    status, body = stage(daemon, "rf1", "s1")
    assert status == 200, body
    gate_url = body["env"]["AGENT_BROWSER_CDP"]
    replies = asyncio.run(send(
        gate_url,
        ("Page.navigate", {"url": f"https://site-a.test/reset?code={SECRET}"}),
        ("Runtime.evaluate", {"expression": f"document.querySelector('#pw').value = '{SECRET}'"}),
        ("Input.insertText", {"text": SECRET}),
        ("Network.setExtraHTTPHeaders", {"headers": {"Proxy-Authorization": f"Basic {SECRET}"}})))
    assert "refused Network.setExtraHTTPHeaders" in replies[-1]["error"]["message"]
    assert daemon.call("POST", "/v1/runs/rf1/end", {"outcome": "succeeded"})[0] == 200
    folder = daemon.home / "records" / "rf1"
    entries = files.read_entries(folder)[0]
    methods = [(e.get("method"), e.get("refused") is not None) for e in entries if e["kind"] == "command"]
    for want in [("Page.navigate", False), ("Runtime.evaluate", False), ("Input.insertText", False),
                 ("Network.setExtraHTTPHeaders", True)]:
        assert want in methods, methods
    typed = next(e for e in entries if e.get("method") == "Input.insertText")
    assert typed["chars"] == len(SECRET) and typed["secret"] is True     # the fake has no field to read
    (anchor,) = launches(daemon)
    proxy_secret = anchor["auth"]["password"]
    secrets = [SECRET, proxy_secret, gate_url.rsplit("/", 1)[1], gate_url]
    for path in [p for p in folder.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert [s for s in secrets if s.encode() in data] == [], path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((daemon.home / "records").stat().st_mode) == 0o700
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "runs", "verify", "--json",
                        "--home", str(daemon.home)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr


def test_record_off_keeps_no_record(daemon):
    daemon.stop()
    daemon.start("--record", "off")
    assert daemon.call("POST", "/v1/runs", {"run_id": "rf2"})[0] == 201
    assert stage(daemon, "rf2", "s1")[0] == 200
    assert daemon.call("POST", "/v1/runs/rf2/end", {"outcome": "succeeded"})[0] == 200
    assert not (daemon.home / "records" / "rf2").exists()
