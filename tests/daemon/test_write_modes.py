"""The stage answer's `writes` map: the stricter of the stage's browser.writes and the site floor."""
from __future__ import annotations

import pytest

from sfguard.policy.writes import WriteRules, WriteVerdict
from sfguard.supervisor.writes.modes import stage_write_modes


class Floor(WriteRules):
    def __init__(self, floors: dict[str, str]) -> None:
        self.floors = floors

    def judge(self, host, method, path, *, websocket=False, preflight=False):
        return WriteVerdict(True, self.floors.get(host, "allow"), "site_floor", rule=f"writes {host}")


class Policy:
    def __init__(self, floors: dict[str, str]) -> None:
        self.writes = Floor(floors)


@pytest.mark.parametrize("stage, floors, want", [
    ("allow", {}, {"a.test": "allow", "*.b.test": "allow", "c.test:8080": "allow"}),
    ("gate", {}, {"a.test": "gate", "*.b.test": "gate", "c.test:8080": "gate"}),
    ("allow", {"b.test": "deny"}, {"a.test": "allow", "*.b.test": "deny", "c.test:8080": "allow"}),
    # a pipeline cannot loosen a floor
    ("allow", {"c.test": "gate"}, {"a.test": "allow", "*.b.test": "allow", "c.test:8080": "gate"}),
    ("deny", {"a.test": "gate"}, {"a.test": "deny", "*.b.test": "deny", "c.test:8080": "deny"}),
])
def test_effective_mode_per_allowed_pattern(stage, floors, want):
    assert stage_write_modes(Policy(floors), stage, list(want)) == want


def test_a_policy_without_a_writes_section_leaves_the_stage_mode():
    assert stage_write_modes(object(), "gate", ["a.test"]) == {"a.test": "gate"}
