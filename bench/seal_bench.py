"""Seal / unseal speed and peak memory against a plain `tar` copy, for 10, 50 and 200 MB.

Run: .venv/bin/python bench/seal_bench.py [--sizes 10,50,200] [--repeat 3]

Each measurement runs in its own child process, which reports wall time and its peak RSS
(resource.getrusage ru_maxrss; for the tar baseline, the peak RSS of the tar child). The
profile is a folder of random bytes (incompressible) shaped like a Chromium profile: a few
large files plus many small ones. Target: 50 MB sealed or unsealed in < 0.5 s, and peak
memory that does not grow with the profile size. Seal includes its fsync; tar does not.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KEY = bytes(range(32))


def make_profile(folder: Path, mb: int) -> None:
    """~mb MB: 70% in 4 MB files, 30% in 16 KB files across nested folders."""
    (folder / "Default" / "Local Storage" / "leveldb").mkdir(parents=True)
    big_total = int(mb * 0.7 * 1024 * 1024)
    i = 0
    while big_total > 0:
        n = min(4 << 20, big_total)
        (folder / "Default" / f"blob_{i}.db").write_bytes(os.urandom(n))
        big_total -= n
        i += 1
    small = int(mb * 0.3 * 1024 * 1024) // (16 << 10)
    for j in range(small):
        sub = folder / "Default" / "IndexedDB" / f"d{j % 20}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{j:06d}.ldb").write_bytes(os.urandom(16 << 10))


def child(case: str, src: str, dst: str) -> None:
    from sfguard.supervisor.profiles import sealing
    t0 = time.perf_counter()
    if case == "seal":
        sealing.seal_dir(Path(src), Path(dst), KEY, "local", "bench")
    elif case == "unseal":
        sealing.unseal_to(Path(src), Path(dst), KEY, "local", "bench")
    elif case in ("tar-c", "tar-x"):
        # Through GNU time: a child spawned by Python inherits Python's RSS high-water mark
        # in ru_maxrss, so RUSAGE_CHILDREN would not show tar's own peak.
        if case == "tar-c":
            argv = ["tar", "-cf", dst, "-C", src, "."]
        else:
            os.mkdir(dst)
            argv = ["tar", "-xf", src, "-C", dst]
        res = subprocess.run(["/usr/bin/time", "-f", "%M", *argv], capture_output=True, text=True, check=True)
        secs = time.perf_counter() - t0
        print(json.dumps({"secs": secs, "rss_mb": int(res.stderr.split()[-1]) / 1024}))
        return
    secs = time.perf_counter() - t0
    print(json.dumps({"secs": secs, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _is_tmpfs(path: Path) -> bool:
    best, fstype = "", ""
    with open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            if str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype == "tmpfs"


def measure(case: str, src: Path, dst: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", case, str(src), str(dst)],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,50,200")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="work folder (default: the system temp dir); "
                    "use a tmpfs such as /dev/shm to measure like the runtime dir")
    ap.add_argument("--child", nargs=3, metavar=("CASE", "SRC", "DST"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    idle = measure("idle", Path("/"), Path("/"))
    print(f"python child with sfguard.supervisor.profiles.sealing imported, doing nothing: {idle['rss_mb']:.1f} MB RSS")
    base = Path(tempfile.mkdtemp(prefix="sfg-bench-", dir=args.dir))
    print(f"work folder: {base} ({'tmpfs' if _is_tmpfs(base) else 'disk'})")
    print(f"{'size':>6} {'op':<7} {'sfguard s':>10} {'tar s':>8} {'ratio':>6} "
          f"{'MB/s':>7} {'sfguard RSS MB':>15} {'tar RSS MB':>11}")
    try:
        for mb in [int(x) for x in args.sizes.split(",")]:
            case = base / f"{mb}mb"
            src = case / "src"
            src.mkdir(parents=True)
            make_profile(src, mb)
            rows: dict[str, list[dict[str, Any]]] = {"seal": [], "tar-c": [], "unseal": [], "tar-x": []}
            for r in range(args.repeat):
                sealed, tarball = case / f"p{r}.sealed", case / f"p{r}.tar"
                rows["seal"].append(measure("seal", src, sealed))
                rows["tar-c"].append(measure("tar-c", src, tarball))
                rows["unseal"].append(measure("unseal", sealed, case / f"u{r}"))
                rows["tar-x"].append(measure("tar-x", tarball, case / f"t{r}"))
                for p in (sealed, tarball):
                    p.unlink()
                shutil.rmtree(case / f"u{r}")
                shutil.rmtree(case / f"t{r}")
            for op, ref in (("seal", "tar-c"), ("unseal", "tar-x")):
                s = min(x["secs"] for x in rows[op])
                t = min(x["secs"] for x in rows[ref])
                rss = max(x["rss_mb"] for x in rows[op])
                trss = max(x["rss_mb"] for x in rows[ref])
                print(f"{mb:>4}MB {op:<7} {s:>10.3f} {t:>8.3f} {s / t:>6.2f} {mb / s:>7.0f} "
                      f"{rss:>15.1f} {trss:>11.1f}")
            shutil.rmtree(case)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"(best of {args.repeat} runs; ratio = sfguard / tar; RSS = peak resident set of the "
          "measuring child: the Python interpreter for sfguard, tar itself for tar)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
