"""`sfguard profiles ...` as a user sees it: outputs, exit codes, files and modes."""
from __future__ import annotations

import json
import os
import stat

import pytest

from sfguard.supervisor.profiles.audit import LocalAuditSink
from tests.profiles.conftest import HOLDER_SCRIPT, run_python, sfguard


def modes(root):
    out = {}
    for base, _dirs, files in os.walk(root):
        out[base] = stat.S_IMODE(os.stat(base).st_mode)
        for f in files:
            out[os.path.join(base, f)] = stat.S_IMODE(os.stat(os.path.join(base, f)).st_mode)
    return out


def test_create_list_show_clear(tmp_path):
    home = tmp_path / "home"
    work = tmp_path / "cwd"
    work.mkdir()
    r = sfguard("profiles", "create", "shop", home=home, cwd=work)
    assert r.returncode == 0, r.stderr
    assert "created profile shop" in r.stdout and "key file" in r.stdout
    assert list(work.iterdir()) == []                     # nothing in the current directory
    assert (home / "profiles" / "local" / "shop" / "profile.sealed").is_file()
    for path, mode in modes(home).items():
        assert mode == (0o700 if os.path.isdir(path) else 0o600), path

    r = sfguard("profiles", "create", "shop", home=home)
    assert r.returncode == 1 and "already exists" in r.stderr

    r = sfguard("profiles", "list", "--json", home=home)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    (row,) = data["profiles"]
    assert (row["name"], row["scope"], row["state"], row["leased_by"]) == ("shop", "local", "sealed", None)
    assert row["size"] > 0 and row["created"] and row["last_used"] is None
    assert "key file" in data["key_provider"]

    r = sfguard("profiles", "list", home=home)
    assert r.returncode == 0 and "shop" in r.stdout and "sealed" in r.stdout

    r = sfguard("profiles", "show", "shop", home=home)
    assert r.returncode == 0 and "state:" in r.stdout

    r = sfguard("profiles", "clear", "shop", home=home, input="")
    assert r.returncode == 2 and "--yes" in r.stderr
    assert (home / "profiles" / "local" / "shop").is_dir()

    r = sfguard("profiles", "clear", "shop", "--yes", home=home)
    assert r.returncode == 0, r.stderr
    assert not (home / "profiles" / "local" / "shop").exists()
    r = sfguard("profiles", "show", "shop", home=home)
    assert r.returncode == 1 and "no profile" in r.stderr

    events = [(x["event"], x["fields"]["profile"]) for x in LocalAuditSink(home).records()]
    assert events == [("profile_created", "shop"), ("profile_deleted", "shop")]
    assert sfguard("audit", "verify", home=home).returncode == 0


# The full table is in test_names.py; here: the CLI turns a bad name into a clear one-line error.
@pytest.mark.parametrize("name", ["../evil", "/tmp/x", "shоp"])
def test_bad_names_refused(tmp_path, name):
    home = tmp_path / "home"
    r = sfguard("profiles", "create", name, home=home)
    assert r.returncode == 2
    assert "invalid profile name" in r.stderr and "Traceback" not in r.stderr
    assert not (home / "profiles" / "local").exists() or list((home / "profiles" / "local").iterdir()) == []
    assert not (tmp_path / "evil").exists()


def test_clear_refused_while_leased_and_list_shows_holder(tmp_path):
    home = tmp_path / "home"
    assert sfguard("profiles", "create", "shop", home=home).returncode == 0
    holder = run_python(HOLDER_SCRIPT, str(home), "local", "shop", "run-42")
    try:
        assert holder.stdout.readline().strip() == "Granted"
        r = sfguard("profiles", "clear", "shop", "--yes", home=home)
        assert r.returncode == 1 and "leased by run run-42" in r.stderr
        assert (home / "profiles" / "local" / "shop" / "profile.sealed").is_file()
        r = sfguard("profiles", "list", "--json", home=home)
        (row,) = json.loads(r.stdout)["profiles"]
        assert (row["state"], row["leased_by"]) == ("leased", "run-42")
        r = sfguard("profiles", "list", home=home)
        assert "leased by run run-42" in r.stdout
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # the holder process died: the stale lease no longer blocks
    r = sfguard("profiles", "clear", "shop", "--yes", home=home)
    assert r.returncode == 0, r.stderr


def test_home_flag_wins_over_env(tmp_path):
    flag_home, env_home = tmp_path / "flag", tmp_path / "env"
    assert sfguard("profiles", "create", "one", env_home=env_home).returncode == 0
    assert sfguard("profiles", "create", "two", home=flag_home, env_home=env_home).returncode == 0

    def names(**kw):
        return [p["name"] for p in json.loads(sfguard("profiles", "list", "--json", **kw).stdout)["profiles"]]

    assert names(env_home=env_home) == ["one"]
    assert names(home=flag_home, env_home=env_home) == ["two"]


def test_audit_show_on_an_empty_log_says_so(tmp_path):
    """Issue 35: `audit show` on a fresh home printed nothing at all."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    out = sfguard("audit", "show", home=home)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no audit records yet (the log: ") and "audit.log" in out.stdout
    out = sfguard("audit", "show", "--run", "r9", home=home)
    assert out.stdout.startswith("no audit records match --run r9"), out.stdout
    assert sfguard("audit", "show", "--json", home=home).stdout == ""   # JSON lines: none
