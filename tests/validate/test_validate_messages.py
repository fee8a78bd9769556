"""`sfguard validate` message quality: findings sorted by line, a field path even for a
top-level problem, and hints."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "cases"


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", "validate", str(path), "--no-tool-check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("name", sorted(p.name for p in CASES.glob("*.yaml")))
def test_findings_are_sorted_by_line(name):
    lines = [l for l in validate(CASES / name).stdout.splitlines() if l.startswith(str(CASES / name))]
    where = [tuple(int(x) for x in l[len(str(CASES / name)) + 1:].split(": ", 1)[0].split(":")) for l in lines]
    assert where == sorted(where)


@pytest.mark.parametrize("text,expected", [
    ("- id: a\n- id: b\n", "p.yaml:1:1: (top): the pipeline must be a mapping, not a list (hint:"),
    ("stages: check\n", "p.yaml:1:9: stages: stages must be a non-empty list (hint:"),
    ("stages:\n  - id: s\n    browser: {headed: false, allow_domains: example.com}\n",
     "p.yaml:3:45: stages[0].browser.allow_domains: must be a list, not a single text "
     "(hint: write a list: [example.com])"),
    ("stages:\n  - id: s\n    browser: {headed: \"true\"}\n",
     "p.yaml:3:23: stages[0].browser.headed: must be true or false, not 'true'"),
])
def test_messages_name_a_path_and_give_a_hint(tmp_path, text, expected):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    proc = validate(f)
    assert proc.returncode == 1
    assert expected in proc.stdout.replace(str(tmp_path) + "/", ""), proc.stdout
    assert ": : " not in proc.stdout          # never an empty field path
