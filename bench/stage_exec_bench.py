"""stage-exec benchmark: what confining a stage's command costs at start-up.

    ./dev bench stage_exec_bench [--samples 40]

Measured in one run, on this machine, against a baseline from the same run:
  baseline   bare `true` started by a subprocess (what a runner pays without stage-exec)
  python     the venv's Python starting and exiting (`python -c pass`): the floor of any Python CLI
  python -IS the same in isolated mode without site (`python -I -S -c pass`): the fast entry's floor
  bwrap      `bwrap <the sandbox's namespaces and mounts> true` alone (no bridges, no guard)
  sandbox    the stage's full bubblewrap argv (its mounts, the launcher starting both socat
             bridges and waiting until they listen) + `true`, started directly: the prefix
             without its Python (no fast entry, no API call)
  prefix     the API's `exec_prefix` + `true` for a ready throw-away stage of a real guard: the fast
             entry (`python -I -S cli/stage_exec_entry.py ...`; API call + sandbox + two socat
             bridges up + the command): what a runner pays
  console    the same through the `sfguard stage-exec` console script (site-packages start-up)
Target: p50(stage-exec) - p50(baseline) < 50 ms. Figures: p50, p90 and [min-max] over the samples.
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.cli.stage_exec_cmd import sandbox_argv  # noqa: E402
from sfguard.supervisor.client.guard_client import GuardClient  # noqa: E402
from sfguard.supervisor.stage import sandbox  # noqa: E402


def timed(argv, **kw) -> float:
    """Wall time of one run, start to exit. The wait blocks in waitpid: subprocess's wait with a
    timeout polls with doubling sleeps (1, 2, 4 ... 32, then 50 ms), which rounded every figure
    up to about 1, 3, 7, 15, 31, 63, 113 ms. A timer kills a run that hangs (the bound)."""
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, **kw)
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        code = proc.wait()
    finally:
        watchdog.cancel()
    elapsed = time.perf_counter() - t
    if code != 0:
        raise subprocess.CalledProcessError(code, argv)
    return elapsed


def p(values, q):
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=40)
    args = ap.parse_args()
    ok, detail = sandbox.probe(sandbox.ensure_stage_user() if os.geteuid() == 0 else None)
    if not ok:
        print(f"stage sandbox unavailable: {detail}")
        return 1
    work = Path(tempfile.mkdtemp(prefix="sfg-bench-"))
    home = work / "home"
    ws = Path(tempfile.mkdtemp(prefix="sfg-bench-ws-", dir="/tmp"))
    os.chmod(ws, 0o755)
    if os.geteuid() == 0:
        user = sandbox.ensure_stage_user()
        os.chown(ws, user.uid, user.gid)
    env = {"PATH": os.environ["PATH"], "HOME": str(work), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    sfguard = shutil.which("sfguard", path=str(Path(sys.executable).parent)) or "sfguard"
    guard = subprocess.Popen([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(home)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert guard.stdout is not None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = guard.stdout.readline()
            if not line or line.strip() == b"sfguard: ready":
                break
        client = GuardClient(home)
        client.call("POST", "/v1/runs", {"run_id": "bench"})
        status, answer = client.call("POST", "/v1/runs/bench/stages", {
            "stage_id": "s1", "attempt": 1, "browser": {"headed": False, "allow_domains": ["example.com"]}})
        if status != 200:
            print(f"stage not ready: {answer}")
            return 1
        prefix = answer["exec_prefix"]
        console = [sfguard, "stage-exec", "--home", str(home), "--run", "bench", "--stage", "s1", "--"]
        bw = [sandbox.find_bwrap(), *sandbox.BASE_ARGS, "--", "/bin/true"]
        kw = {"cwd": ws, "env": env}
        bw_kw = dict(kw)
        if os.geteuid() == 0:
            user = sandbox.ensure_stage_user()
            bw_kw.update(user=user.uid, group=user.gid, extra_groups=[])
        status, exec_answer = client.call("GET", "/v1/runs/bench/stages/s1/exec")
        if status != 200:
            print(f"no exec answer: {exec_answer}")
            return 1
        # what stage-exec hides for this runner (its HOME is `work`, no XDG_RUNTIME_DIR)
        hide = list(exec_answer["hide"]) + ["/run", "/dev/shm", str(work)]
        bwrap_path = sandbox.find_bwrap() or "bwrap"

        def timed_sandbox() -> float:
            r, w = os.pipe()  # the pinned config, read by bubblewrap as stage-exec's is
            os.write(w, b"{}\n")
            os.close(w)
            try:
                argv = sandbox_argv(bwrap_path, exec_answer, str(ws), hide, r, ["true"])
                return timed(argv, pass_fds=(r,), **bw_kw)
            finally:
                os.close(r)

        py = [sys.executable, "-c", "pass"]
        py_is = [sys.executable, "-I", "-S", "-c", "pass"]
        for _ in range(3):  # warm caches
            timed(["/bin/true"], **kw), timed(py, **kw), timed(bw, **bw_kw), timed(prefix + ["true"], **kw)
            timed(console + ["true"], **kw), timed(py_is, **kw), timed_sandbox()
        base, pyt, pyis, bwrap, sbx, se, cons = [], [], [], [], [], [], []
        for _ in range(args.samples):  # interleaved, so load drifts hit all alike
            base.append(timed(["/bin/true"], **kw))
            pyt.append(timed(py, **kw))
            pyis.append(timed(py_is, **kw))
            bwrap.append(timed(bw, **bw_kw))
            sbx.append(timed_sandbox())
            se.append(timed(prefix + ["true"], **kw))
            cons.append(timed(console + ["true"], **kw))
        client.call("POST", "/v1/runs/bench/end", {"outcome": "succeeded"})
    finally:
        guard.send_signal(signal.SIGTERM)
        try:
            guard.wait(60)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait(10)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ws, ignore_errors=True)
    b50 = statistics.median(base) * 1000
    who = "root (stage dropped to sfguard-stage)" if os.geteuid() == 0 else "user"
    print(f"samples {args.samples}, cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, as {who}")
    for name, v in (("baseline   true", base), ("python     -c pass", pyt), ("python -IS -c pass", pyis),
                    ("bwrap      sandbox + true", bwrap), ("sandbox    + bridges + true", sbx),
                    ("prefix     exec_prefix true", se),
                    ("console    sfguard ... true", cons)):
        m = statistics.median(v) * 1000
        print(f"{name:28} p50 {m:7.1f} ms  p90 {p(v, 90) * 1000:7.1f} ms  "
              f"[{min(v) * 1000:.1f}-{max(v) * 1000:.1f}]  ({m / b50:5.1f}x baseline)")
    s50 = statistics.median(se) * 1000
    overhead = s50 - b50
    print(f"stage-exec start-up overhead, exec_prefix (p50 minus baseline p50): {overhead:.1f} ms "
          f"(target < 50 ms: {'met' if overhead < 50 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
