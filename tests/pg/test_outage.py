"""A database outage seen from two real guards (`sfguard start`, fake agent-browser and
Chromium) on a PostgreSQL server of this test's own, stopped with `pg_ctl stop -m fast` while
runs hold and wait for profiles, then started again.

While the database is away: both guards answer `status` within a bound (naming the store as
unreachable), the run holding a profile keeps it, a stage without a profile gets its browser
(gate and proxy need no database), a new grant waits and says why. The holder's run ends
during the outage with a login written into the profile. When the database is back, the run
waiting on the other guard gets the profile with that login, the run waiting for another
profile gets it too, and the audit chain verifies. The figures are printed (pytest -s).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.daemon.fake_cdp import FakeCdp
from tests.daemon.test_runs import stage, wait_ready
from tests.pg.conftest import ROOT, Guards
from tests.pg.test_guards import cookies, end_run, log_in, new_run

OUTAGE_TTL = 30.0       # seconds (the default): longer than the outage, the holder keeps its lease
STATUS_BOUND = 4.0      # seconds a `status` answer may take while the database is away
DOWN_FOR = 6.0          # seconds status is polled on both guards after the holder's run ended


@pytest.fixture
def server():
    from tests.pgserver import PgServer
    s = PgServer().start()
    yield s
    s.stop()


@pytest.fixture
def guards(tmp_path, server, key_file):
    cdp = FakeCdp()
    cdp.start()
    g = Guards(tmp_path, server.create_db(), key_file, cdp.url, ttl=OUTAGE_TTL)
    yield g
    g.close()
    cdp.stop()


def timed_status(d) -> tuple[dict, float]:
    t0 = time.monotonic()
    code, body = d.call("GET", "/v1/status")
    took = time.monotonic() - t0
    assert code == 200, body
    return body, took


def test_the_guards_answer_through_a_database_outage_and_lose_nothing(guards, server):
    g1, g2 = guards.start("g1"), guards.start("g2")
    new_run(g1, "r1")
    assert stage(g1, "r1", "s1")[0] == 200
    log_in(g1, b"sid=before-the-outage")
    new_run(g2, "r2")
    code, body = stage(g2, "r2", "s1")
    assert code == 202 and body["holder_run"] == "r1"

    server.pause()                                        # pg_ctl stop -m fast
    down = time.monotonic()
    took = []
    for d in (g1, g2):
        st, t = timed_status(d)
        took.append(t)
        assert st["guard"]["store_error"], st["guard"]     # says the store is away
        assert [r["run_id"] for r in st["runs"]] == (["r1"] if d is g1 else ["r2"])
    # the holder keeps its profile and its browser
    assert g1.call("GET", "/v1/runs/r1/stages/s1")[0] == 200
    # a stage without a profile gets a browser: gate and proxy need no database
    new_run(g1, "r4")
    code, body = stage(g1, "r4", "s1", profile=None)
    assert code == 200 and body["state"] == "ready", body
    # a new grant waits, and the answer says why
    new_run(g1, "r3")
    code, body = stage(g1, "r3", "s1", profile="other")
    assert code == 202 and body["reason"] == "store_unreachable", body
    assert "unreachable" in body["message"] and "asks again" in body["message"]
    assert g2.call("GET", "/v1/runs/r2/stages/s1")[0] == 202
    for method, route in (("GET", "/v1/profiles"), ("DELETE", "/v1/profiles/acct")):
        code, body = g2.call(method, route)
        assert code == 503 and body["error"]["code"] == "store_unreachable", (route, body)
    # the probes: alive, but not ready (it cannot grant a profile), and they say nothing more
    assert g2.call("GET", "/v1/health/live") == (200, {"status": "alive"})
    code, body = g2.call("GET", "/v1/health/ready")
    assert code == 503 and body["error"]["code"] == "not_ready" and "postgres" not in str(body).lower(), body
    # the holder's run ends in the outage: its login waits on its host
    log_in(g1, b"sid=written-during-the-outage")
    t0 = time.monotonic()
    ended = end_run(g1, "r1")
    end_took = time.monotonic() - t0
    assert ended["ok"] is False
    assert any("stored when the database is back" in p for p in ended["problems"]), ended
    polled = time.monotonic()
    while time.monotonic() - polled < DOWN_FOR:           # status polled through the outage
        took.append(timed_status(g1)[1])
        took.append(timed_status(g2)[1])
        time.sleep(0.2)
    assert max(took) < STATUS_BOUND, took
    assert g2.call("GET", "/v1/runs/r2/stages/s1")[0] == 202   # no grant while away
    outage = time.monotonic() - down

    server.resume()
    up = time.monotonic()
    ready = wait_ready(g2, "r2", "s1", timeout=60)
    grant_after = time.monotonic() - up
    assert ready["state"] == "ready"
    assert cookies(g2).read_bytes() == b"sid=written-during-the-outage"    # nothing lost
    assert wait_ready(g1, "r3", "s1", timeout=60)["state"] == "ready"
    st, _ = timed_status(g1)
    assert st["guard"]["store_error"] is None
    assert g1.call("GET", "/v1/health/ready") == (200, {"status": "ready"})
    assert {l["profile"]: l["holder_run"] for l in st["leases"]} == {"acct": "r2", "other": "r3"}
    for d, run in ((g2, "r2"), (g1, "r3"), (g1, "r4")):
        assert end_run(d, run)["ok"] is True

    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "show", "--json", "--profile",
                          "acct"], cwd=ROOT, env=guards.env(guards.tmp), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = [(r["event"], r["fields"].get("run"), r["fields"].get("outcome"))
            for r in map(json.loads, out.stdout.splitlines())]
    assert seen == [("profile_created", "r1", None), ("profile_leased", "r1", None),
                    ("profile_resealed", "r1", "late"), ("profile_released", "r1", "released_late"),
                    ("profile_leased", "r2", None), ("profile_resealed", "r2", "stored"),
                    ("profile_released", "r2", "succeeded")], seen
    verify = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "verify"], cwd=ROOT,
                            env=guards.env(guards.tmp), capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    print(f"\noutage {outage:.1f} s: status answered in at most {max(took):.2f} s "
          f"({len(took)} calls, median {sorted(took)[len(took) // 2]:.2f} s); the run's end "
          f"took {end_took:.2f} s; the waiting run was granted {grant_after:.1f} s after the "
          "database was back")


def test_a_hanging_database_does_not_block_the_guard(guards, server):
    """The database server is frozen (SIGSTOP of its processes, which this test started): its
    connections accept and never answer, so store calls hang rather than fail. The guard's
    event loop never waits on them: status answers within its bound, a stage without a
    profile gets its browser, the holder's stage answers; once the server runs again
    everything that waited completes."""
    import psutil
    g1 = guards.start("g1")
    new_run(g1, "r1")
    assert stage(g1, "r1", "s1")[0] == 200
    postmaster = psutil.Process(server.pid())
    frozen = [postmaster, *postmaster.children(recursive=True)]
    for p in frozen:
        p.suspend()
    try:
        took = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < DOWN_FOR:
            st, t = timed_status(g1)
            took.append(t)
            assert st["guard"]["store_error"], st["guard"]
        assert g1.call("GET", "/v1/runs/r1/stages/s1")[0] == 200
        new_run(g1, "r2")
        t1 = time.monotonic()
        code, body = stage(g1, "r2", "s1", profile=None)
        took_stage = time.monotonic() - t1
        assert code == 200 and body["state"] == "ready", body
        assert max(took) < STATUS_BOUND, took
    finally:
        for p in frozen:
            p.resume()
    deadline = time.monotonic() + 60
    while timed_status(g1)[0]["guard"]["store_error"] is not None:
        assert time.monotonic() < deadline, "the store did not answer again"
        time.sleep(0.5)
    st, _ = timed_status(g1)
    assert [(l["profile"], l["holder_run"]) for l in st["leases"]] == [("acct", "r1")]
    for run in ("r1", "r2"):
        assert end_run(g1, run)["ok"] is True
    print(f"\nfrozen database: status answered in at most {max(took):.2f} s ({len(took)} calls); "
          f"a stage without a profile was ready in {took_stage:.2f} s")
