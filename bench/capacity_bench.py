"""Capacity benchmark: how many runs one host holds, and what each run costs.

    ./dev bench capacity_bench [--levels 1,5,10,20] [--idle 10]
    SFGUARD_PROXIES=shared ./dev bench capacity_bench ...   (one proxy process for every run)
    SFGUARD_PROXY_ZYGOTE=0 ./dev bench capacity_bench ...   (each run's proxy its own process: the old way)

One guard (`sfguard start`, real Chromium and agent-browser, every browser as the browser user
with its sandbox on when run as root) and the fixture login site on 127.0.0.1. At each level N
the bench opens N runs at once, one after another: each run gets an anchor on a real profile of
its own and two stages, and each stage loads a page of the site (`agent-browser open`). With the
N runs open it measures, in the same run:

  first stage     POST .../stages -> ready for each run's first stage: median at this level,
                  and its ratio to the median at the first level (the baseline of this run)
  memory          PSS (proportional set size: pages shared between processes split between them,
                  so Chromium's processes are not counted many times) of every process of the
                  guard, by kind: browser (Chromium), proxy (the runs' proxies), agent_browser
                  (the stages' session daemons), guard (the daemon itself); per run = total / N
  guard's part    what the guard adds per run, browser excluded: (guard + proxy + agent_browser) / N
  idle CPU        the guard daemon's and its proxies' CPU over --idle seconds with N runs open
                  and nothing happening, in % of one core

Then every run is ended and the next level starts from none. Traffic only to 127.0.0.1. The
targets (issue #34): the guard's part at most 15 MB per run at 20 runs; first stage at 20 runs at
most 1.5x the 1-run figure. The figures are printed, not asserted: docs/reliability.md keeps them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.supervisor.browsers import tools  # noqa: E402
from sfguard.supervisor.client.guard_client import GuardClient  # noqa: E402
from sfguard.supervisor.daemon.metrics import process_kind  # noqa: E402
from sfguard.supervisor.daemon.proxy_zygote import ENV_SWITCH as ZYGOTE_SWITCH  # noqa: E402
from sfguard.supervisor.home import runtime_path  # noqa: E402

KINDS = ("browser", "proxy", "agent_browser", "guard")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kind_of(proc: psutil.Process, guard_pid: int) -> str | None:
    """The guard's own kinds (supervisor/daemon/metrics.py): guard, proxy, agent_browser, browser."""
    if proc.pid == guard_pid:
        return "guard"
    kind = process_kind(proc)
    return None if kind == "other" else kind


def guard_processes(guard_pid: int, marks: tuple[str, ...]) -> list[psutil.Process]:
    """The guard's tree, and processes that name its home or runtime folder in argv or env (the
    stages' agent-browser daemons detach from the CLI that started them)."""
    out: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(guard_pid)
        for p in [root, *root.children(recursive=True)]:
            out[p.pid] = p
    except psutil.Error:
        pass
    for p in psutil.process_iter(["cmdline"]):
        if p.pid in out:
            continue
        try:
            text = " ".join(p.info["cmdline"] or [])
            if any(m in text for m in marks):
                out[p.pid] = p
                continue
            env = p.environ()
        except psutil.Error:
            continue
        if any(m in env.get("AGENT_BROWSER_SOCKET_DIR", "") for m in marks):
            out[p.pid] = p
    return list(out.values())


def pss_by_kind(guard_pid: int, marks: tuple[str, ...]) -> dict[str, float]:
    sizes = dict.fromkeys(KINDS, 0.0)
    for p in guard_processes(guard_pid, marks):
        kind = kind_of(p, guard_pid)
        if kind is None:
            continue
        try:
            sizes[kind] += p.memory_full_info().pss
        except psutil.Error:
            continue
    return sizes


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def stage(ab: str, env: dict[str, str], *args: str) -> None:
    full = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env}
    subprocess.run([ab, *args], env=full, check=True, capture_output=True, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,5,10,20", help="numbers of concurrent runs, in order")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured per level")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if not levels or min(levels) < 1 or max(levels) > 64:
        print("--levels: numbers from 1 to 64")
        return 2
    ab, br = tools.find_agent_browser(), tools.find_browser()
    if not (ab.found and br.found and ab.path and br.path):
        print("agent-browser or browser missing: run ./dev setup")
        return 1
    work = Path(tempfile.mkdtemp(prefix="sfg-cap-"))
    os.chmod(work, 0o711)
    home = work / "home"
    port = free_port()
    site = subprocess.Popen([sys.executable, "-m", "sfguard.fixtures.login_server", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert site.stdout is not None
    assert site.stdout.readline().startswith(b"ready ")
    pol = work / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {port}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    daemon = subprocess.Popen([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(home),
                               "--policy", str(pol), "--resolve", "site.test=127.0.0.1", "--no-console"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={"PATH": os.environ["PATH"], "HOME": str(work), "LANG": "C.UTF-8",
                                   ZYGOTE_SWITCH: os.environ.get(ZYGOTE_SWITCH, "1"),
                                   "SFGUARD_PROXIES": os.environ.get("SFGUARD_PROXIES", "per-run")})
    assert daemon.stdout is not None
    results = []
    try:
        for line in iter(daemon.stdout.readline, b""):
            if line.strip() == b"sfguard: ready":
                break
        client = GuardClient(home, timeout=300)
        marks = (str(home), str(runtime_path(home)))
        url = f"http://site.test:{port}/"
        for level, n in enumerate(levels):
            first = []
            for i in range(n):
                run = f"cap-{level}-{i}"
                client.call("POST", "/v1/runs", {"run_id": run})
                body = {"attempt": 1, "browser": {"profile": f"p{i}", "headed": False,
                                                  "allow_domains": [f"site.test:{port}"]}}
                t = time.perf_counter()
                st, a = client.call("POST", f"/v1/runs/{run}/stages", {**body, "stage_id": "one"})
                first.append(time.perf_counter() - t)
                st2, a2 = client.call("POST", f"/v1/runs/{run}/stages", {**body, "stage_id": "two"})
                assert st == 200 and st2 == 200, (a, a2)
                stage(ab.path, a["env"], "open", url)
                stage(ab.path, a2["env"], "open", url)
            time.sleep(2)          # let start-up work settle before the idle figure
            sizes = pss_by_kind(daemon.pid, marks)
            tree = [p.pid for p in guard_processes(daemon.pid, marks)
                    if kind_of(p, daemon.pid) in ("guard", "proxy")]
            c0, t0 = cpu_seconds(tree), time.monotonic()
            time.sleep(args.idle)
            idle = (cpu_seconds(tree) - c0) / (time.monotonic() - t0) * 100
            results.append((n, statistics.median(first), sizes, idle))
            for i in range(n):
                client.call("POST", f"/v1/runs/cap-{level}-{i}/end", {"outcome": "succeeded"})
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(180)
        except subprocess.TimeoutExpired:
            daemon.kill()
        site.terminate()
        site.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    base = results[0][1]
    mb = 2 ** 20
    forked = os.environ.get(ZYGOTE_SWITCH, "1") != "0"
    print(f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}; memory is PSS in MB per run "
          "(total / runs); first stage: median ms and ratio to the first level; run proxies "
          + ("forked from the zygote" if forked else f"started as processes of their own ({ZYGOTE_SWITCH}=0)")
          + f"; proxies {os.environ.get('SFGUARD_PROXIES', 'per-run')} (SFGUARD_PROXIES)")
    print(f"{'runs':>5} {'first ms':>9} {'ratio':>6} {'browser':>8} {'proxy':>7} {'agent-br':>9} "
          f"{'guard':>7} {'ours/run':>9} {'idle CPU %':>11}")
    for n, f, sizes, idle in results:
        ours = (sizes["guard"] + sizes["proxy"] + sizes["agent_browser"]) / n
        print(f"{n:>5} {f*1000:>9.0f} {f/base:>6.2f} {sizes['browser']/n/mb:>8.1f} "
              f"{sizes['proxy']/n/mb:>7.1f} {sizes['agent_browser']/n/mb:>9.1f} {sizes['guard']/n/mb:>7.1f} "
              f"{ours/mb:>9.1f} {idle:>11.1f}")
    n, f, sizes, _ = results[-1]
    ours = (sizes["guard"] + sizes["proxy"] + sizes["agent_browser"]) / n / mb
    met = {True: "met", False: "NOT met"}
    print(f"targets at {n} runs: guard's part {ours:.1f} MB per run (<= 15: {met[ours <= 15]}); "
          f"first stage {f/base:.2f}x the {results[0][0]}-run figure (<= 1.5: {met[f / base <= 1.5]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
