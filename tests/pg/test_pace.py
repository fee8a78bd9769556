"""The sites' pace on one real PostgreSQL (supervisor/profiles/pg_pace.py): two guard hosts'
proxies together keep one profile's pace, as measured by the site's own counter.

Each "host" is a run proxy process started as the daemon starts one (`python -O -m
sfguard.supervisor.daemon.proxy_child`, its clients and the store's URL over stdin) with a pace
folder of its own; only the database is shared. Tolerance: GCRA lets `burst + window/interval`
requests through in any window; two more are allowed: one arrival on the window's edge, and one
sent late by the machine's scheduling and arriving beside the next (seen: 12 in one second at
10 a second with a load average of 11 on this 2-core VM), so windows are 2 s."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import pytest

from sfguard.policy.pace import Rate
from sfguard.supervisor.daemon.run_proxy import child_argv
from sfguard.supervisor.profiles.pg_pace import PgPaceStore
from sfguard.supervisor.profiles.pg_schema import migrate
from tests.pace_site import PaceSite, most_in
from tests.proxy.test_pacing import plain_get

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-pace-host-0123456789"


def migrated(url: str) -> str:
    import psycopg
    with psycopg.connect(url) as conn:
        migrate(conn)
    return url


@pytest.fixture
def site():
    s = PaceSite()
    yield s
    s.close()


R = Rate("requests", "s", 0.2, 1, "wait", 1.0, "r")
R3 = Rate("requests", "s", 0.2, 3, "wait", 1.0, "r3")
RF = Rate("requests", "s", 0.2, 1, "refuse", 1.0, "rf")


@pytest.mark.parametrize("limit,expect", [
    (R, [0, 0.2, 0.4, 0.6, 0.8, 1.0, "refused"]),     # waits in turn, refused past max_wait
    (R3, [0, 0, 0, 0.2, 0.4, 0.6, 0.8]),              # a burst of 3 at once
    (RF, [0, "refused", "refused"]),                   # over: refuse
])
async def test_the_database_counts_as_admit_does(pg_url, limit, expect):
    """The SQL function against policy.pace.admit's table: events at once on one counter
    (the database's clock moves a little between calls: 30 ms tolerance)."""
    store = PgPaceStore(migrated(pg_url))
    try:
        got = []
        for _ in expect:
            a = await store.take([("p:alice|requests|s", limit)])
            got.append("refused" if a.refused is not None else a.wait)
    finally:
        await store.close()
    for g, e in zip(got, expect, strict=True):
        assert (g == e) if isinstance(e, str) else (not isinstance(g, str) and abs(g - e) < 0.03), (got, expect)


async def test_an_edited_rate_and_other_profiles(pg_url):
    url = migrated(pg_url)
    a, b = PgPaceStore(url), PgPaceStore(url)
    try:
        slow = Rate("requests", "s", 10.0, 1, "refuse", 5.0, "slow")
        assert (await a.take([("p:alice|requests|s", slow)])).ok
        assert not (await b.take([("p:alice|requests|s", slow)])).ok      # the other host sees it
        assert (await b.take([("p:bob|requests|s", slow)])).ok            # another profile: its own
        fast = Rate("requests", "s", 0.001, 1, "wait", 5.0, "fast")      # an edit that loosens:
        after = await a.take([("p:alice|requests|s", fast)])              # one event of debt, at
        assert after.ok and after.wait < 0.01                             # the new interval
    finally:
        await a.close()
        await b.close()


def start_host(tmp: Path, name: str, policy: Path, log: Path, url: str | None) -> subprocess.Popen:
    argv = child_argv(0, policy, log, {"shop.test": "127.0.0.1"}, pace_dir=tmp / f"pace-{name}")
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdin is not None
    ready = proc.stdout.readline()
    assert ready.startswith("ready http://127.0.0.1:"), ready
    msg = {"id": 1, "clients": [{"name": "b-1", "token": TOKEN, "allow": ["*.shop.test"], "run": f"r-{name}",
                                 "pace_key": "p:local/alice"}]}
    if url:
        msg["pace_store"] = url
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"ack": 1}
    proc.port = int(ready.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    return proc


@pytest.mark.parametrize("shared,within", [(True, True), (False, False)])
async def test_two_hosts_share_a_profiles_pace(tmp_path, pg_url, site, shared, within):
    """Two hosts each send 20 requests of one profile at once to a site paced at 10 a second.
    With the shared store the site gets at most 1 + 20 (+2) in any 2 s (together within the
    pace); without it (the positive control: each host counts alone) about twice that."""
    url = migrated(pg_url)
    policy = tmp_path / "sites.yaml"
    policy.write_text(f"version: 1\nports: [80, 443, {site.port}]\nprivate_networks:\n  allow: [\"127.0.0.1/32\"]\n"
                      "pace:\n  - pattern: \"*.shop.test\"\n    reason: \"the shop locks fast accounts\"\n"
                      "    requests_per_minute: 600\n    max_wait_s: 10\n")
    hosts = [start_host(tmp_path, n, policy, tmp_path / f"decisions-{n}.log", url if shared else None)
             for n in ("one", "two")]
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(*(plain_get(h.port, f"http://shop.test:{site.port}/h/{i}", ("b-1", TOKEN))
                                         for h in hosts for i in range(20)))
        took = time.monotonic() - t0
    finally:
        for h in hosts:
            h.stdin.close()
            h.wait(20)
    assert [r[0] for r in results] == [200] * 40
    times = site.times("/h/")
    assert len(times) == 40
    if within:
        assert most_in(times, 2.0) <= 23 and took >= 3.5
    else:
        assert most_in(times, 2.0) >= 30
