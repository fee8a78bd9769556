"""The stage answer's `writes` map: the stricter of the stage's browser.writes and the site
floor of sites.yaml's `writes` section, per allowed pattern, plus the floors inside them."""
from __future__ import annotations

import pytest

from sfguard.policy import parse_policy
from sfguard.supervisor.writes.modes import stage_write_modes


def policy(floors: dict[str, str]):
    entries = "".join(f'  - pattern: "{p}"\n    mode: {m}\n    reason: "reviewed"\n' for p, m in floors.items())
    return parse_policy("version: 1\n" + (f"writes:\n{entries}" if floors else ""))


@pytest.mark.parametrize("stage, floors, want", [
    ("allow", {}, {"a.test": "allow", "*.b.test": "allow", "c.test:8080": "allow"}),
    ("gate", {}, {"a.test": "gate", "*.b.test": "gate", "c.test:8080": "gate"}),
    ("allow", {"*.b.test": "deny"}, {"a.test": "allow", "*.b.test": "deny", "c.test:8080": "allow"}),
    # a pipeline cannot loosen a floor
    ("allow", {"c.test": "gate"}, {"a.test": "allow", "*.b.test": "allow", "c.test:8080": "gate"}),
    ("deny", {"a.test": "gate"}, {"a.test": "deny", "*.b.test": "deny", "c.test:8080": "deny"}),
    # a floor on a host inside an allowed wildcard is named beside it
    ("allow", {"pay.b.test": "gate"},
     {"a.test": "allow", "*.b.test": "allow", "c.test:8080": "allow", "pay.b.test": "gate"}),
    # a floor outside what the stage may reach is not named
    ("allow", {"other.test": "deny"}, {"a.test": "allow", "*.b.test": "allow", "c.test:8080": "allow"}),
])
def test_effective_mode_per_allowed_pattern(stage, floors, want):
    assert stage_write_modes(policy(floors), stage, ["a.test", "*.b.test", "c.test:8080"]) == want


def test_a_policy_without_a_writes_section_leaves_the_stage_mode():
    assert stage_write_modes(object(), "gate", ["a.test"]) == {"a.test": "gate"}
