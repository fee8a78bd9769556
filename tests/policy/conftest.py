"""Commands run here check the policy named on their command line, or the shipped template:
$SFGUARD_HOME points at a home that does not exist, so no guard home of this machine (and no
guard running on it) is consulted (cli/policy_source.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_guard_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SFGUARD_HOME", str(tmp_path / "no-guard-home"))
