"""Keys that rotate across a fleet (issue 51): guard daemons with homes of their own on one real
PostgreSQL agree on the current key version through the store; a rotation started on one host
is picked up by the others without a restart; a host whose key file lacks the new version
refuses to seal under an old one, says why, keeps the run's login and lease, and catches up by
itself once its key file holds the version. A database an older sfguard made (schema 1, seals
without a key id) is migrated and its profiles open as key version 1."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg

from sfguard.supervisor.home import runtime_path
from tests.daemon.test_runs import stage, wait_ready
from tests.pg.conftest import ROOT

LEGACY = Path(__file__).resolve().parents[1] / "profiles" / "data" / "v1-legacy.sealed"


def write_keys(path: Path, keys: dict[int, bytes]) -> None:
    """The operator's key file, replaced whole (a new file renamed over the old): version 1
    as before, each later one as `N:BASE64`."""
    lines = [base64.b64encode(k).decode() if v == 1 else f"{v}:{base64.b64encode(k).decode()}"
             for v, k in sorted(keys.items())]
    tmp = path.with_suffix(".new")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


def cli(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(d.home)],
                          cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=120)


def profile_file(d, profile: str) -> Path:
    return runtime_path(d.home) / "profiles" / "local" / profile / "login.txt"


def hold(d, run: str, profile: str, text: str | None = None) -> None:
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    st, body = stage(d, run, "s1", profile=profile)
    assert st == 200, body
    if text is not None:
        profile_file(d, profile).write_text(text)


def end(d, run: str) -> dict:
    st, body = d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})
    assert st == 200, body
    return body


def read_login(d, run: str, profile: str) -> str:
    hold(d, run, profile)
    text = profile_file(d, profile).read_text()
    assert end(d, run)["ok"]
    return text


def keys_status(d) -> dict:
    out = cli(d, "keys", "status", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def test_two_hosts_rotate_together_through_the_store(guards, key_file):
    v1 = base64.b64decode(key_file.read_text())
    a, b = guards.start("a"), guards.start("b")
    for name in ("p1", "p2"):
        hold(a, f"seed-{name}", name, f"login {name}")
        assert end(a, f"seed-{name}")["ok"]
    hold(b, "rb", "p3", "written on host b")
    write_keys(key_file, {1: v1, 2: os.urandom(32)})          # every host's key file, first
    out = cli(a, "keys", "rotate")
    assert out.returncode == 0, out.stderr
    assert "2 profile(s) resealed at rest" in out.stdout and "local/p3 is leased by run rb" in out.stdout
    # host b picks the new version up without a restart: it opens what a sealed under it
    assert read_login(b, "rb-2", "p1") == "login p1"
    assert keys_status(b)["rotation"]["remaining"][0]["leased_by"] == "rb"
    assert end(b, "rb")["ok"]                                  # b reseals p3 under version 2
    status = keys_status(a)
    assert status["current"] == 2 and status["rotation"] is None and status["old_profiles"] == []
    assert [(v["version"], v["state"], v["profiles"]) for v in status["versions"]] == [
        (1, "old", 0), (2, "current", 3)]
    assert read_login(a, "ra", "p3") == "written on host b"
    assert cli(a, "audit", "verify").returncode == 0
    assert cli(a, "keys", "retire", "1").returncode == 0
    assert read_login(b, "rb-3", "p2") == "login p2"
    assert cli(b, "audit", "verify").returncode == 0


def test_a_host_without_the_new_key_refuses_to_seal_and_catches_up(guards, key_file, tmp_path):
    v1, v2 = base64.b64decode(key_file.read_text()), os.urandom(32)
    a = guards.start("a")
    guards.key_file = tmp_path / "b.key"           # host b gets a key file of its own
    write_keys(guards.key_file, {1: v1})
    b = guards.start("b")
    hold(a, "seed", "p1", "login p1")
    assert end(a, "seed")["ok"]
    hold(b, "rb", "p2", "written on host b")
    st, body = a.call("POST", "/v1/keys/rotate")    # nobody has the new key yet
    assert st == 409 and body["error"]["code"] == "key_missing", body
    assert "add `2:BASE64`" in body["error"]["message"]
    write_keys(key_file, {1: v1, 2: v2})            # host a only
    assert cli(a, "keys", "rotate").returncode == 0
    ended = end(b, "rb")
    assert not ended["ok"]
    problem = " ".join(ended["problems"])
    assert "key version 2 is not on this host" in problem and "unsealed copy and this run's lease are kept" in problem
    assert "nothing is sealed with an older version" in problem.lower()
    pending = b.call("GET", "/v1/status")[1]["pending"]
    assert any("p2: reseal waits for the current key version on this host" in p for p in pending), pending
    assert a.call("POST", "/v1/runs", {"run_id": "ra"})[0] == 201
    st, waiting = stage(a, "ra", "s1", profile="p2")
    assert st == 202 and waiting["holder_run"] == "rb"          # b's run keeps the profile meanwhile
    write_keys(guards.key_file, {1: v1, 2: v2})     # the operator gives host b the new key
    assert wait_ready(a, "ra", "s1", timeout=30)["state"] == "ready"
    assert profile_file(a, "p2").read_text() == "written on host b"    # nothing was lost
    assert end(a, "ra")["ok"]
    assert keys_status(a)["rotation"] is None
    assert cli(a, "audit", "verify").returncode == 0


def test_a_guard_whose_key_file_lacks_the_current_version_does_not_start(guards, key_file, tmp_path):
    v1 = base64.b64decode(key_file.read_text())
    a = guards.start("a")
    hold(a, "seed", "p1", "login p1")
    assert end(a, "seed")["ok"]
    old = tmp_path / "old.key"
    shutil.copy(key_file, old)
    write_keys(key_file, {1: v1, 2: os.urandom(32)})
    assert cli(a, "keys", "rotate").returncode == 0
    env = {**guards.env(tmp_path), "SFGUARD_KEY_FILE": str(old)}
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(tmp_path / "c")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "key version 2 is not on this host" in out.stderr and str(old) in out.stderr
    assert "BASE64" in out.stderr and base64.b64encode(v1).decode() not in out.stderr


def test_a_schema_1_database_migrates_and_its_seals_open_as_version_1(pg_url, tmp_path):
    """What an older sfguard left: schema 1, a scope key wrapped without a version, a profile
    sealed in SFGSEAL version 1, a keyed audit record without kid."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from sfguard.supervisor.profiles import pg_keys
    from sfguard.supervisor.profiles.audit_chain import GENESIS, canonical, chain_record, head_mac
    from sfguard.supervisor.profiles.pg_schema import MIGRATIONS, migrate
    master = os.urandom(32)
    with psycopg.connect(pg_url) as conn:
        migrate(conn, MIGRATIONS[:1])
        check = hmac.new(pg_keys._derive(master, "check"), b"sfguard key check", hashlib.sha256).hexdigest()
        conn.execute("INSERT INTO sfguard_meta (id, key_check) VALUES (1, %s)", (check,))
        nonce = os.urandom(12)
        wrapped = nonce + AESGCM(pg_keys._derive(master, "scope-key wrapping")).encrypt(
            nonce, bytes(range(32)), b"local")
        conn.execute("INSERT INTO sfguard_scope_keys (scope, wrapped) VALUES ('local', %s)", (wrapped,))
        conn.execute("INSERT INTO sfguard_blob_chunks (blob_id, idx, data) VALUES (7, 0, %s)",
                     (LEGACY.read_bytes(),))
        conn.execute("INSERT INTO sfguard_profiles (scope, name, created, updated, size, blob_id) "
                     "VALUES ('local', 'legacy', 1, 1, %s, 7)", (LEGACY.stat().st_size,))
        audit_key = pg_keys._derive(master, "audit chain")
        rec = chain_record(audit_key, 0, GENESIS, "profile_created", {"scope": "local", "profile": "legacy"})
        conn.execute("INSERT INTO sfguard_audit (seq, body) VALUES (1, %s)", (canonical(rec).decode(),))
        conn.execute("UPDATE sfguard_audit_head SET seq = 1, hash = %s, mac = %s WHERE id = 1",
                     (rec["hash"], head_mac(audit_key, 1, rec["hash"])))
    key = tmp_path / "shared.key"
    write_keys(key, {1: master})
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "SFGUARD_STORE": pg_url, "SFGUARD_KEY_FILE": str(key)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(tmp_path / "h")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run("profiles", "create", "fresh").returncode == 0        # a command that writes migrates
    status = json.loads(run("keys", "status", "--json").stdout)
    assert status["current"] == 1 and status["versions"][0]["profiles"] == 2
    write_keys(key, {1: master, 2: os.urandom(32)})
    rotated = run("keys", "rotate", "--json")
    assert rotated.returncode == 0, rotated.stderr
    assert sorted(json.loads(rotated.stdout)["resealed"]) == ["fresh", "legacy"]
    assert run("audit", "verify").returncode == 0
    assert run("keys", "retire", "1").returncode == 0
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM sfguard_scope_keys WHERE version = 1").fetchone() == (0,)
        assert conn.execute("SELECT key_version FROM sfguard_profiles ORDER BY name").fetchall() == [(2,), (2,)]

