"""Upgrades: a home written by the previous release (tests/fixtures/home-v0) opens with this
one: read-only commands read it as it is, the first command that writes records the format,
its profiles and audit chain stay valid. A home of a newer format is refused by every command
with one clear message, and a damaged home.json is named, not reset."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sfguard.supervisor.home import FORMAT, FORMAT_FILE, read_format

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "home-v0"


def restored(tmp_path: Path) -> Path:
    """The fixture as a restore from backup gives it: 0700 folders, 0600 files."""
    home = tmp_path / "home"
    shutil.copytree(FIXTURE, home, ignore=shutil.ignore_patterns("README.md"))
    for root, _dirs, files in os.walk(home):
        os.chmod(root, 0o700)
        for f in files:
            os.chmod(Path(root) / f, 0o600)
    return home


def sfguard(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SFGUARD_HOME"}
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=60, env=env)


def test_a_previous_release_home_opens_and_is_migrated(tmp_path):
    home = restored(tmp_path)
    assert read_format(home) == 0
    listed = sfguard("profiles", "list", "--json", home=home)
    assert listed.returncode == 0, listed.stderr
    assert sorted(p["name"] for p in json.loads(listed.stdout)["profiles"]) == ["mail", "shop"]
    assert sfguard("audit", "verify", home=home).returncode == 0
    assert not (home / FORMAT_FILE).exists()           # reading writes nothing
    made = sfguard("profiles", "create", "news", home=home)  # the first write migrates
    assert made.returncode == 0, made.stderr
    assert json.loads((home / FORMAT_FILE).read_text()) == {"format": FORMAT}
    assert oct((home / FORMAT_FILE).stat().st_mode & 0o777) == "0o600"
    check = sfguard("profiles", "show", "shop", "--json", home=home)   # the old seal opens
    assert check.returncode == 0, check.stderr
    verify = sfguard("audit", "verify", home=home)
    assert verify.returncode == 0 and "3 record(s)" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.parametrize("command", [("profiles", "list"), ("audit", "verify"), ("audit", "show"),
                                     ("profiles", "create", "x"), ("start", "--no-console"),
                                     ("sweep",)])
def test_a_newer_home_is_refused_by_every_command(tmp_path, command):
    home = restored(tmp_path)
    (home / FORMAT_FILE).write_text(json.dumps({"format": FORMAT + 1}))
    proc = sfguard(*command, home=home)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "written by a newer sfguard" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((home / FORMAT_FILE).read_text())["format"] == FORMAT + 1


def test_a_damaged_format_file_is_named_and_kept(tmp_path):
    home = restored(tmp_path)
    (home / FORMAT_FILE).write_text("{not json")
    proc = sfguard("profiles", "list", home=home)
    assert proc.returncode == 2 and "home.json is damaged" in proc.stderr
    assert (home / FORMAT_FILE).read_text() == "{not json"
