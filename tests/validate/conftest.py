"""`sfguard validate` here checks against the policy of a guard home made for the test (no guard
runs on it): the shipped template with the reviewer's consent for the fixture site on
127.0.0.1 (`private_networks.allow`), as `sfguard demo` writes it. No guard home of this
machine is consulted (cli/policy_source.py)."""
from __future__ import annotations

import pytest

from sfguard import policy


@pytest.fixture(autouse=True)
def guard_home_policy(tmp_path, monkeypatch):
    home = tmp_path / "guard-home"
    home.mkdir(mode=0o700)
    text = policy.default_policy_path().read_text()
    assert text.endswith("private_networks:\n  allow: []\n")
    (home / "sites.yaml").write_text(text.replace("allow: []\n", 'allow: ["127.0.0.1/32"]\n'))
    monkeypatch.setenv("SFGUARD_HOME", str(home))
    return home / "sites.yaml"
