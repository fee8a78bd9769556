"""Load on the shared lease: 4 guard processes x 50 runs over 5 profiles.

Each process is a guard at the lease level (its own PgBackend: guard id, heartbeat, pool, and
PgProfileLease), serving its 50 runs from 5 client threads that ask and poll as the daemon
does. Whole daemons would add browsers and HTTP, nothing the lease sees. Every holder writes
"grant" and "release" lines (system-wide monotonic clock) to its own log; the test then checks
from those logs alone: each profile had at most one holder at any instant, grants per profile
came in queue order (FIFO, by the database's queued time) with growing fencing tokens, and
every run finished.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from itertools import pairwise

from tests.pg.conftest import ROOT

PROCS, RUNS, PROFILES, THREADS = 4, 50, 5, 5

CLIENT = r"""
import json, random, sys, threading, time
from sfguard.supervisor.profiles.pg_backend import PgBackend
from sfguard.supervisor.profiles.pg_lease import PgProfileLease
from sfguard.supervisor.protocols import Granted, ProfileKey

url, name, runs, profiles, threads, out = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), sys.argv[6]
backend = PgBackend(url, ttl=10, pool_size=threads + 1)
lease = PgProfileLease(backend)
rng = random.Random(name)
plan = [(f"{name}-run{i}", ProfileKey("local", f"p{rng.randrange(profiles)}")) for i in range(runs)]
lock = threading.Lock()
log = open(out, "w")

def write(**entry):
    with lock:
        log.write(json.dumps(entry) + "\n")
        log.flush()

def worker(items):
    for run, key in items:
        queued = None
        deadline = time.monotonic() + 300
        while True:
            got = lease.try_acquire(key, run)
            if isinstance(got, Granted):
                break
            queued = got.queued_since
            assert time.monotonic() < deadline, "never granted"
            time.sleep(0.005)
        token = backend.token(key)[1]
        write(ev="grant", run=run, profile=key.name, t=time.monotonic(), queued=queued, token=token)
        time.sleep(rng.uniform(0.002, 0.01))
        write(ev="release", run=run, profile=key.name, t=time.monotonic())
        h = lease.holder(key)
        assert lease.release(key, run), (run, key, h, backend.guard_id)

failures = []

def guarded(items):
    try:
        worker(items)
    except BaseException as exc:
        import traceback
        failures.append(traceback.format_exc())

ts = [threading.Thread(target=guarded, args=(plan[i::threads],)) for i in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
backend.close()
if failures:
    print("\n".join(failures), file=sys.stderr)
    sys.exit(1)
print("done", flush=True)
"""


def test_four_guards_fifty_runs_five_profiles(pg_url, tmp_path):
    procs = []
    for n in range(PROCS):
        out = tmp_path / f"guard{n}.jsonl"
        procs.append((out, subprocess.Popen(
            [sys.executable, "-c", CLIENT, pg_url, f"g{n}", str(RUNS), str(PROFILES), str(THREADS),
             str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for _out, p in procs:
        try:
            stdout, stderr = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        assert p.returncode == 0 and stdout.strip() == "done", stderr[-3000:]
    events = [json.loads(l) for out, _ in procs for l in out.read_text().splitlines()]
    grants = [e for e in events if e["ev"] == "grant"]
    releases = {e["run"]: e for e in events if e["ev"] == "release"}
    assert len(grants) == PROCS * RUNS and len(releases) == PROCS * RUNS   # all finished
    per_profile = defaultdict(list)
    for g in grants:
        per_profile[g["profile"]].append((g["t"], releases[g["run"]]["t"], g))
    assert len(per_profile) == PROFILES
    for profile, spans in per_profile.items():
        spans.sort(key=lambda s: s[0])
        for (_, end, a), (start, _, b) in pairwise(spans):
            assert start >= end, f"{profile}: {b['run']} granted while {a['run']} held it"
        tokens = [s[2]["token"] for s in spans]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), profile
        waited = [s[2]["queued"] for s in spans if s[2]["queued"] is not None]
        assert waited == sorted(waited), f"{profile}: grants out of queue order"
