"""sites.yaml `recording`: a level per site for the run records (issue 48)."""
from __future__ import annotations

import pytest

from sfguard.policy import PolicyError, load_policy, parse_policy
from sfguard.policy.recording import stricter

GOOD = """version: 1
recording:
  - pattern: bank.test
    level: decisions
    reason: statements on screen
  - patterns: ["*.health.test", "10.0.0.0/8"]
    level: "off"
    reason: medical records
  - pattern: "*.bank.test"
    level: full
    reason: the rest of the bank
"""


@pytest.mark.parametrize("host,port,level", [
    ("bank.test", 443, "decisions"), ("www.bank.test", 443, "full"), ("health.test", 443, "off"),
    ("a.b.health.test", 8080, "off"), ("10.1.2.3", 80, "off"), ("shop.test", 443, "full"), ("", None, "full"),
])
def test_each_site_gets_the_strictest_level_of_the_entries_naming_it(host, port, level):
    assert parse_policy(GOOD).recording.level(host, port) == level


@pytest.mark.parametrize("text,where", [
    ("recording:\n  - pattern: a.test\n    level: some\n    reason: x\n", "recording[0].level"),
    ("recording:\n  - pattern: a.test\n    level: off\n", "recording[0]"),
    ("recording:\n  - pattern: a.test\n    reason: x\n", "recording[0]"),
    ("recording:\n  - pattern: '*'\n    level: decisions\n    reason: x\n", "recording[0].pattern"),
    ("recording:\n  - pattern: a.test\n    patterns: [b.test]\n    level: off\n    reason: x\n", "recording[0]"),
    ("recording:\n  - pattern: a.test\n    levle: off\n    reason: x\n", "recording[0].levle"),
])
def test_a_wrong_entry_is_refused_at_its_line_with_the_field(text, where):
    with pytest.raises(PolicyError) as err:
        parse_policy("version: 1\n" + text)
    assert where in str(err.value), str(err.value)
    assert ":3:" in str(err.value) or ":4:" in str(err.value) or ":2:" in str(err.value)


def test_the_shipped_policy_records_everything_in_full():
    pol = load_policy()
    assert len(pol.recording) == 0 and pol.recording.level("example.com", 443) == "full"


@pytest.mark.parametrize("a,b,want", [("full", "decisions", "decisions"), ("off", "full", "off"),
                                      ("decisions", "decisions", "decisions"), ("bogus", "full", "bogus")])
def test_stricter(a, b, want):
    assert stricter(a, b) == want
