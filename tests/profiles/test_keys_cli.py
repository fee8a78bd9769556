"""`sfguard keys status|rotate|retire` on a home no guard runs on (issue 51): the command rotates
by itself, a profile another process holds waits, `rotate` again finishes what was left, retire
names what still uses a version, and status creates nothing."""
from __future__ import annotations

import json
import os

from tests.profiles.conftest import HOLDER_SCRIPT, run_python, sfguard


def test_rotate_and_retire_without_a_guard(tmp_path):
    home = tmp_path / "home"
    for name in ("shop", "mail"):
        assert sfguard("profiles", "create", name, home=home).returncode == 0
    holder = run_python(HOLDER_SCRIPT, str(home), "local", "mail", "run-elsewhere")
    try:
        assert holder.stdout.readline().strip() == "Granted"
        out = sfguard("keys", "rotate", home=home)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [
            "rotated by this command (no guard runs on the home): key version 2 is current (was 1); "
            "1 profile(s) resealed at rest",
            "  waiting: local/mail is leased by run run-elsewhere: resealed when that run ends",
            "rotation under way: `sfguard keys status` shows what it waits for"]
        refused = sfguard("keys", "retire", "1", home=home)
        assert refused.returncode == 1
        assert "still used by 1 profile(s):\n  local/mail (leased by run run-elsewhere" in refused.stderr
        status = sfguard("keys", "status", home=home)
        assert status.returncode == 0
        assert "rotation 1 -> 2 under way since" in status.stdout
        assert "  local/mail: version 1, leased by run run-elsewhere: resealed when that run ends" in status.stdout
    finally:
        holder.kill()
        holder.wait(timeout=10)
    again = json.loads(sfguard("keys", "rotate", "--json", home=home).stdout)   # its holder is gone
    assert again["resumed"] and again["resealed"] == ["mail"] and again["finished"]
    assert sfguard("keys", "retire", "1", home=home).returncode == 0
    assert sorted(os.listdir(home / "keys")) == ["v2"]            # version 1's key files are gone
    before = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    status = json.loads(sfguard("keys", "status", "--json", home=home).stdout)
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == before     # read-only
    assert [(v["version"], v["state"], v["profiles"]) for v in status["versions"]] == [
        (1, "retired", 0), (2, "current", 2)]
    assert sfguard("audit", "verify", home=home).returncode == 0


def test_retire_refuses_what_is_not_an_old_version(tmp_path):
    home = tmp_path / "home"
    assert sfguard("profiles", "create", "shop", home=home).returncode == 0
    for version, text in (("1", "is the current one"), ("2", "not a live version"),
                          ("0", "a whole number from 1")):
        out = sfguard("keys", "retire", version, home=home)
        assert out.returncode == 2 and text in out.stderr, (version, out.stderr)
