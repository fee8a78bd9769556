"""Audit records commit with the change they record, on the PostgreSQL store.

A trigger in the test database refuses every insert into the audit table: each state change
that writes an audit record (create, grant, release, reseal, delete, a holder dropped after
its TTL) must then fail as a whole and leave the database exactly as it was. Without the
trigger the same change goes through with its record. Then two guard processes' worth of
changes, interleaved from threads, leave a chain `sfguard audit verify` accepts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psycopg
import pytest

from sfguard.supervisor.profiles.pg_backend import PgBackend, StoreRefused
from sfguard.supervisor.profiles.pg_lease import PgProfileLease
from sfguard.supervisor.protocols import Granted, ProfileKey, Waiting
from tests.pg.conftest import ROOT
from tests.pg.test_pg_store import Host

P = ProfileKey("local", "shop")
Q = ProfileKey("local", "other")

REFUSE = """
CREATE FUNCTION sfguard_test_refuse() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'audit append refused by the test'; END $$;
CREATE TRIGGER sfguard_test_refuse BEFORE INSERT ON sfguard_audit
  FOR EACH ROW EXECUTE FUNCTION sfguard_test_refuse();
"""
ALLOW = "DROP TRIGGER sfguard_test_refuse ON sfguard_audit; DROP FUNCTION sfguard_test_refuse();"


def sql(url, text, args=()):
    with psycopg.connect(url) as conn:
        cur = conn.execute(text, args)
        return cur.fetchall() if cur.description else None


def snapshot(url) -> dict:
    """Everything a change could touch (guard rows and heartbeats excepted)."""
    return {
        "profiles": sql(url, "SELECT scope, name, identity, size, blob_id, updated, last_used, "
                             "written_generation FROM sfguard_profiles ORDER BY scope, name"),
        "chunks": sql(url, "SELECT blob_id, idx, md5(data) FROM sfguard_blob_chunks "
                           "ORDER BY blob_id, idx"),
        "leases": sql(url, "SELECT scope, name, holder_run, holder_guard, generation FROM "
                           "sfguard_leases ORDER BY scope, name"),
        "queue": sql(url, "SELECT scope, name, run, guard_id FROM sfguard_queue ORDER BY seq"),
        "audit": sql(url, "SELECT seq, body FROM sfguard_audit ORDER BY seq"),
        "head": sql(url, "SELECT seq, hash, mac FROM sfguard_audit_head"),
    }


def events(url) -> list[tuple[str, dict]]:
    return [(json.loads(b)["event"], json.loads(b)["fields"])
            for (b,) in sql(url, "SELECT body FROM sfguard_audit ORDER BY seq")]


@pytest.fixture
def host(pg_url, tmp_path):
    made = []

    def make(name, ttl=30.0):
        h = Host(pg_url, tmp_path, name, MASTER, ttl)
        made.append(h)
        return h
    yield make
    for h in made:
        h.backend.close()


MASTER = os.urandom(32)


# Each case: (setup on host a, the change, what the change audits, its check once it went through)
def _setup_none(a, url):
    pass


def _setup_created(a, url):
    a.store.create(P)


def _setup_held(a, url):
    a.store.create(P)
    assert isinstance(a.lease.try_acquire(P, "r1"), Granted)


def _setup_open(a, url):
    _setup_held(a, url)
    (a.store.open(P) / "Cookies").write_bytes(b"sid=changed-in-the-run")


def _setup_dead_holder(a, url):
    """P held by run rx of a guard that stopped beating (its TTL is over)."""
    a.store.create(P)
    dead = PgBackend(url, ttl=0.5, heartbeat=False)
    try:
        assert isinstance(PgProfileLease(dead).try_acquire(P, "rx"), Granted)
    finally:
        dead.pool.close()         # its rows stay, as after a kill -9 of its guard
    time.sleep(1.0)


CASES = {
    "create": (_setup_none, lambda a: a.store.create(Q, "pipeline-0123456789abcdef",
                                                     note={"run": "r1"}),
               ("profile_created", {"scope": "local", "profile": "other", "run": "r1"}),
               lambda a: a.store.info(Q).identity == "pipeline-0123456789abcdef"),
    "grant": (_setup_created, lambda a: a.lease.try_acquire(P, "r1"),
              ("profile_leased", {"scope": "local", "profile": "shop", "run": "r1"}),
              lambda a: a.lease.holder(P).run == "r1"),
    "release": (_setup_held, lambda a: a.lease.release_all("r1", outcome="succeeded"),
                ("profile_released", {"scope": "local", "profile": "shop", "run": "r1",
                                      "outcome": "succeeded"}),
                lambda a: a.lease.holder(P) is None),
    "reseal": (_setup_open, lambda a: a.store.save(P),
               ("profile_resealed", {"scope": "local", "profile": "shop", "run": "r1",
                                     "outcome": "stored"}),
               lambda a: a.store.info(P).last_used is not None),
    "delete": (_setup_created, lambda a: a.store.delete(P, note={"by": "cli"}),
               ("profile_deleted", {"scope": "local", "profile": "shop", "by": "cli"}),
               lambda a: not a.store.exists(P)),
    "ttl expiry": (_setup_dead_holder, lambda a: a.lease.try_acquire(P, "r2"),
                   ("profile_released", {"scope": "local", "profile": "shop", "run": "rx",
                                         "outcome": "expired"}),
                   lambda a: a.lease.holder(P).run == "r2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_audit_append_leaves_no_state_change(pg_url, host, case):
    setup, change, record, done = CASES[case]
    a = host("a")
    setup(a, pg_url)
    before = snapshot(pg_url)
    sql(pg_url, REFUSE)
    with pytest.raises(StoreRefused) as err:
        change(a)
    assert "refused the change" in str(err.value) and "SQLSTATE P0001" in str(err.value)
    assert snapshot(pg_url) == before              # nothing of the change, nothing of the record
    assert a.audit.verify().ok
    sql(pg_url, ALLOW)
    result = change(a)                             # the same change, now with its record
    assert not isinstance(result, Waiting)
    assert done(a)
    assert record in events(pg_url)
    assert a.audit.verify().ok


def test_a_refused_reseal_keeps_the_stored_login(pg_url, host):
    """The reseal case seen from the next holder: the previous sealed state is still there."""
    a = host("a")
    a.store.create(P)
    assert isinstance(a.lease.try_acquire(P, "r1"), Granted)
    (a.store.open(P) / "Cookies").write_bytes(b"sid=stored")
    a.store.close(P)
    (a.store.open(P) / "Cookies").write_bytes(b"sid=never-audited")
    sql(pg_url, REFUSE)
    with pytest.raises(StoreRefused):
        a.store.close(P)                          # the working copy goes, the store keeps its state
    sql(pg_url, ALLOW)
    assert (a.store.open(P) / "Cookies").read_bytes() == b"sid=stored"
    a.store.close(P, save=False)


def test_changes_of_two_guards_interleaved_keep_one_valid_chain(pg_url, host, tmp_path):
    """Two guard processes' seams (threads here) lease, reseal, release, create and delete at
    the same time; every change has exactly its record and `sfguard audit verify` accepts the
    chain, read through the CLI as an operator would."""
    guards = [host("a"), host("b")]
    keys = [ProfileKey("local", f"p{i}") for i in range(3)]
    for key in keys:
        guards[0].store.create(key)
    errors: list[BaseException] = []

    def worker(g, tag):
        try:
            for i in range(12):
                key = keys[i % 3]
                run = f"{tag}-{i}"
                deadline = time.monotonic() + 30
                while not isinstance(g.lease.try_acquire(key, run), Granted):
                    assert time.monotonic() < deadline, "no grant within 30 s"
                    time.sleep(0.01)
                (g.store.open(key) / "Cookies").write_bytes(run.encode())
                g.store.close(key)
                if i == 7:                     # delete and make anew while holding it
                    g.store.delete(key, note={"by": "api"})
                    g.store.create(key, note={"run": run})
                g.lease.release_all(run, outcome="succeeded")
        except BaseException as exc:           # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(g, t)) for g, t in zip(guards, "ab", strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    evs = events(pg_url)
    count = lambda name: sum(1 for e, _ in evs if e == name)   # noqa: E731
    assert count("profile_leased") == count("profile_released") == 24
    assert count("profile_resealed") == 24
    assert count("profile_deleted") == 2 and count("profile_created") == 5
    # per profile: grants and releases alternate, each release by the run granted before it
    for key in keys:
        holder = None
        for e, f in evs:
            if f.get("profile") != key.name or e not in ("profile_leased", "profile_released"):
                continue
            if e == "profile_leased":
                assert holder is None, (key, f)
                holder = f["run"]
            else:
                assert holder == f["run"], (key, f)
                holder = None
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "SFGUARD_KEY": __import__("base64").b64encode(MASTER).decode(),
           "SFGUARD_STORE": pg_url}
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "verify", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout) == {"ok": True, "records": len(evs), "line": None,
                                      "problem": None,
                                      "message": f"audit log intact: {len(evs)} record(s)"}


def test_a_stopping_guard_audits_the_leases_it_still_held(pg_url, host):
    a, b = host("a"), host("b")
    a.backend.audit = a.audit                 # as supervisor/profiles/stores.py wires it
    a.store.create(P)
    assert isinstance(a.lease.try_acquire(P, "r1"), Granted)
    a.backend.close()
    assert ("profile_released", {"scope": "local", "profile": "shop", "run": "r1",
                                 "outcome": "abandoned"}) == events(pg_url)[-1]
    assert b.lease.holder(P) is None and b.audit.verify().ok
