"""Supervisor benchmark: how long a stage waits for its browser, and what the guard costs.

    ./dev bench supervisor_bench [--runs 10] [--repeat 3]

Measured in one run, on this machine, against a baseline of the same browser (each round
measures the baseline, then the first and second stage, so that load weighs on both alike):
  baseline   bare `agent-browser open about:blank` in a new session (browser launch), then close.
             As root there are two: agent-browser's own way as root (`--no-sandbox`: Chromium
             refuses to start its sandbox as root) and, the baseline of the targets, the same
             command as one of the guard's browser users with Chromium's sandbox on (taken from
             its pool and locked for the bench, so no guard runs a browser as it meanwhile): the
             guard runs every browser that way, each as a user of its own (issues 13 and 50),
             and the sandbox's start-up cost (~0.2 s here: zygote and namespaces per process)
             is the browser's, not the guard's. Run as an
             ordinary user, both are the same launch and only one is measured.
  first      POST /v1/runs/{id}/stages -> 200 ready for the first stage of a run
             (per-run proxy start + lease + unseal + anchor launch through the proxy + gate token
             + the stage's session: its tab pinned, stream server off)
  second     the same for a second stage of the same run, requested as soon as the first is
             ready (the anchor is shared; its session was started ahead, see
             supervisor/daemon/stage_sessions.py)
"Ready" is checked after both answers (outside the timed part, so that it cannot give a spare
still starting more time): the gate URL answers with the stage's token, the stage's session
daemon runs with its stream server off, and its pinned tab is in the browser (`agent-browser
tab list` with the stage's env, through the gate).
  rss        the guard daemon's own RSS, and its proxies' RSS, with N runs open, each with an anchor
Targets: second stage ready < 150 ms; first stage within 1.5x of the bare launch (the
sandboxed one; the ratio to the root launch without a sandbox is printed beside it).
With SFGUARD_BENCH_LOG=FILE the guard's log goes to FILE: one line per stage, "stage R/S ready
in N ms (lease a, browser b, session c)", says where a first stage's time goes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.supervisor.browsers import browser_pool, tools  # noqa: E402
from sfguard.supervisor.client.guard_client import GuardClient  # noqa: E402
from sfguard.supervisor.home import runtime_path  # noqa: E402
from sfguard.supervisor.stage.sandbox import StageUser  # noqa: E402


def bare_launch(ab: str, browser: str, work: Path, i: int, user: StageUser | None = None) -> float:
    """`agent-browser open about:blank` in a fresh session and profile, then `close`; seconds
    to the answer of `open`. `user`: run as that user (Chromium's sandbox on); else as this
    process (as root, with `--no-sandbox`, agent-browser's only way as root)."""
    top = work / (f"u{i}" if user else f"r{i}")
    top.mkdir(mode=0o700)
    if user is not None:
        os.chown(top, user.uid, user.gid)
    env = {"PATH": os.environ["PATH"], "HOME": str(top), "AGENT_BROWSER_SESSION": f"bench{i}",
           "AGENT_BROWSER_SOCKET_DIR": str(top / "s"), "AGENT_BROWSER_EXECUTABLE_PATH": browser,
           "AGENT_BROWSER_PROFILE": str(top / "p"), "AGENT_BROWSER_NO_VERSION_CHECK": "1"}
    if os.geteuid() == 0 and user is None:
        env["AGENT_BROWSER_ARGS"] = "--no-sandbox"
    who = {"user": user.uid, "group": user.gid, "extra_groups": []} if user else {}
    t = time.perf_counter()
    subprocess.run([ab, "open", "about:blank"], env=env, check=True, capture_output=True,
                   timeout=120, cwd=top, **who)
    elapsed = time.perf_counter() - t
    subprocess.run([ab, "close"], env=env, capture_output=True, timeout=60, cwd=top, **who)
    settle(str(top / "p"))
    return elapsed


def settle(needle: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until no browser process naming `needle` (a profile, or the guard's
    runtime folder) is left, so that a browser's shutdown does not weigh on the next measurement (the
    bare one's on the guard's stages, the guard's on the next bare launch)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = False
        for proc in psutil.process_iter(["name", "cmdline"]):
            try:
                if "chrom" in (proc.info["name"] or "") and \
                        any(needle in a for a in proc.info["cmdline"] or ()):
                    left = True
                    break
            except psutil.Error:
                continue
        if not left:
            return
        time.sleep(0.05)


def check_ready(ab: str, env: dict[str, str], work: Path) -> None:
    """The stage is usable: gate answers, session daemon up with stream off, pinned tab there."""
    gate = env["AGENT_BROWSER_CDP"].replace("ws://", "http://", 1) + "/json/version"
    with urllib.request.urlopen(gate, timeout=10) as res:
        assert res.status == 200, res.status
    sock, session = Path(env["AGENT_BROWSER_SOCKET_DIR"]), env["AGENT_BROWSER_SESSION"]
    pid = int((sock / f"{session}.pid").read_text())
    assert psutil.pid_exists(pid), "the stage's session daemon is not running"
    assert not (sock / f"{session}.stream").exists(), "the stage's stream server is on"
    target = json.loads((sock / f"{session}.target").read_text())
    assert target.get("pinned") is True, target
    out = subprocess.run([ab, "--json", "tab", "list"], env={"PATH": os.environ["PATH"],
                         "HOME": str(work), **env}, capture_output=True, text=True, timeout=60)
    tabs = json.loads(out.stdout)["data"]["tabs"]
    assert target["targetId"] in {t["targetId"] for t in tabs}, "the stage's tab is not in the browser"


def spread(values: list[float]) -> str:
    """median [min-max] in ms"""
    return (f"{statistics.median(values)*1000:.0f} [{min(values)*1000:.0f}-"
            f"{max(values)*1000:.0f}]")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10, help="runs held open for the RSS figure")
    ap.add_argument("--repeat", type=int, default=3, help="first/second-stage samples")
    args = ap.parse_args()
    ab, br = tools.find_agent_browser(), tools.find_browser()
    ab_path, br_path = ab.path, br.path
    if not (ab.found and br.found and ab_path and br_path):
        print("agent-browser or browser missing: run ./dev setup")
        return 1
    work = Path(tempfile.mkdtemp(prefix="sfg-bench-"))
    home = work / "home"
    # the guard's log (stage start-up breakdowns: "stage R/S ready in N ms (lease, browser,
    # session)") is kept when SFGUARD_BENCH_LOG names a file
    log_path = os.environ.get("SFGUARD_BENCH_LOG")
    log_fh = open(log_path, "ab") if log_path else subprocess.DEVNULL
    daemon = subprocess.Popen([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(home)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=log_fh,
                              env={"PATH": os.environ["PATH"], "HOME": str(work), "LANG": "C.UTF-8"})
    assert daemon.stdout is not None
    try:
        for line in iter(daemon.stdout.readline, b""):
            if line.strip() == b"sfguard: ready":
                break
        client = GuardClient(home, timeout=180)
        # as root, the guard has made its browser users by now: the baseline runs as one of
        # them, locked for the bench
        pool = browser_pool.BrowserPool(browser_pool.ensure_users(browser_pool.PoolConfig(), create=False),
                                        work) if os.geteuid() == 0 else None
        user = pool.take("supervisor_bench baseline") if pool is not None else None
        if pool is not None and user is None:
            raise SystemExit("every browser user is in use: the baseline has none to run as")
        if user is not None:
            os.chmod(work, 0o711)   # the browser user crosses into its own folder, no further
        bare, bare_root, first, second = [], [], [], []
        for i in range(args.repeat):
            # each round: the baseline(s), then the guard's two stages (interleaved, so that
            # load that comes and goes on a shared machine weighs on both sides alike)
            if user is not None:
                bare_root.append(bare_launch(ab_path, br_path, work, i))
            bare.append(bare_launch(ab_path, br_path, work, i, user))
            run = f"bench-{i}"
            client.call("POST", "/v1/runs", {"run_id": run})
            body = {"attempt": 1, "browser": {"profile": f"p{i}", "headed": False, "allow_domains": []}}
            t = time.perf_counter()
            st, a = client.call("POST", f"/v1/runs/{run}/stages", {**body, "stage_id": "one"})
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            st2, a2 = client.call("POST", f"/v1/runs/{run}/stages", {**body, "stage_id": "two"})
            second.append(time.perf_counter() - t)
            assert st == 200 and st2 == 200, (a, a2)
            check_ready(ab_path, a["env"], work)
            check_ready(ab_path, a2["env"], work)
            client.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})
            settle(runtime_path(home).name)   # the guard's browsers: profiles in its runtime dir
        # N runs open at once, each with an anchor
        for i in range(args.runs):
            client.call("POST", "/v1/runs", {"run_id": f"open-{i}"})
            st, a = client.call("POST", f"/v1/runs/open-{i}/stages",
                                {"stage_id": "s", "attempt": 1,
                                 "browser": {"profile": f"q{i}", "headed": False, "allow_domains": []}})
            assert st == 200, a
        guard = psutil.Process(daemon.pid)
        guard_rss = guard.memory_info().rss
        proxies, proxy_rss = [], 0
        for c in guard.children(recursive=True):
            try:   # a child may end while it is looked at (a session's short-lived CLI)
                if "sfguard.supervisor.daemon.proxy_child" in c.cmdline():
                    proxy_rss += c.memory_info().rss
                    proxies.append(c)
            except psutil.Error:
                continue
        for i in range(args.runs):
            client.call("POST", f"/v1/runs/open-{i}/end", {"outcome": "succeeded"})
        if pool is not None and user is not None:
            pool.give_back(user)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(120)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    b, f, s = med(bare), med(first), med(second)
    print(f"{args.repeat} rounds, cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}; "
          "ms: median [min-max]; ratio of medians to the baseline")
    print(f"{'measure':44} {'ms':>20} {'ratio':>7}")
    if bare_root:
        r = med(bare_root)
        print(f"{'bare agent-browser open, root, no sandbox':44} {spread(bare_root):>20} {r/b:7.2f}")
        print(f"{'bare agent-browser open, sandbox (baseline)':44} {spread(bare):>20} {1.0:7.2f}")
    else:
        print(f"{'bare agent-browser open (baseline)':44} {spread(bare):>20} {1.0:7.2f}")
    print(f"{'first stage ready (proxy+unseal+anchor)':44} {spread(first):>20} {f/b:7.2f}"
          f"   target <= 1.50: {'met' if f / b <= 1.5 else 'NOT met'}")
    if bare_root:
        print(f"{'  the same, to the root launch (no sandbox)':44} {'':>20} {f/med(bare_root):7.2f}")
    print(f"{'second stage ready (shared anchor)':44} {spread(second):>20} {s/b:7.2f}"
          f"   target < 150 ms: {'met' if s < 0.150 else 'NOT met'}")
    print(f"{f'guard daemon RSS with {args.runs} runs open':44} {guard_rss/2**20:8.1f}MB")
    print(f"{f'its {len(proxies)} run proxies, RSS in all':44} {proxy_rss/2**20:8.1f}MB "
          f"({proxy_rss/2**20/max(1, len(proxies)):.1f} MB each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
