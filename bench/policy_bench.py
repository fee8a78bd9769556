"""Site policy benchmark: load time, memory and decision time against the number of block rules.

    .venv/bin/python bench/policy_bench.py [--sizes 1000,100000,1000000] [--lookups 100000]

For each size it writes a policy with that many block rules to a temp file (the grouped form,
`- reason: ... patterns: [...]`, which is how a big feed is written; half exact names, half
`*.` wildcards, plus a few CIDRs), then measures:

- load: wall and CPU time of `policy.load_policy(path)` and its peak traced memory (tracemalloc, in a
  separate pass so tracing does not slow the timed one) and the RSS growth of the process;
- decide: per-call time of `SitePolicy.decide(host, 443, allow)` over N lookups, a fixed mix of
  exact hits, wildcard hits on deep subdomains (up to 12 labels), misses, IP literals and
  malformed hosts, each timed alone with perf_counter_ns; median and p99.

It also loads the two largest sizes written as one `{pattern, reason}` mapping per entry, to
show what that form costs (at 1M entries that file is over the 64 MiB cap and is refused).
Targets: median decision < 10 us at 1M rules, 1M median within 2x of the 1k median, 1M load
< 5 s. Results print as a table; nothing is asserted.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from sfguard import policy  # noqa: E402


def blocked_name(i: int) -> str:
    return f"host{i}.block{i % 997}.example-feed.net"


def write_policy(path: Path, n: int, form: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("version: 1\nmode: enforce\nports: [80, 443]\n")
        fh.write('allow_always:\n  - "*.allowed-always.org"\n')
        fh.write('quiet:\n  - "*.google.com"\n')
        fh.write("block:\n")
        if form == "grouped":
            fh.write('  - reason: "benchmark feed"\n    patterns:\n')
            for i in range(n):
                name = blocked_name(i)
                fh.write(f'      - "*.{name}"\n' if i % 2 else f"      - {name}\n")
            fh.write('  - reason: "benchmark ranges"\n    patterns: ["198.18.0.0/15", "203.0.113.0/24"]\n')
        else:
            for i in range(n):
                name = blocked_name(i)
                pat = f'"*.{name}"' if i % 2 else name
                fh.write(f'  - {{pattern: {pat}, reason: "benchmark feed"}}\n')


def lookup_mix(n_rules: int, count: int, seed: int = 7) -> list[str]:
    rnd = random.Random(seed)
    hosts = []
    for k in range(count):
        i = rnd.randrange(n_rules)
        kind = k % 8
        if kind == 0:   # exact hit (even i is an exact rule)
            hosts.append(blocked_name(i - i % 2))
        elif kind == 1:  # wildcard hit, deep subdomain
            depth = rnd.randrange(1, 8)
            odd = i | 1 if (i | 1) < n_rules else 1
            hosts.append(".".join(f"l{d}" for d in range(depth)) + "." + blocked_name(odd))
        elif kind == 2:  # miss that shares a suffix
            hosts.append(f"other{i}.block{i % 997}.example-feed.net")
        elif kind == 3:  # allowed by the run
            hosts.append(f"a{i}.b.c.run-allowed.com")
        elif kind == 4:  # miss, deep
            hosts.append(".".join(f"x{d}" for d in range(10)) + f".nowhere{i}.com")
        elif kind == 5:  # IP literal in a blocked range / not
            hosts.append(f"198.18.{i % 256}.{k % 256}" if k % 2 else f"93.184.{i % 256}.{k % 256}")
        elif kind == 6:  # allow_always
            hosts.append(f"w{i}.allowed-always.org")
        else:            # upper case + trailing dot (normalisation work)
            hosts.append(blocked_name(i - i % 2).upper() + ".")
    return hosts


def time_decisions(p: policy.SitePolicy, hosts: list[str], allow: policy.RuleSet) -> tuple[float, float]:
    decide = p.decide
    clock = time.perf_counter_ns
    for h in hosts[:2000]:  # warm up
        decide(h, 443, allow)
    samples: list[int] = []
    append = samples.append
    for h in hosts:
        t0 = clock()
        decide(h, 443, allow)
        append(clock() - t0)
    samples.sort()
    median = statistics.median(samples) / 1000
    p99 = samples[int(len(samples) * 0.99)] / 1000
    return median, p99


def measure(n: int, lookups: int, tmp: Path, form: str = "grouped") -> dict:
    path = tmp / f"sites-{n}-{form}.yaml"
    write_policy(path, n, form)
    size_mb = path.stat().st_size / 1e6
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0, c0 = time.perf_counter(), time.process_time()
    p = policy.load_policy(path)
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_mb = (proc.memory_info().rss - rss0) / 1e6
    row = {"rules": n, "form": form, "file_mb": size_mb, "load_s": load_s, "load_cpu": load_cpu, "rss_mb": rss_mb,
           "block": len(p.block)}
    if lookups:
        allow = policy.compile_patterns(["*.run-allowed.com", "example.org"])
        row["median_us"], row["p99_us"] = time_decisions(p, lookup_mix(n, lookups), allow)
    del p
    gc.collect()
    tracemalloc.start()
    p = policy.load_policy(path)
    row["peak_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    del p
    gc.collect()
    path.unlink()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--lookups", type=int, default=100_000)
    ap.add_argument("--skip-mapping-form", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for n in sizes:
            rows.append(measure(n, args.lookups, tmp))
            print(f"  measured {n} rules", file=sys.stderr, flush=True)
        if not args.skip_mapping_form:
            for n in sorted(set(sizes))[-2:]:
                try:
                    rows.append(measure(n, 0, tmp, form="mapping"))
                except policy.PolicyError as exc:
                    notes.append(f"{n} rules, one mapping per entry: refused: {exc.issues[0].message}")
    base = rows[0]
    print(f"policy benchmark: python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}, {args.lookups} lookups per size")
    print(f"{'rules':>9} {'form':>8} {'file MB':>8} {'load s':>7} {'cpu s':>6} {'peak MB':>8} {'RSS+ MB':>8} "
          f"{'median us':>10} {'p99 us':>8} {'median/1st':>10}")
    for r in rows:
        med = f"{r['median_us']:.2f}" if "median_us" in r else "-"
        p99 = f"{r['p99_us']:.2f}" if "p99_us" in r else "-"
        ratio = f"{r['median_us'] / base['median_us']:.2f}x" if "median_us" in r else "-"
        print(f"{r['rules']:>9} {r['form']:>8} {r['file_mb']:>8.1f} {r['load_s']:>7.2f} {r['load_cpu']:>6.2f} "
              f"{r['peak_mb']:>8.0f} {r['rss_mb']:>8.0f} {med:>10} {p99:>8} {ratio:>10}")
    for note in notes:
        print(note)
    timed = [r for r in rows if "median_us" in r]
    big = timed[-1]
    print(f"targets: median at {big['rules']} rules {big['median_us']:.2f} us (< 10), "
          f"ratio {big['median_us'] / base['median_us']:.2f}x (< 2), load {big['load_s']:.2f} s (< 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
