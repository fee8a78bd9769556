"""Local home store vs the shared PostgreSQL store, measured in one run.

Run: ./dev bench store_bench [--leases 500] [--mb 50] [--repeat 3]

Starts a throw-away PostgreSQL (tests/pgserver.py: Debian's server binaries, unix socket,
fsync ON like the local store's own fsyncs) and measures on both stores:
  1. lease acquire + release (try_acquire granted, then release) of one profile: p50 / p99;
  2. seal + store of a 50 MB profile (`close(save=True)`: seal, write, for PostgreSQL stream
     the chunks into the database under the fencing check) and fetch + unseal (`open`);
     median of --repeat rounds;
  3. the process's peak RSS growth during the PostgreSQL rounds (the blob is streamed in
     1 MiB chunks, so this must stay far below the profile size).
Prints each figure and the ratio PostgreSQL / local.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.supervisor.profiles.keys import FileKeyProvider  # noqa: E402
from sfguard.supervisor.profiles.lease import LocalProfileLease  # noqa: E402
from sfguard.supervisor.profiles.local_store import LocalProfileStore  # noqa: E402
from sfguard.supervisor.profiles.pg_backend import PgBackend  # noqa: E402
from sfguard.supervisor.profiles.pg_keys import PgKeyProvider  # noqa: E402
from sfguard.supervisor.profiles.pg_lease import PgProfileLease  # noqa: E402
from sfguard.supervisor.profiles.pg_store import PgProfileStore  # noqa: E402
from sfguard.supervisor.protocols import Granted, ProfileKey  # noqa: E402
from tests.pgserver import PgServer  # noqa: E402

KEY = ProfileKey("local", "bench")


def make_profile(folder: Path, mb: int) -> None:
    """~mb MB of incompressible bytes: 70% in 4 MB files, 30% in 16 KB files."""
    big = int(mb * 0.7 * (1 << 20))
    i = 0
    while big > 0:
        n = min(4 << 20, big)
        (folder / "Default").mkdir(parents=True, exist_ok=True)
        (folder / "Default" / f"blob_{i}.db").write_bytes(os.urandom(n))
        big -= n
        i += 1
    small = int(mb * 0.3 * (1 << 20)) // (16 << 10)
    for j in range(small):
        d = folder / "Default" / "IndexedDB" / f"db{j % 20}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{j}.ldb").write_bytes(os.urandom(16 << 10))


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def lease_rounds(lease, n: int) -> list[float]:
    out = []
    for i in range(n):
        run = f"bench-{i}"
        t = time.perf_counter()
        got = lease.try_acquire(KEY, run)
        lease.release(KEY, run)
        out.append(time.perf_counter() - t)
        assert isinstance(got, Granted)
    return out


def store_rounds(store, lease, source: Path, repeat: int) -> tuple[list[float], list[float]]:
    """(seal+store times, fetch+unseal times)."""
    assert isinstance(lease.try_acquire(KEY, "bench-seal"), Granted)
    if not store.exists(KEY):
        store.create(KEY)
    seal, fetch = [], []
    for _ in range(repeat):
        work = store.open(KEY)
        shutil.rmtree(work)
        shutil.copytree(source, work)
        t = time.perf_counter()
        store.close(KEY, save=True)
        seal.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.open(KEY)
        fetch.append(time.perf_counter() - t)
        store.close(KEY, save=False)
    lease.release(KEY, "bench-seal")
    return seal, fetch


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leases", type=int, default=500)
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="store-bench-"))
    server = PgServer(fsync=True).start()
    backend = None
    try:
        source = tmp / "profile"
        make_profile(source, args.mb)
        backend = PgBackend(server.create_db(), ttl=30)
        pg_keys = PgKeyProvider(backend, os.urandom(32), "bench key")
        pg_store = PgProfileStore(backend, pg_keys, tmp / "pg-home", runtime=tmp / "pg-run")
        pg_lease = PgProfileLease(backend)
        home = tmp / "home"
        keys = FileKeyProvider(home)
        local_store = LocalProfileStore(home, keys, runtime=tmp / "run")
        local_lease = LocalProfileLease(home)

        # warm-up (connections, first files), then alternate the two stores
        lease_rounds(pg_lease, 20)
        lease_rounds(local_lease, 20)
        local_l, pg_l = [], []
        for _ in range(5):
            local_l += lease_rounds(local_lease, args.leases // 5)
            pg_l += lease_rounds(pg_lease, args.leases // 5)

        rss0 = peak_rss_mb()
        pg_seal, pg_fetch = store_rounds(pg_store, pg_lease, source, args.repeat)
        rss_pg = peak_rss_mb() - rss0
        local_seal, local_fetch = store_rounds(local_store, local_lease, source, args.repeat)
        size = pg_store.info(KEY).size / (1 << 20)

        ms = 1000.0
        print(f"store_bench: {args.leases} lease rounds per store, {args.mb} MB profile "
              f"(sealed {size:.1f} MB), {args.repeat} rounds; PostgreSQL "
              f"{server.bin.parent.name} on a unix socket, fsync on")
        print(f"{'':34}{'local':>12}{'PostgreSQL':>14}{'ratio':>9}")
        rows = [
            ("lease acquire+release p50 (ms)", statistics.median(local_l) * ms, statistics.median(pg_l) * ms),
            ("lease acquire+release p99 (ms)", pct(local_l, 99) * ms, pct(pg_l, 99) * ms),
            (f"seal+store {args.mb} MB median (s)", statistics.median(local_seal), statistics.median(pg_seal)),
            (f"fetch+unseal {args.mb} MB median (s)", statistics.median(local_fetch), statistics.median(pg_fetch)),
        ]
        for name, local, pg in rows:
            print(f"{name:34}{local:12.3f}{pg:14.3f}{pg / local:8.1f}x")
        print(f"peak RSS growth during the PostgreSQL rounds: {rss_pg:.0f} MB "
              f"(profile {args.mb} MB; chunks of 1 MiB are streamed)")
    finally:
        if backend is not None:
            backend.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
