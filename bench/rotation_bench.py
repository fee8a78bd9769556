"""Key rotation: how fast profiles are resealed, and what a rotation costs a run starting meanwhile.

    ./dev bench rotation_bench [--profiles 100] [--mb 4] [--repeat 3] [--skip-stage]

1. reseal: a local home (file keys, on the disk of the system temp folder) with N profiles of
   M MB each (random bytes: incompressible, a few large files and many small ones, as
   seal_bench shapes them); `rotation.rotate` reseals them all under a new key version
   (sealing.reseal: chunk by chunk, fsync, rename). Prints profiles/s and MB/s; the rotation
   runs --repeat times (a new version each time) and the median is shown.
2. first stage: a real `sfguard start` (real Chromium and agent-browser, as supervisor_bench)
   on a home holding the same N profiles. Each round measures the first stage of a new run
   (POST /v1/runs/{id}/stages -> 200 ready: lease, unseal, proxy, anchor launch, session) once
   with no rotation and once while a rotation started by `POST /v1/keys/rotate` reseals the N
   profiles; the two are interleaved so that load weighs on both alike, and a "during" sample
   counts only if the rotation was still running when the stage was ready. The run's profile
   is one the rotation would reach last (`zz-...`): it is leased by the run first and resealed
   at the run's end, as a profile in use is. Target: during / without <= 1.5.
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.supervisor.client.guard_client import GuardClient  # noqa: E402
from sfguard.supervisor.profiles import rotation  # noqa: E402
from sfguard.supervisor.profiles.audit import LocalAuditSink  # noqa: E402
from sfguard.supervisor.profiles.keys import FileKeyProvider  # noqa: E402
from sfguard.supervisor.profiles.lease import LocalProfileLease  # noqa: E402
from sfguard.supervisor.profiles.local_store import LocalProfileStore  # noqa: E402
from sfguard.supervisor.profiles.stores import Stores  # noqa: E402
from sfguard.supervisor.protocols import ProfileKey  # noqa: E402


def fill(folder: Path, mb: float) -> None:
    """~mb MB of random bytes: 70% in 1 MB files, 30% in 16 KB files."""
    (folder / "Default" / "IndexedDB").mkdir(parents=True, exist_ok=True)
    big = int(mb * 0.7 * (1 << 20))
    i = 0
    while big > 0:
        n = min(1 << 20, big)
        (folder / "Default" / f"blob_{i}.db").write_bytes(os.urandom(n))
        big -= n
        i += 1
    for j in range(int(mb * 0.3 * (1 << 20)) // (16 << 10)):
        (folder / "Default" / "IndexedDB" / f"{j:05d}.ldb").write_bytes(os.urandom(16 << 10))


def make_home(home: Path, runtime: Path, n: int, mb: float, extra: list[str]) -> Stores:
    keys = FileKeyProvider(home)
    stores = Stores("local", "local home", keys, LocalProfileStore(home, keys, runtime=runtime),
                    LocalProfileLease(home), LocalAuditSink(home, keys))
    for name in [f"p{i:04d}" for i in range(n)] + extra:
        key = ProfileKey("local", name)
        stores.store.create(key)
        stores.audit.record("profile_created", scope="local", profile=name)
        if name in extra:
            continue
        stores.lease.try_acquire(key, "fill")
        fill(stores.store.open(key), mb)
        stores.store.close(key)
        stores.lease.release(key, "fill")
    return stores


def reseal_rate(work: Path, n: int, mb: float, repeat: int) -> dict:
    stores = make_home(work / "reseal-home", work / "reseal-run", n, mb, [])
    secs = []
    for _ in range(repeat):
        t = time.perf_counter()
        report = rotation.rotate(stores)
        secs.append(time.perf_counter() - t)
        assert report["finished"] and len(report["resealed"]) == n, report
    med = statistics.median(secs)
    return {"profiles": n, "mb_each": mb, "seconds": secs, "profiles_per_s": n / med, "mb_per_s": n * mb / med}


def first_stage(client: GuardClient, run: str, profile: str) -> tuple[float, float]:
    """(how long the first stage took to be ready, when it was ready); the run stays open."""
    assert client.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    body = {"stage_id": "s1", "attempt": 1, "browser": {"profile": profile, "headed": False, "allow_domains": []}}
    t = time.perf_counter()
    st, answer = client.call("POST", f"/v1/runs/{run}/stages", body)
    ready = time.perf_counter()
    assert st == 200, answer
    return ready - t, ready


def end_run(client: GuardClient, run: str) -> None:
    assert client.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[0] == 200


def _rotate(client: GuardClient, done: list[float]) -> None:
    st, answer = client.call("POST", "/v1/keys/rotate")
    assert st == 200, answer
    done.append(time.perf_counter())


def stage_cost(work: Path, n: int, mb: float, repeat: int) -> dict:
    home = work / "guard-home"
    extra = [f"zz-{kind}-{i}" for i in range(repeat) for kind in ("without", "during")]
    make_home(home, work / "unused-run", n, mb, extra)
    env = {"PATH": os.environ["PATH"], "HOME": str(work), "LANG": "C.UTF-8", "SFGUARD_KEY_PROVIDER": "file"}
    daemon = subprocess.Popen([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(home)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert daemon.stdout is not None
    without, during, rotations, missed = [], [], [], 0
    try:
        for line in iter(daemon.stdout.readline, b""):
            if line.strip() == b"sfguard: ready":
                break
        client = GuardClient(home, timeout=600)
        first_stage(client, "warm-up", "zz-warm")       # the proxy pool and caches, once
        end_run(client, "warm-up")
        for i in range(repeat):
            took, _ready = first_stage(client, f"without-{i}", f"zz-without-{i}")
            without.append(took)
            end_run(client, f"without-{i}")
            done: list[float] = []
            t0 = time.perf_counter()
            rot = threading.Thread(target=_rotate, args=(client, done))
            rot.start()
            time.sleep(0.2)                               # the rotation is under way
            took, ready = first_stage(client, f"during-{i}", f"zz-during-{i}")
            rot.join()
            end_run(client, f"during-{i}")               # its profile follows the rotation now
            rotations.append(done[0] - t0)
            if done[0] > ready:
                during.append(took)
            else:
                missed += 1
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(120)
        except subprocess.TimeoutExpired:
            daemon.kill()
    return {"without": without, "during": during, "rotation_s": rotations, "not_overlapped": missed}


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.0f} [{min(values) * 1000:.0f}-{max(values) * 1000:.0f}]"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", type=int, default=100)
    ap.add_argument("--mb", type=float, default=4.0, help="MB of data in each profile")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-stage", action="store_true", help="only the reseal rate (no browser)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sfg-rotbench-"))
    try:
        rate = reseal_rate(work, args.profiles, args.mb, args.repeat)
        stage = None if args.skip_stage else stage_cost(work, args.profiles, args.mb, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"reseal": rate, "stage": stage}, indent=2))
        return 0
    print(f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}; {args.profiles} profiles of {args.mb:g} MB")
    print(f"reseal at rest: {rate['profiles_per_s']:.1f} profiles/s, {rate['mb_per_s']:.0f} MB/s "
          f"(rotation of all: {spread(rate['seconds'])} ms, median [min-max])")
    if stage is not None:
        w, d = stage["without"], stage["during"]
        ratio = statistics.median(d) / statistics.median(w) if d and w else float("nan")
        print(f"first stage ready, no rotation:     {spread(w)} ms")
        print(f"first stage ready, during rotation: {spread(d)} ms  (rotations took {spread(stage['rotation_s'])} ms; "
              f"{stage['not_overlapped']} sample(s) left out: the rotation ended first)")
        print(f"ratio during / without (medians): {ratio:.2f}   target <= 1.50: "
              f"{'met' if ratio <= 1.5 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
