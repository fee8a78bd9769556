"""The local lease across real processes: races, stress, and dead holders."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.protocols import Granted, ProfileKey
from tests.profiles.conftest import ROOT

RACE_SCRIPT = r"""
import sys, time
from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.protocols import ProfileKey
home, run, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
lease = LocalProfileLease(home)
while time.time() < start:
    time.sleep(0.0005)
got = lease.try_acquire(ProfileKey("local", "shop"), run)
print(type(got).__name__, flush=True)
sys.stdin.read()
"""

STRESS_SCRIPT = r"""
import os, random, sys, time
from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.protocols import Granted, ProfileKey
home, worker, runs, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lease = LocalProfileLease(home)
rnd = random.Random(worker)
keys = [ProfileKey("local", f"p{i}") for i in range(3)]
fd = os.open(log, os.O_WRONLY | os.O_APPEND)
deadline = time.monotonic() + 25
for i in range(runs):
    run, key = f"w{worker}-r{i}", rnd.choice(keys)
    while not isinstance(lease.try_acquire(key, run), Granted):
        if time.monotonic() > deadline:
            sys.exit(f"run {run} never served")
        time.sleep(rnd.uniform(0.0005, 0.003))
    os.write(fd, f"enter {key.name} {run}\n".encode())
    time.sleep(rnd.uniform(0, 0.002))
    os.write(fd, f"exit {key.name} {run}\n".encode())
    lease.release(key, run)
print("done", flush=True)
"""


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


def test_racing_processes_never_both_get_it(tmp_path):
    home = tmp_path / "home"
    LocalProfileLease(home)
    for round_ in range(3):
        start = time.time() + 1.0
        procs = [subprocess.Popen([sys.executable, "-c", RACE_SCRIPT, str(home), f"r{round_}-{i}", str(start)],
                                  cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in range(6)]
        try:
            results = Counter(p.stdout.readline().strip() for p in procs)
            assert results == {"Granted": 1, "Waiting": 5}
            lease = LocalProfileLease(home)
            holder = lease.holder(ProfileKey("local", "shop"))
            assert holder is not None and holder.owner.pid in {p.pid for p in procs}
            assert len(lease.queue(ProfileKey("local", "shop"))) == 5
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=10)
        # every racer is dead now: the next round starts from a clean, swept state
        swept = LocalProfileLease(home).sweep_stale()
        assert len(swept) == 1
        assert LocalProfileLease(home).queue(ProfileKey("local", "shop")) == []


def test_stress_200_runs_4_processes_3_profiles(tmp_path):
    home = tmp_path / "home"
    LocalProfileLease(home)
    log = tmp_path / "holders.log"
    log.touch()
    procs = [subprocess.Popen([sys.executable, "-c", STRESS_SCRIPT, str(home), str(w), "50", str(log)],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out.strip() == "done"
    holders: dict[str, str | None] = {}
    entered = set()
    for line in log.read_text().splitlines():
        what, key, run = line.split()
        if what == "enter":
            assert holders.get(key) is None, f"{run} entered {key} while {holders[key]} held it"
            holders[key] = run
            entered.add(run)
        else:
            assert holders.get(key) == run
            holders[key] = None
    assert len(entered) == 200                      # every run was served
    lease = LocalProfileLease(home)
    for i in range(3):
        assert lease.holder(ProfileKey("local", f"p{i}")) is None
        assert lease.queue(ProfileKey("local", f"p{i}")) == []


def test_lease_files_hold_holder_identity(tmp_path):
    home = tmp_path / "home"
    lease = LocalProfileLease(home)
    key = ProfileKey("local", "shop")
    assert isinstance(lease.try_acquire(key, "run-1"), Granted)
    data = json.loads((home / "leases" / "local" / "shop.lease").read_text())
    assert data["holder"]["run"] == "run-1"
    assert data["holder"]["pid"] == os.getpid()
    assert data["holder"]["pid_start_time"] > 0
    assert oct(os.stat(home / "leases" / "local" / "shop.lease").st_mode & 0o777) == "0o600"


def test_reused_pid_with_other_start_time_is_stale(tmp_path):
    """A recorded pid that now belongs to another process (different start time) is dead."""
    home = tmp_path / "home"
    from sfguard.supervisor.protocols import ProcessIdentity
    ghost = LocalProfileLease(home, owner=ProcessIdentity(os.getpid(), 12345.0))
    key = ProfileKey("local", "shop")
    assert isinstance(ghost.try_acquire(key, "run-ghost"), Granted)
    me = LocalProfileLease(home)
    assert me.sweep_stale() == [(key, "run-ghost")]
    assert isinstance(me.try_acquire(key, "run-2"), Granted)
