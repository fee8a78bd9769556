"""CDP gate overhead: p50/p99 latency through the gate vs direct CDP, measured in the same run.

Launches two browsers with temp profiles: the baseline, a Chromium launched by agent-browser
with a DevTools port (direct CDP over a WebSocket, what stages had before the gate), and a
guard anchor (LocalBrowserHost: DevTools pipe, no port) behind the gate. Then measures
  1. a raw `Runtime.evaluate` round trip on an attached tab (plain aiohttp WebSocket client),
     direct to the baseline browser's port vs through the gate onto the guard's pipe
     (alternating blocks);
  2. `agent-browser get url` from a --cdp stage session, direct vs through the gate.
Run: .venv/bin/python bench/cdp_gate_bench.py [--rounds N] [--cli-rounds M]
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
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sfguard.supervisor.browsers import tools  # noqa: E402
from sfguard.supervisor.browsers.host import AnchorSpec, LocalBrowserHost  # noqa: E402
from sfguard.supervisor.gate.cdp_gate import CdpGate  # noqa: E402

AB = tools.find_agent_browser().path or "agent-browser"  # not found: from PATH, failing if absent
BROWSER = tools.find_browser().path or "/usr/bin/chromium"


def env_base() -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "AGENT_BROWSER_EXECUTABLE_PATH": BROWSER,
           "AGENT_BROWSER_IDLE_TIMEOUT_MS": "0"}
    if os.geteuid() == 0:
        env["AGENT_BROWSER_ARGS"] = "--no-sandbox"
    return env


def ab(env: dict, *args: str) -> str:
    out = subprocess.run([AB, *args], env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"agent-browser {args[0]} failed")
    return out.stdout.strip()


def session_env(tag: str, **extra: str) -> dict:
    env = env_base()
    env.update({"AGENT_BROWSER_SOCKET_DIR": tempfile.mkdtemp(prefix="cgb", dir="/tmp"),
                "AGENT_BROWSER_SESSION": f"b{tag}{uuid.uuid4().hex[:6]}", **extra})
    return env


def close_session(env: dict) -> None:
    pid_file = Path(env["AGENT_BROWSER_SOCKET_DIR"]) / f"{env['AGENT_BROWSER_SESSION']}.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    subprocess.run([AB, "close"], env=env, capture_output=True, timeout=60)
    if pid:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(env["AGENT_BROWSER_SOCKET_DIR"], ignore_errors=True)


class Client:
    def __init__(self, ws):
        self.ws, self.n = ws, 0

    async def call(self, method, params=None, session_id=None):
        self.n += 1
        msg = {"id": self.n, "method": method, "params": params or {}}
        if session_id:
            msg["sessionId"] = session_id
        await self.ws.send_str(json.dumps(msg))
        while True:
            data = json.loads((await self.ws.receive(timeout=10)).data)
            if data.get("id") == self.n:
                return data


async def evaluate_latencies(url: str, rounds: int) -> tuple[list[float], str]:
    async with aiohttp.ClientSession() as s, s.ws_connect(url, max_msg_size=0) as ws:
        c = Client(ws)
        tid = (await c.call("Target.createTarget", {"url": "about:blank"}))["result"]["targetId"]
        sid = (await c.call("Target.attachToTarget", {"targetId": tid, "flatten": True}))["result"]["sessionId"]
        for _ in range(20):  # warm-up
            await c.call("Runtime.evaluate", {"expression": "1+1", "returnByValue": True}, sid)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = await c.call("Runtime.evaluate", {"expression": "1+1", "returnByValue": True}, sid)
            times.append((time.perf_counter() - t0) * 1000)
            assert r["result"]["result"]["value"] == 2
        await c.call("Target.closeTarget", {"targetId": tid})
        return times, tid


async def cli_latencies(env: dict, rounds: int) -> list[float]:
    await asyncio.to_thread(ab, env, "open", "about:blank")
    await asyncio.to_thread(ab, env, "stream", "disable")
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await asyncio.to_thread(ab, env, "get", "url")
        times.append((time.perf_counter() - t0) * 1000)
    return times


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000, help="Runtime.evaluate round trips per side")
    ap.add_argument("--cli-rounds", type=int, default=40, help="agent-browser get url calls per side")
    args = ap.parse_args()
    profile = Path(tempfile.mkdtemp(prefix="cgbprof"))
    anchor = session_env("anc", AGENT_BROWSER_PROFILE=str(profile))
    stages: list[dict] = []
    gate = CdpGate()
    await gate.start()
    host = LocalBrowserHost()
    root = Path(tempfile.mkdtemp(prefix="cgb", dir="/tmp"))
    piped = await host.launch_anchor(AnchorSpec(
        session="cgbpipe", socket_dir=root / "s", config_path=root / "cfg.json",
        browser_path=BROWSER, temp_root=root, allow_direct=True))
    try:
        ab(anchor, "open", "about:blank")
        ab(anchor, "stream", "disable")
        raw = ab(anchor, "get", "cdp-url")
        gate_url = gate.add_stage("bench", piped.pipe, tab_quota=64)
        direct_eval, gated_eval = [], []
        block = max(1, args.rounds // 10)
        for _ in range(10):  # alternate blocks so drift hits both sides alike
            direct_eval += (await evaluate_latencies(raw, block))[0]
            gated_eval += (await evaluate_latencies(gate_url, block))[0]
        direct_env = session_env("d", AGENT_BROWSER_CDP=raw)
        gated_env = session_env("g", AGENT_BROWSER_CDP=gate_url, AGENT_BROWSER_PIN_TAB="1")
        direct_env["AGENT_BROWSER_PIN_TAB"] = "1"
        stages += [direct_env, gated_env]
        direct_cli = await cli_latencies(direct_env, args.cli_rounds)
        gated_cli = await cli_latencies(gated_env, args.cli_rounds)
    finally:
        for env in stages:
            close_session(env)
        await gate.close_stage_tabs("bench") if "bench" in gate._stages else None
        await gate.stop()
        await host.close_anchor(piped)
        close_session(anchor)
        shutil.rmtree(profile, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    print(f"CDP gate overhead ({args.rounds} Runtime.evaluate round trips, {args.cli_rounds} CLI calls per side)")
    print(f"{'measure':34} {'direct p50':>10} {'gate p50':>9} {'added':>7} {'ratio':>6} "
          f"{'direct p99':>10} {'gate p99':>9} {'ratio':>6}")
    for name, d, g in (("Runtime.evaluate round trip (ms)", direct_eval, gated_eval),
                       ("agent-browser get url (ms)", direct_cli, gated_cli)):
        d50, g50, d99, g99 = pct(d, .5), pct(g, .5), pct(d, .99), pct(g, .99)
        print(f"{name:34} {d50:10.3f} {g50:9.3f} {g50 - d50:7.3f} {g50 / d50:6.2f} "
              f"{d99:10.3f} {g99:9.3f} {g99 / d99:6.2f}")
    print(f"(means: evaluate {statistics.mean(direct_eval):.3f} vs {statistics.mean(gated_eval):.3f} ms)")
    target_ok = pct(gated_eval, .5) - pct(direct_eval, .5) < 1.0
    print(f"target: added p50 < 1 ms for raw round trips: {'met' if target_ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
