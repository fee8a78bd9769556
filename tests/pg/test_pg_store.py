"""The PostgreSQL store's own edges: migrations, chunked blobs, fencing, expiry, audit chain in
the database, the shared key, an unreachable database, and the CLI with --store."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import psycopg
import pytest

from sfguard.supervisor.profiles.keys import KeyMissing
from sfguard.supervisor.profiles.pg_audit import PgAuditSink
from sfguard.supervisor.profiles.pg_backend import PgBackend, StaleLease
from sfguard.supervisor.profiles.pg_keys import PgKeyProvider, load_master_key
from sfguard.supervisor.profiles.pg_lease import PgProfileLease
from sfguard.supervisor.profiles.pg_schema import MIGRATIONS, SchemaTooNew
from sfguard.supervisor.profiles.pg_store import BLOB_CHUNK, PgProfileStore
from sfguard.supervisor.protocols import Granted, ProfileKey, StoreUnavailable, Waiting
from tests.pg.conftest import ROOT

P = ProfileKey("local", "shop")


class Host:
    """One guard process's view: backend (guard id, heartbeat), keys, store, lease, audit."""

    def __init__(self, url, tmp, name, master, ttl=30.0):
        self.backend = PgBackend(url, ttl=ttl)
        self.keys = PgKeyProvider(self.backend, master, "test key")
        self.audit = PgAuditSink(self.backend, self.keys)
        self.store = PgProfileStore(self.backend, self.keys, tmp / name / "home",
                                    runtime=tmp / name / "run", audit=self.audit)
        self.lease = PgProfileLease(self.backend, self.audit)


@pytest.fixture
def master():
    return os.urandom(32)


@pytest.fixture
def hosts(pg_url, tmp_path, master):
    made = []

    def make(name, ttl=30.0, key=None):
        h = Host(pg_url, tmp_path, name, key or master, ttl)
        made.append(h)
        return h
    yield make
    for h in made:
        h.backend.close()


def rows(url, sql, args=()):
    with psycopg.connect(url) as conn:
        return conn.execute(sql, args).fetchall()


def test_migrations_are_versioned_and_idempotent(pg_url, hosts):
    hosts("a")
    hosts("b")                                    # a second start applies nothing again
    assert rows(pg_url, "SELECT version FROM sfguard_schema_version ORDER BY 1") == \
        [(v,) for v in range(1, len(MIGRATIONS) + 1)]


def test_a_newer_schema_refuses_to_start_with_a_clear_message(pg_url, hosts, tmp_path, key_file):
    hosts("a")
    with psycopg.connect(pg_url) as conn:
        conn.execute("INSERT INTO sfguard_schema_version VALUES (%s, 0)", (len(MIGRATIONS) + 1,))
    with pytest.raises(SchemaTooNew, match=f"version {len(MIGRATIONS) + 1}, newer than this sfguard knows"):
        PgBackend(pg_url)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "SFGUARD_KEY_FILE": str(key_file)}
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home",
                          str(tmp_path / "g"), "--store", pg_url], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"newer than this sfguard knows (up to {len(MIGRATIONS)}): upgrade sfguard" in out.stderr


def test_sealed_blob_is_stored_in_chunks_and_never_in_clear(pg_url, hosts):
    h = hosts("a")
    h.store.create(P)
    assert isinstance(h.lease.try_acquire(P, "r1"), Granted)
    work = h.store.open(P)
    payload = os.urandom(BLOB_CHUNK) + b"sid=secret-cookie-marker" * 50_000
    (work / "Cookies").write_bytes(payload)
    h.store.close(P)
    chunks = rows(pg_url, "SELECT c.idx, length(c.data) FROM sfguard_blob_chunks c JOIN "
                  "sfguard_profiles p ON p.blob_id = c.blob_id ORDER BY c.idx")
    assert len(chunks) >= 3 and all(n <= BLOB_CHUNK for _, n in chunks)
    assert [i for i, _ in chunks] == list(range(len(chunks)))
    leaked = rows(pg_url, "SELECT count(*) FROM sfguard_blob_chunks WHERE position(%s in data) > 0",
                  (b"secret-cookie-marker",))
    assert leaked == [(0,)]                       # the database sees sealed bytes only
    assert rows(pg_url, "SELECT count(*) FROM sfguard_blob_chunks")[0][0] == len(chunks)  # old blob gone
    work = h.store.open(P)
    assert (work / "Cookies").read_bytes() == payload
    h.store.close(P, save=False)
    h.store.verify(P)


def test_every_grant_gets_a_greater_token_and_a_stale_reseal_is_refused(hosts, caplog):
    a, b = hosts("a"), hosts("b")
    a.store.create(P)
    tokens = []
    for run, h in (("r1", a), ("r2", b), ("r3", a)):
        assert isinstance(h.lease.try_acquire(P, run), Granted)
        tokens.append(h.backend.token(P)[1])
        h.lease.release(P, run)
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert isinstance(a.lease.try_acquire(P, "r4"), Granted)
    work = a.store.open(P)
    (work / "Cookies").write_bytes(b"old")
    # a's lease is taken over behind its back (as after its TTL): b now holds the profile
    with a.backend.conn() as conn:
        conn.execute("UPDATE sfguard_leases SET holder_run = NULL, holder_guard = NULL")
    assert isinstance(b.lease.try_acquire(P, "r5"), Granted)
    bw = b.store.open(P)
    (bw / "Cookies").write_bytes(b"new")
    b.store.close(P)
    with caplog.at_level(logging.WARNING, logger="sfguard.pg_store"):
        with pytest.raises(StaleLease, match="newer state is kept"):
            a.store.close(P)
        with pytest.raises(StaleLease):
            a.store.record_login_check(P, True)      # a state write is fenced too
    assert "late reseal of profile local/shop refused" in caplog.text
    assert "late state write of profile local/shop refused" in caplog.text
    assert not work.exists()                           # the stale working copy is gone
    b.store.record_login_check(P, True)
    assert b.store.details(P)["last_login_ok"] is True
    b.lease.release(P, "r5")
    assert isinstance(a.lease.try_acquire(P, "r6"), Granted)
    assert (a.store.open(P) / "Cookies").read_bytes() == b"new"
    a.store.close(P, save=False)


def test_a_reseal_without_the_lease_is_refused(hosts):
    h = hosts("a")
    h.store.create(P)
    h.store.open(P)
    with pytest.raises(StaleLease):
        h.store.save(P)


def test_a_silent_guard_loses_its_lease_after_the_ttl_and_its_queue_place(pg_url, tmp_path, master, hosts):
    b = hosts("b")
    quiet = PgBackend(pg_url, ttl=1.0, heartbeat=False)   # a guard whose heartbeat stopped
    try:
        ql = PgProfileLease(quiet)
        assert isinstance(ql.try_acquire(P, "r1"), Granted)
        assert isinstance(ql.try_acquire(ProfileKey("local", "other"), "r1"), Granted)
        assert isinstance(b.lease.try_acquire(ProfileKey("local", "other"), "r2"), Waiting)
        w = b.lease.try_acquire(P, "r2")
        assert isinstance(w, Waiting) and w.holder_run == "r1" and w.holder_guard == quiet.guard_id
        ql2 = PgProfileLease(quiet)
        with quiet.conn() as conn:                  # r1 of the quiet guard also waits elsewhere
            conn.execute("INSERT INTO sfguard_leases (scope, name, holder_run, holder_guard, "
                         "holder_since, generation) VALUES ('local', 'third', 'rx', %s, 0, 1)",
                         (b.backend.guard_id,))
        assert isinstance(ql2.try_acquire(ProfileKey("local", "third"), "r1"), Waiting)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and b.lease.holder(P) is not None:
            time.sleep(0.2)
        assert b.lease.holder(P) is None
        assert b.lease.queue(ProfileKey("local", "third")) == []
        assert isinstance(b.lease.try_acquire(P, "r2"), Granted)
        swept = b.lease.sweep_stale()
        assert swept == [(ProfileKey("local", "other"), "r1")]
    finally:
        quiet.close()


def test_audit_chain_in_the_database_verifies_and_finds_tampering(pg_url, hosts):
    a, b = hosts("a"), hosts("b")
    for i, h in enumerate((a, b, a, b)):
        h.audit.record("profile_leased", scope="local", profile="shop", run=f"r{i}")
    assert str(a.audit.verify()) == "audit log intact: 4 record(s)"
    assert [r["fields"]["run"] for r in b.audit.records(profile="shop")] == ["r0", "r1", "r2", "r3"]
    with psycopg.connect(pg_url) as conn:
        conn.execute("UPDATE sfguard_audit SET body = replace(body, '\"r2\"', '\"rX\"') WHERE seq = 3")
    bad = a.audit.verify()
    assert not bad.ok and bad.line == 3 and "edited" in bad.reason
    with psycopg.connect(pg_url) as conn:
        conn.execute("DELETE FROM sfguard_audit WHERE seq >= 3")
    cut = a.audit.verify()
    assert not cut.ok and "tail truncated" in cut.reason


def test_the_audit_record_and_its_event_commit_together(pg_url, hosts):
    h = hosts("a")
    with pytest.raises(RuntimeError):
        with h.backend.conn() as conn:
            PgAuditSink(h.backend, h.keys).append(conn, "profile_deleted", {"profile": "shop"})
            raise RuntimeError("the event's own write failed")
    assert rows(pg_url, "SELECT count(*) FROM sfguard_audit") == [(0,)]
    assert h.audit.verify().ok


def test_another_key_is_refused_and_scope_keys_are_shared(hosts, master):
    a, b = hosts("a"), hosts("b")
    assert a.keys.get_key("local") == b.keys.get_key("local")     # one key for every host
    with pytest.raises(KeyMissing, match="not the key this database was set up with"):
        hosts("c", key=os.urandom(32))


def test_deleting_a_scope_key_makes_its_profiles_unreadable(hosts):
    a, b = hosts("a"), hosts("b")
    a.store.create(P)
    a.keys.delete_key("local")
    assert isinstance(b.lease.try_acquire(P, "r1"), Granted)
    with pytest.raises(KeyMissing):
        b.store.open(P)
    assert b.store.unsealed() == []


def test_master_key_sources(tmp_path):
    key = tmp_path / "k"
    key.write_text("bm90IDMyIGJ5dGVz\n")
    key.chmod(0o600)
    with pytest.raises(KeyMissing, match="not base64 of 32 bytes"):
        load_master_key({"SFGUARD_KEY_FILE": str(key)})
    key.chmod(0o644)
    with pytest.raises(KeyMissing, match="readable by others"):
        load_master_key({"SFGUARD_KEY_FILE": str(key)})
    with pytest.raises(KeyMissing, match="SFGUARD_KEY_FILE"):
        load_master_key({})
    import base64
    raw = os.urandom(32)
    got, source = load_master_key({"SFGUARD_KEY": base64.b64encode(raw).decode()})
    assert got == raw and source == "shared key from $SFGUARD_KEY"


def test_an_unreachable_database_is_named_without_its_password(tmp_path):
    url = f"postgresql://sfguard:hunter2-secret@/db?host={tmp_path}&port=1"
    with pytest.raises(StoreUnavailable) as err:
        PgBackend(url, connect_wait=1)
    assert "hunter2" not in str(err.value) and "sfguard:***@" in str(err.value)
    assert isinstance(err.value, OSError)   # the guard treats it like an I/O failure


def test_cli_profiles_audit_and_doctor_follow_the_store(pg_url, tmp_path, key_file):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "SFGUARD_KEY_FILE": str(key_file), "SFGUARD_STORE": pg_url}

    def cli(*args, **kw):
        return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60, **kw)
    made = cli("profiles", "create", "shop", "--home", str(tmp_path / "h1"))
    assert made.returncode == 0, made.stderr
    assert "shared key file" in made.stdout
    listed = cli("profiles", "list", "--json", "--home", str(tmp_path / "h2"))   # another host
    assert listed.returncode == 0, listed.stderr
    assert [p["name"] for p in json.loads(listed.stdout)["profiles"]] == ["shop"]
    assert not (tmp_path / "h1" / "profiles").exists()         # nothing of it in a home
    shown = json.loads(cli("profiles", "show", "shop", "--json").stdout)
    assert (shown["state"], shown["last_login_check"], shown["last_login_ok"]) == ("sealed", None, None)
    assert shown["key_provider"].startswith("shared key file")
    cleared = cli("profiles", "clear", "shop", "--yes", "--home", str(tmp_path / "h2"))
    assert cleared.returncode == 0, cleared.stderr
    verify = cli("audit", "verify", "--json")
    assert json.loads(verify.stdout)["ok"] is True and json.loads(verify.stdout)["records"] == 4
    shown = cli("audit", "show", "--json")
    # clear holds the lease while it deletes: each change audited in its own transaction
    assert [json.loads(l)["event"] for l in shown.stdout.splitlines()] == [
        "profile_created", "profile_leased", "profile_deleted", "profile_released"]
    doctor = cli("doctor")
    assert "store PostgreSQL postgresql://postgres@/" in doctor.stdout
    assert "key provider shared key file" in doctor.stdout
    local = cli("audit", "verify", "--store", "local", "--home", str(tmp_path / "nohome"))
    assert local.returncode == 2                                # --store wins over the env
    bad = cli("profiles", "list", "--store", "mysql://x:pw@h/d")
    assert bad.returncode == 2 and "pw" not in bad.stderr and "postgresql://" in bad.stderr


def test_a_database_outage_loses_nothing(tmp_path, master):
    """The holder keeps its working copy while the database is away; no new grant is made;
    the run's reseal and release wait on the host and go in (fenced) when it is back."""
    from tests.pgserver import PgServer
    server = PgServer().start()
    made = []
    try:
        url = server.create_db()
        a = Host(url, tmp_path, "a", master, ttl=2.0)
        made.append(a)
        a.store.create(P)
        assert isinstance(a.lease.try_acquire(P, "r1"), Granted)
        work = a.store.open(P)
        (work / "Cookies").write_bytes(b"sid=written-during-the-outage")
        server.pause()
        with pytest.raises(StoreUnavailable):
            a.lease.try_acquire(P, "r2")              # no grant while the database is away
        assert (work / "Cookies").exists()           # the holder keeps using its copy
        with pytest.raises(StoreUnavailable, match="stored when the database is back"):
            a.store.close(P)                          # the run ends during the outage
        with pytest.raises(StoreUnavailable):
            a.lease.release_all("r1")
        assert not work.exists() and len(a.backend.pending) == 2
        time.sleep(3.0)                               # longer than a's TTL
        server.resume()
        b = Host(url, tmp_path, "b", master)          # a guard that asks at once
        made.append(b)
        first = b.lease.try_acquire(P, "r3")
        assert isinstance(first, Granted) or first.holder_run == "r1"   # a's lease outlived the outage
        deadline = time.monotonic() + 60
        while a.backend.pending and time.monotonic() < deadline:
            time.sleep(0.2)
        assert a.backend.pending == []
        assert isinstance(b.lease.try_acquire(P, "r3"), Granted)
        assert (b.store.open(P) / "Cookies").read_bytes() == b"sid=written-during-the-outage"
        b.store.close(P, save=False)
        late = [r for r in b.audit.records(profile="shop") if r["event"] == "profile_released"]
        assert [(r["fields"]["run"], r["fields"]["outcome"]) for r in late] == [("r1", "released_late")]
        assert b.audit.verify().ok
        assert not list((tmp_path / "a" / "run" / "store-tmp").glob("*.tmp"))   # nothing left over
    finally:
        for h in made:
            h.backend.close()
        server.stop()
