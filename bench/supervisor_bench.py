"""Supervisor benchmark: how long a stage waits for its browser, and what the guard costs.

    ./dev bench supervisor_bench [--runs 10] [--repeat 3]

Measured in one run, on this machine, against a baseline of the same browser:
  baseline   bare `agent-browser open about:blank` in a new session (browser launch), then close
  first      POST /v1/runs/{id}/stages -> 200 ready for the first stage of a run
             (per-run proxy start + lease + unseal + anchor launch through the proxy + gate token)
  second     the same for a second stage of the same run (the anchor is shared)
  rss        the guard daemon's own RSS, and its proxies' RSS, with N runs open, each with an anchor
Targets: second stage ready < 150 ms; first stage within 1.5x of the bare launch.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor import tools  # noqa: E402
from supervisor.client import GuardClient  # noqa: E402


def bare_launch(ab: str, browser: str, work: Path, i: int) -> float:
    sock = work / f"s{i}"
    sock.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(work), "AGENT_BROWSER_SESSION": f"bench{i}",
           "AGENT_BROWSER_SOCKET_DIR": str(sock), "AGENT_BROWSER_EXECUTABLE_PATH": browser,
           "AGENT_BROWSER_PROFILE": str(work / f"p{i}"), "AGENT_BROWSER_NO_VERSION_CHECK": "1"}
    if os.geteuid() == 0:
        env["AGENT_BROWSER_ARGS"] = "--no-sandbox"
    t = time.perf_counter()
    subprocess.run([ab, "open", "about:blank"], env=env, check=True, capture_output=True, timeout=120)
    elapsed = time.perf_counter() - t
    subprocess.run([ab, "close"], env=env, capture_output=True, timeout=60)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10, help="runs held open for the RSS figure")
    ap.add_argument("--repeat", type=int, default=3, help="first/second-stage samples")
    args = ap.parse_args()
    ab, br = tools.find_agent_browser(), tools.find_browser()
    if not (ab.found and br.found):
        print("agent-browser or browser missing: run ./dev setup")
        return 1
    work = Path(tempfile.mkdtemp(prefix="sfg-bench-"))
    home = work / "home"
    daemon = subprocess.Popen([sys.executable, "-m", "cli.main", "start", "--home", str(home)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={"PATH": os.environ["PATH"], "HOME": str(work), "LANG": "C.UTF-8"})
    try:
        for line in iter(daemon.stdout.readline, b""):
            if line.strip() == b"sfguard: ready":
                break
        client = GuardClient(home, timeout=180)
        bare = [bare_launch(ab.path, br.path, work, i) for i in range(args.repeat)]
        first, second = [], []
        for i in range(args.repeat):
            run = f"bench-{i}"
            client.call("POST", "/v1/runs", {"run_id": run})
            body = {"attempt": 1, "browser": {"profile": f"p{i}", "headed": False, "allow_domains": []}}
            t = time.perf_counter()
            s, a = client.call("POST", f"/v1/runs/{run}/stages", {**body, "stage_id": "one"})
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            s2, _ = client.call("POST", f"/v1/runs/{run}/stages", {**body, "stage_id": "two"})
            second.append(time.perf_counter() - t)
            assert s == 200 and s2 == 200, a
            client.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})
        # N runs open at once, each with an anchor
        for i in range(args.runs):
            client.call("POST", "/v1/runs", {"run_id": f"open-{i}"})
            s, a = client.call("POST", f"/v1/runs/open-{i}/stages",
                               {"stage_id": "s", "attempt": 1,
                                "browser": {"profile": f"q{i}", "headed": False, "allow_domains": []}})
            assert s == 200, a
        guard = psutil.Process(daemon.pid)
        guard_rss = guard.memory_info().rss
        proxies = [c for c in guard.children(recursive=True) if "proxy" in " ".join(c.cmdline())]
        proxy_rss = sum(p.memory_info().rss for p in proxies)
        for i in range(args.runs):
            client.call("POST", f"/v1/runs/open-{i}/end", {"outcome": "succeeded"})
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(120)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    b, f, s = med(bare), med(first), med(second)
    print(f"{'measure':44} {'median':>10} {'ratio':>8}")
    print(f"{'bare agent-browser open (baseline)':44} {b*1000:8.0f}ms {1.0:8.2f}")
    print(f"{'first stage ready (proxy+unseal+anchor)':44} {f*1000:8.0f}ms {f/b:8.2f}   target <= 1.50")
    print(f"{'second stage ready (shared anchor)':44} {s*1000:8.0f}ms {s/b:8.2f}   target < 150 ms")
    print(f"{'guard daemon RSS with %d runs open' % args.runs:44} {guard_rss/2**20:8.1f}MB")
    print(f"{'its %d run proxies, RSS in all' % len(proxies):44} {proxy_rss/2**20:8.1f}MB "
          f"({proxy_rss/2**20/max(1, len(proxies)):.1f} MB each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
