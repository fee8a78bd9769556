"""The operator guide and reference say what issue 35 found missing: backup and restore of a
local home (and that the key files open the sealed profiles), the retention of ended runs with
the `sfguard start` options that set it, and `status --check` in the exit code table."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "operator-guide.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def section(text: str, title: str) -> str:
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ )", text, re.M | re.S)
    assert m, f"no section {title!r}"
    return m.group(1)


def test_the_guide_says_how_to_back_up_and_restore_a_home():
    text = section(GUIDE, "Backup and restore of a local home")
    for needed in ("profiles/", "keys/", "audit.log", "sfguard audit verify"):
        assert needed in text, needed
    assert "beside the sealed profiles open them" in text


def test_the_retention_options_exist_and_are_documented():
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    text = section(GUIDE, "Ended runs: how long the guard keeps them")
    for option in ("--keep-ended-runs", "--keep-ended-hours"):
        assert option in out.stdout and option in text, option
    assert "runs/ended/" in text


def test_status_check_is_in_the_exit_code_table():
    table = section(REFERENCE, "Exit codes")
    assert re.search(r"^\| 1 \|.*`status --check`", table, re.M)


def test_the_single_sign_on_example_is_a_valid_pipeline(tmp_path):
    """The guide's real-site example (issue 33): the pipeline it shows passes `sfguard
    validate`, its login stage allows the app and the provider, its work stage the app only."""
    text = section(GUIDE, "A real site: single sign-on")
    m = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert m, "no pipeline in the single sign-on example"
    pipeline = tmp_path / "app-sso.yaml"
    pipeline.write_text(m.group(1))
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "validate", str(pipeline), "--no-tool-check",
                          "--policy", str(ROOT / "policy" / "sites.yaml")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'allow_domains: ["app.example.com", "login.idp.example"]' in m.group(1)
    assert "--allow login.idp.example" in text
