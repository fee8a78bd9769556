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
