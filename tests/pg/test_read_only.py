"""Read-only commands on a shared store create and migrate nothing; a schema newer than the
code is refused by every command; the workflow identity of a profile is kept and shown."""
from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

from sfguard.supervisor.profiles.pg_backend import PgBackend, StoreRefused
from sfguard.supervisor.profiles.pg_schema import MIGRATIONS
from tests.pg.conftest import ROOT


def tables(url) -> list[str]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]


def rows(url, sql):
    with psycopg.connect(url) as conn:
        return conn.execute(sql).fetchall()


@pytest.fixture
def cli(tmp_path, key_file, pg_url):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "SFGUARD_KEY_FILE": str(key_file), "SFGUARD_STORE": pg_url, "LANG": "C.UTF-8"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home",
                               str(tmp_path / "home")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    run.env = env
    return run


NO_SCHEMA = "has no sfguard schema: start a guard with --store on it first"

# (argv, exit code, where the answer is, what it says) on a database no guard started on
EMPTY = [
    (("profiles", "list"), 0, "stdout", "no profiles"),
    (("profiles", "list"), 0, "stderr", NO_SCHEMA),
    (("profiles", "list", "--json"), 0, "stdout", '"profiles": []'),
    (("profiles", "show", "shop"), 1, "stderr", "no profile 'shop': the database"),
    (("audit", "verify"), 2, "stderr", NO_SCHEMA),
    (("audit", "verify", "--json"), 2, "stderr", NO_SCHEMA),
    (("audit", "show"), 2, "stderr", NO_SCHEMA),
    (("doctor",), None, "stdout", NO_SCHEMA),
]


def test_read_only_commands_on_an_empty_database_create_nothing(cli, pg_url, tmp_path):
    for argv, code, where, says in EMPTY:
        out = cli(*argv)
        if code is not None:
            assert out.returncode == code, (argv, out.stdout, out.stderr)
        assert says in getattr(out, where), (argv, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr
        assert tables(pg_url) == [], argv          # no table, no schema version, nothing
    assert not (tmp_path / "home").exists()        # and nothing in a home either


def test_read_only_commands_write_nothing_to_a_migrated_database(cli, pg_url):
    assert cli("profiles", "create", "shop").returncode == 0      # a write: migrates
    before = {t: rows(pg_url, f"SELECT * FROM {t} ORDER BY 1") for t in tables(pg_url)
              if t not in ("sfguard_blob_chunks",)}
    for argv in (("profiles", "list"), ("profiles", "show", "shop"), ("audit", "verify"),
                 ("audit", "show"), ("doctor",)):
        out = cli(*argv)
        assert "Traceback" not in out.stderr, (argv, out.stderr)
        if argv[0] != "doctor":
            assert out.returncode == 0, (argv, out.stdout, out.stderr)
    after = {t: rows(pg_url, f"SELECT * FROM {t} ORDER BY 1") for t in before}
    assert after == before                       # no guard row, no lease row, no key, no record
    assert rows(pg_url, "SELECT count(*) FROM sfguard_guards") == [(0,)]


def test_a_read_only_session_cannot_write(pg_url):
    PgBackend(pg_url, heartbeat=False).close()                  # migrated by a "guard"
    ro = PgBackend(pg_url, read_only=True)
    try:
        with pytest.raises(StoreRefused, match="SQLSTATE 25006, ReadOnlySqlTransaction"):
            with ro.conn() as conn:
                conn.execute("DELETE FROM sfguard_audit")
    finally:
        ro.close()


NEWER = (f"the database schema is version {len(MIGRATIONS) + 1}, newer than this sfguard knows "
         f"(up to {len(MIGRATIONS)})")

# every command that touches the store, each refused with the same message
EVERY = [("profiles", "list"), ("profiles", "show", "shop"), ("profiles", "create", "x"),
         ("profiles", "clear", "shop", "--yes"), ("audit", "verify"), ("audit", "show"),
         ("start",)]


def test_a_newer_schema_is_refused_by_every_command(cli, pg_url):
    assert cli("profiles", "create", "shop").returncode == 0
    with psycopg.connect(pg_url) as conn:
        conn.execute("INSERT INTO sfguard_schema_version VALUES (%s, 0)", (len(MIGRATIONS) + 1,))
    before = rows(pg_url, "SELECT count(*) FROM sfguard_audit")
    for argv in EVERY:
        out = cli(*argv)
        assert out.returncode == 2, (argv, out.stdout, out.stderr)
        assert NEWER in out.stderr and "upgrade sfguard on this host" in out.stderr, argv
        assert "Traceback" not in out.stderr
    doctor = cli("doctor")
    assert doctor.returncode == 1 and NEWER in doctor.stdout
    assert rows(pg_url, "SELECT count(*) FROM sfguard_audit") == before
    assert rows(pg_url, "SELECT max(version) FROM sfguard_schema_version") == [(len(MIGRATIONS) + 1,)]


def test_an_older_schema_is_left_to_start(cli, pg_url):
    """A read-only command never migrates: it names the command that does."""
    assert cli("profiles", "create", "shop").returncode == 0
    with psycopg.connect(pg_url) as conn:
        conn.execute("DELETE FROM sfguard_schema_version")      # as if made by an older sfguard
    out = cli("profiles", "list")
    assert out.returncode == 2
    assert f"older than this sfguard ({len(MIGRATIONS)}): start a guard of this version" in out.stderr
    assert rows(pg_url, "SELECT count(*) FROM sfguard_schema_version") == [(0,)]
