"""What one OS user per browser adds to a stage's start and end (issue 50), measured directly.

    ./dev bench browser_pool_bench [--rounds 200]

A root guard's first stage of a run now also takes a browser user (a lock file and its mark;
a user a dead guard left is checked for processes too) and opens the run's folders to the
pool's uids (an ACL read, written once per folder); a browser's close gives the user back (a
scan of /proc for processes of that uid, the shared temp folders looked at, the mark
cleared). supervisor_bench measures the whole stage, whose spread on a loaded machine is
wider than these steps; this measures the steps alone, in this process, against users no
account has (nothing is created) and the processes this machine runs now. Prints the median
and the 95th percentile of each, in milliseconds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.supervisor.browsers.browser_pool import BrowserPool  # noqa: E402
from sfguard.supervisor.home import grant_traverse, open_for_traverse, revoke_traverse  # noqa: E402
from sfguard.supervisor.stage.sandbox import StageUser  # noqa: E402


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def show(name: str, ms: list[float]) -> None:
    ms = sorted(ms)
    print(f"{name:52} {statistics.median(ms):8.2f} {ms[int(len(ms) * 0.95) - 1]:8.2f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sfg-poolbench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        users = [StageUser(f"sfgb-user{i}", 4_200_000 + i, 4_200_000 + i) for i in range(16)]
        rt = work / "rt"
        (rt / "r-1").mkdir(parents=True)
        pool = BrowserPool(users, rt, work / "locks")
        take, give_back = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            user = pool.take("bench")
            t1 = time.perf_counter()
            assert user is not None
            pool.give_back(user)
            take.append((t1 - t0) * 1000)
            give_back.append((time.perf_counter() - t1) * 1000)
        grant_traverse(rt, [u.uid for u in users])
        acl_first, acl_again = [], []
        for i in range(args.rounds // 2):
            folder = rt / f"r-{i + 2}"
            folder.mkdir()
            acl_first += timed(lambda f=folder: open_for_traverse(f), 1)
            acl_again += timed(lambda f=folder: open_for_traverse(f), 1)
        revoke_traverse(rt)
        procs = sum(1 for e in os.scandir("/proc") if e.name.isdigit())
        print(f"{procs} processes on this machine, load {os.getloadavg()[0]:.1f}; ms: median, p95")
        show("take a browser user (lock, mark)", take)
        show("give it back (/proc scan, temp folders, mark)", give_back)
        show("open a new run folder to the pool (ACL written)", acl_first)
        show("an opened folder checked again (ACL read)", acl_again)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
