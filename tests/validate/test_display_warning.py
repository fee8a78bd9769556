"""`sfguard validate` on a machine without a display (issue 35, section 6): a stage that asks
for `headed: true` is warned about (the guard would refuse it there), the example pipeline
says how it runs headless."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "supervisor" / "demo" / "login-pipeline.yaml"


def validate(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", "validate", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def test_headed_stages_are_warned_about_without_a_display():
    out = validate(str(EXAMPLE))
    warned = [l for l in out.stdout.splitlines() if "needs a display" in l]
    assert len(warned) == 3, out.stdout + out.stderr          # check, login and work
    assert all(".headed" in l and "headed: false" in l for l in warned)
    assert "headed: false" in EXAMPLE.read_text() and "live_view" in EXAMPLE.read_text()
    # the machine checks are skipped with --no-tool-check
    assert "needs a display" not in validate(str(EXAMPLE), "--no-tool-check").stdout
