import os
import subprocess
import sys
from pathlib import Path

SFGUARD = [sys.executable, "-m", "sfguard.cli.main"]
ROOT = Path(__file__).resolve().parent.parent


def test_doctor_reports_every_piece_and_passes_when_installed():
    out = subprocess.run(SFGUARD + ["doctor"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for piece in ("mitmproxy", "agent-browser 0.41.2", "browser", "display", "keyring"):
        assert piece in out.stdout


def test_doctor_fails_and_says_how_when_browser_missing(tmp_path):
    env = dict(os.environ, SFGUARD_BROWSER=str(tmp_path / "no-such-browser"))
    out = subprocess.run(SFGUARD + ["doctor"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 1
    assert "MISSING  browser" in out.stdout
    assert "apt-get install chromium" in out.stdout


def test_doctor_says_who_the_browsers_run_as_and_what_an_ordinary_user_guard_leaves(monkeypatch):
    """Under root: each browser a user of its own from the pool (or that start creates them).
    As an ordinary user (no way to switch uids): every browser is this one user, and that a
    browser taken over past its sandbox, or a process of this user, reaches the other runs."""
    from sfguard.cli.doctor_cmd import _browser_user_check
    status, what, detail = _browser_user_check()
    if os.geteuid() == 0:
        assert status == "ok" and what == "browser users:", detail
        assert "each as a user of its own" in detail or "creates them" in detail, detail
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    status, what, detail = _browser_user_check()
    assert (status, what) == ("info", "browser users")
    for words in ("not root", "every browser runs as this one user", "other runs' unsealed logins",
                  "each browser as a user of its own"):
        assert words in detail, detail
