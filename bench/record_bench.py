"""Run-record benchmark (issue 48): what recording costs a stage, and what it stores.

    ./dev bench record_bench [--rounds 5] [--loads 8] [--cdp 300] [--minute 60]

Two guards on this machine, one `--record full` (the default) and one `--record off`, the
fixture login site behind both. Each round runs the same stage on each guard in turn (which one
goes first alternates, so that load coming and going on a shared machine weighs on both alike):
  cdp      a raw CDP client with the stage's gate URL: `Runtime.evaluate 1+1` in the stage's tab,
           one after another: the round trip through the gate (the gate's observer is in it)
  command  `agent-browser get title` (a CLI process per command, as a stage runs it)
  load     `agent-browser open` of the site's pages (returns once the page has loaded), and the
           page's own navigation time (Navigation Timing `duration`, read after it)
Then, on the recording guard only, one stage browses for `--minute` seconds without a pause
(open, snapshot, fill, click, back: a page load every second or two, more than an agent does):
its record's size over that time is the storage per stage-minute of active browsing, with the
default settings (a picture at each load, JPEG quality 50, one at most every 15 s between).
Targets: cdp, command and load within 1.05x of recording off; under 5 MB per stage-minute.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.supervisor.browsers import tools  # noqa: E402
from sfguard.supervisor.client.guard_client import GuardClient  # noqa: E402
from tests.conftest import login_site  # noqa: E402


def start_guard(work: Path, name: str, port: int, level: str) -> tuple[subprocess.Popen, GuardClient, Path]:
    home = work / name / "home"
    home.parent.mkdir()
    pol = work / name / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {port}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    proc = subprocess.Popen([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(home), "--policy",
                             str(pol), "--resolve", "site-a.test=127.0.0.1", "--record", level, "--no-console"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={"PATH": os.environ["PATH"], "HOME": str(work / name), "LANG": "C.UTF-8"})
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        if line.strip() == b"sfguard: ready":
            break
    return proc, GuardClient(home, timeout=180), home


def ab(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[float, subprocess.CompletedProcess]:
    path = tools.find_agent_browser().path
    assert path
    t = time.perf_counter()
    done = subprocess.run([path, *args], env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
                                              **env}, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t, done


async def cdp_round_trips(url: str, n: int) -> list[float]:
    """`n` evaluates in the stage's tab through its gate URL, one after another."""
    out = []
    async with aiohttp.ClientSession() as s, s.ws_connect(url, max_msg_size=0) as ws:
        ids = iter(range(1, 10 ** 6))

        async def call(method: str, params: dict, session: str | None = None) -> dict:
            i = next(ids)
            extra = {"sessionId": session} if session else {}
            await ws.send_json({"id": i, "method": method, "params": params, **extra})
            while True:
                msg = await ws.receive_json(timeout=30)
                if msg.get("id") == i:
                    return msg
        tabs = (await call("Target.getTargets", {}))["result"]["targetInfos"]
        page = next(t for t in tabs if t["type"] == "page")
        attached = await call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})
        sid = attached["result"]["sessionId"]
        for _ in range(n):
            t = time.perf_counter()
            await call("Runtime.evaluate", {"expression": "1+1", "returnByValue": True}, sid)
            out.append(time.perf_counter() - t)
    return out


def one_stage(client: GuardClient, run: str, port: int, args: argparse.Namespace) -> dict[str, list[float]]:
    client.call("POST", "/v1/runs", {"run_id": run})
    st, ans = client.call("POST", f"/v1/runs/{run}/stages", {"stage_id": "s", "attempt": 1, "browser": {
        "profile": "bench", "headed": False, "allow_domains": [f"site-a.test:{port}"]}})
    assert st == 200, ans
    env = ans["env"]
    got: dict[str, list[float]] = {"cdp": [], "command": [], "load": [], "nav": []}
    a = f"http://site-a.test:{port}"
    ab(env, "open", f"{a}/login")                     # warm: the first load of the profile
    for i in range(args.loads):
        took, done = ab(env, "open", f"{a}/{'login' if i % 2 else 'cookies'}?n={i}")
        assert done.returncode == 0, done.stderr
        got["load"].append(took)
        _, nav = ab(env, "eval", "performance.getEntriesByType('navigation')[0].duration")
        got["nav"].append(float(nav.stdout.strip() or "nan") / 1000)
        took, done = ab(env, "get", "title")
        got["command"].append(took)
    got["cdp"] = asyncio.run(cdp_round_trips(env["AGENT_BROWSER_CDP"], args.cdp))
    client.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})
    return got


def browse_a_minute(client: GuardClient, home: Path, port: int, seconds: float) -> dict[str, float]:
    client.call("POST", "/v1/runs", {"run_id": "minute"})
    st, ans = client.call("POST", "/v1/runs/minute/stages", {"stage_id": "s", "attempt": 1, "browser": {
        "profile": "bench", "headed": False, "allow_domains": [f"site-a.test:{port}"]}})
    assert st == 200, ans
    env, a = ans["env"], f"http://site-a.test:{port}"
    t0, loads, commands = time.monotonic(), 0, 0
    while time.monotonic() - t0 < seconds:
        for cmd in (("open", f"{a}/login"), ("snapshot", "-i"), ("fill", "input[name=user]", "someone"),
                    ("open", f"{a}/cookies"), ("get", "title"), ("back",)):
            ab(env, *cmd)
            commands += 1
            loads += cmd[0] in ("open", "back")
    minutes = (time.monotonic() - t0) / 60
    client.call("POST", "/v1/runs/minute/end", {"outcome": "succeeded"})
    folder = home / "records" / "minute"
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    index = json.loads((folder / "index.json").read_text())
    shots = list((folder / "shots").iterdir())
    return {"minutes": minutes, "bytes": size, "mb_per_minute": size / minutes / 1e6, "loads": loads,
            "commands": commands, "entries": index["entries"], "shots": len(shots),
            "shot_kb": sum(p.stat().st_size for p in shots) / max(1, len(shots)) / 1024,
            "timeline_kb": (folder / "timeline.jsonl").stat().st_size / 1024}


def med(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loads", type=int, default=8, help="page loads (and commands) per stage and round")
    ap.add_argument("--cdp", type=int, default=300, help="raw CDP round trips per stage and round")
    ap.add_argument("--minute", type=float, default=60.0, help="seconds of active browsing for the storage figure")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sfg-recbench-"))
    os.chmod(work, 0o711)
    guards = {}
    try:
        with login_site() as port:
            for level in ("off", "full"):
                guards[level] = start_guard(work, level, port, level)
            samples: dict[str, dict[str, list[float]]] = {lv: {} for lv in guards}
            for r in range(args.rounds):
                for level in (("off", "full") if r % 2 == 0 else ("full", "off")):
                    got = one_stage(guards[level][1], f"r{r}", port, args)
                    for k, v in got.items():
                        samples[level].setdefault(k, []).extend(v)
            minute = browse_a_minute(guards["full"][1], guards["full"][2], port, args.minute)
    finally:
        for proc, _client, _home in guards.values():
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(f"record_bench: {args.rounds} rounds, {args.loads} loads and commands and {args.cdp} CDP round trips "
          f"per stage and round, load {os.getloadavg()[0]:.1f}")
    for key, what in (("cdp", "raw CDP round trip through the gate"), ("command", "agent-browser get title"),
                      ("load", "agent-browser open (page loaded)"), ("nav", "page navigation time (browser)")):
        off, full = med(samples["off"][key]), med(samples["full"][key])
        print(f"  {what:<38} off {off * 1000:8.2f} ms   full {full * 1000:8.2f} ms   ratio {full / off:.3f}x")
    print(f"  storage: {minute['bytes'] / 1e6:.2f} MB in {minute['minutes']:.2f} stage-minutes of active browsing "
          f"= {minute['mb_per_minute']:.2f} MB per stage-minute ({minute['loads']} page loads, {minute['commands']} "
          f"commands, {minute['entries']} entries, timeline {minute['timeline_kb']:.0f} KB, {minute['shots']} "
          f"screenshots of {minute['shot_kb']:.0f} KB on average)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
