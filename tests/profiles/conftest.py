"""Fixtures for the profile seam: one harness per implementation (local and in-memory fake)."""
from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sfguard.supervisor.profiles.audit import LocalAuditSink
from sfguard.supervisor.profiles.keys import FileKeyProvider
from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.profiles.stores import Stores
from sfguard.supervisor.testing import FakeAuditSink, FakeKeyProvider, FakeProfileLease, FakeProfileStore

ROOT = Path(__file__).resolve().parents[2]
SCOPE_A, SCOPE_B = "alpha", "beta"

# The `sfguard` console script's own entry (sfguard.cli.main:main, as pyproject's [project.scripts]
# names it). Not the old top-level `cli.main`: importing the CLI under a second name loads every
# module twice, and a CliError of one copy is not caught by the other.
SFGUARD = [sys.executable, "-c", "import sys; from sfguard.cli.main import main; sys.exit(main())"]


def sfguard(*args, home=None, env_home=None, input=None, cwd=ROOT):
    """Run the CLI as a user would; `--home` appended when given; $SFGUARD_HOME only if asked."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SFGUARD_HOME", None)
    if env_home:
        env["SFGUARD_HOME"] = str(env_home)
    argv = [*SFGUARD, *args] + (["--home", str(home)] if home else [])
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                          input=input)


HOLDER_SCRIPT = r"""
import sys
from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.protocols import ProfileKey
lease = LocalProfileLease(sys.argv[1])
got = lease.try_acquire(ProfileKey(sys.argv[2], sys.argv[3]), sys.argv[4])
print(type(got).__name__, flush=True)
sys.stdin.read()          # hold until the test closes stdin or kills us
"""


def run_python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)


class LocalHarness:
    """Local implementations on a temp guard home; "other processes" are real processes."""
    kind = "local"

    def __init__(self, tmp: Path):
        self.home = tmp / "home"
        self.runtime = tmp / "run"
        self.keys = FileKeyProvider(self.home)
        self.store = LocalProfileStore(self.home, self.keys, runtime=self.runtime)
        self.lease = LocalProfileLease(self.home)
        self.audit = LocalAuditSink(self.home, self.keys)
        self._procs: list[subprocess.Popen] = []

    def stores(self) -> Stores:
        return Stores(self.kind, self.kind, self.keys, self.store, self.lease, self.audit)

    def add_key_version(self) -> None:
        """What the operator does before a rotation: nothing here (the home makes its keys)."""

    def snapshot(self, key):
        """The sealed copy as an attacker could copy it."""
        return (self.home / "profiles" / key.scope / key.name / "profile.sealed").read_bytes()

    def restore(self, key, snap) -> None:
        (self.home / "profiles" / key.scope / key.name / "profile.sealed").write_bytes(snap)

    def other_process_acquires(self, key, run):
        proc = run_python(HOLDER_SCRIPT, str(self.home), key.scope, key.name, run)
        self._procs.append(proc)
        line = proc.stdout.readline().strip()
        return proc, line

    def kill(self, handle) -> None:
        proc = handle
        proc.kill()
        proc.wait(timeout=10)

    def plant_copy(self, src, dst) -> None:
        """Copy src's sealed file to where dst's would be (an attacker with file access)."""
        s = self.home / "profiles" / src.scope / src.name
        d = self.home / "profiles" / dst.scope / dst.name
        d.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.copytree(s, d, dirs_exist_ok=True)

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


class FakeHarness:
    """In-memory fakes with two scopes; "other processes" are views sharing the state."""
    kind = "fake"

    def __init__(self, tmp: Path):
        self.keys = FakeKeyProvider()
        self.store = FakeProfileStore((SCOPE_A, SCOPE_B), self.keys)
        self.lease = FakeProfileLease()
        self.audit = FakeAuditSink(self.keys)

    def stores(self) -> Stores:
        return Stores(self.kind, self.kind, self.keys, self.store, self.lease, self.audit)

    def add_key_version(self) -> None:
        pass

    def snapshot(self, key):
        import copy
        return copy.copy(self.store._profiles[key])

    def restore(self, key, snap) -> None:
        self.store._profiles[key] = snap

    def other_process_acquires(self, key, run):
        other = self.lease.for_process()
        return other, type(other.try_acquire(key, run)).__name__

    def kill(self, handle) -> None:
        handle.kill()

    def plant_copy(self, src, dst) -> None:
        self.store._profiles[dst] = self.store._profiles[src]

    def close(self) -> None:
        pass


PG_TTL = 3.0   # seconds: a killed "other process" loses its lease this long after its last beat

PG_HOLDER_SCRIPT = r"""
import sys
from sfguard.supervisor.profiles.pg_backend import PgBackend
from sfguard.supervisor.profiles.pg_lease import PgProfileLease
from sfguard.supervisor.protocols import ProfileKey
lease = PgProfileLease(PgBackend(sys.argv[1], ttl=float(sys.argv[5])))
got = lease.try_acquire(ProfileKey(sys.argv[2], sys.argv[3]), sys.argv[4])
print(type(got).__name__, flush=True)
sys.stdin.read()          # hold until the test closes stdin or kills us
"""


class PgHarness:
    """The PostgreSQL store on a fresh database of the session's real server; "other
    processes" are other guard processes on the same database (a kill lapses after the TTL)."""
    kind = "pg"

    def __init__(self, tmp: Path, url: str):
        from sfguard.supervisor.profiles.pg_audit import PgAuditSink
        from sfguard.supervisor.profiles.pg_backend import PgBackend
        from sfguard.supervisor.profiles.pg_keys import PgKeyProvider
        from sfguard.supervisor.profiles.pg_lease import PgProfileLease
        from sfguard.supervisor.profiles.pg_store import PgProfileStore
        self.url = url
        self.backend = PgBackend(url, ttl=PG_TTL)
        #: the operator's key file, by version (read again by the provider for a new version)
        self.masters = {1: os.urandom(32)}
        self.keys = PgKeyProvider(self.backend, dict(self.masters), "test key",
                                  reload=lambda: dict(self.masters))
        self.store = PgProfileStore(self.backend, self.keys, tmp / "home", runtime=tmp / "run")
        self.lease = PgProfileLease(self.backend)
        self.audit = PgAuditSink(self.backend, self.keys)
        self._procs: list[subprocess.Popen] = []

    def stores(self) -> Stores:
        return Stores(self.kind, self.kind, self.keys, self.store, self.lease, self.audit, self.backend)

    def add_key_version(self) -> None:
        """The operator puts the next master key into every host's key file."""
        self.masters[max(self.masters) + 1] = os.urandom(32)

    def snapshot(self, key):
        with self.backend.conn() as conn:
            return conn.execute("SELECT c.idx, c.data, p.key_version FROM sfguard_blob_chunks c JOIN "
                                "sfguard_profiles p ON p.blob_id = c.blob_id WHERE p.scope = %s AND "
                                "p.name = %s ORDER BY c.idx", (key.scope, key.name)).fetchall()

    def restore(self, key, snap) -> None:
        with self.backend.conn() as conn:
            blob = conn.execute("SELECT nextval('sfguard_blob_ids')").fetchone()[0]
            for idx, data, _v in snap:
                conn.execute("INSERT INTO sfguard_blob_chunks (blob_id, idx, data) VALUES (%s, %s, %s)",
                             (blob, idx, data))
            conn.execute("UPDATE sfguard_profiles SET blob_id = %s, key_version = %s WHERE scope = %s "
                         "AND name = %s", (blob, snap[0][2], key.scope, key.name))

    def other_process_acquires(self, key, run):
        proc = run_python(PG_HOLDER_SCRIPT, self.url, key.scope, key.name, run, str(PG_TTL))
        self._procs.append(proc)
        return proc, proc.stdout.readline().strip()

    def kill(self, handle) -> None:
        import time
        handle.kill()
        handle.wait(timeout=10)
        time.sleep(PG_TTL + 0.5)          # its heartbeat stopped: the lease lapses after the TTL

    def plant_copy(self, src, dst) -> None:
        """Point dst at a copy of src's sealed chunks (an attacker with database access)."""
        with self.backend.conn() as conn:
            blob = conn.execute("SELECT nextval('sfguard_blob_ids')").fetchone()[0]
            conn.execute("INSERT INTO sfguard_blob_chunks (blob_id, idx, data) SELECT %s, idx, "
                         "data FROM sfguard_blob_chunks c JOIN sfguard_profiles p ON "
                         "p.blob_id = c.blob_id WHERE p.scope = %s AND p.name = %s",
                         (blob, src.scope, src.name))
            conn.execute("INSERT INTO sfguard_profiles (scope, name, created, updated, size, "
                         "blob_id) SELECT %s, %s, created, updated, size, %s FROM sfguard_profiles "
                         "WHERE scope = %s AND name = %s ON CONFLICT (scope, name) DO UPDATE SET "
                         "blob_id = EXCLUDED.blob_id",
                         (dst.scope, dst.name, blob, src.scope, src.name))

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        self.backend.close()


@pytest.fixture(params=["local", "fake", "pg"])
def harness(request, tmp_path):
    if request.param == "pg":
        h = PgHarness(tmp_path, request.getfixturevalue("pg_url"))
    else:
        h = (LocalHarness if request.param == "local" else FakeHarness)(tmp_path)
    yield h
    h.close()


class _CookieHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Set-Cookie", "sid=persisted-login-123; Max-Age=86400; Path=/")
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html><body>hello<script>localStorage.setItem('k','v')</script></body></html>")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def chromium_profile(tmp_path_factory) -> Path:
    """A real Chromium user-data-dir that visited a 127.0.0.1 page setting a persistent cookie."""
    if not Path("/usr/bin/chromium").exists():
        pytest.fail("Chromium missing at /usr/bin/chromium: run ./dev setup")
    folder = tmp_path_factory.mktemp("chromium") / "profile"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CookieHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        subprocess.run(
            ["/usr/bin/chromium", "--headless", "--no-sandbox", f"--user-data-dir={folder}",
             "--disable-gpu", "--no-first-run", "--disable-background-networking", "--dump-dom",
             f"http://127.0.0.1:{server.server_address[1]}/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False)
    finally:
        server.shutdown()
    assert (folder / "Default" / "Cookies").is_file(), "Chromium wrote no cookie database"
    return folder
