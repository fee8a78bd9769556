"""The `pace` section (policy/pace.py): reading it, which limits a host gets, and the counter
arithmetic every store uses (`admit`), with time passed in."""
from __future__ import annotations

import pytest

from sfguard.policy import parse_policy
from sfguard.policy.pace import Budget, Rate, Total, admit, effective

POLICY = """version: 1
pace:
  - pattern: "*.Shop.Example."
    reason: "the shop locks accounts that browse fast"
    page_loads_per_minute: 20
    requests_per_minute: 120
    burst: 3
  - patterns: [api.shop.example, "pay.example:8443"]
    reason: "the API counts every call"
    requests_per_minute: 30
    min_gap_s: 4
    connections: 2
    over: refuse
"""


@pytest.fixture(scope="module")
def p():
    return parse_policy(POLICY, "sites.yaml")


def test_entries_keep_canonical_patterns_and_lines(p):
    first, second = p.pace.entries
    assert first.patterns == ("*.shop.example",) and first.line == 3
    assert second.patterns == ("api.shop.example", "pay.example:8443") and second.line == 8
    assert (first.over, first.max_wait_s, first.burst) == ("wait", 5.0, 3)
    assert (second.over, second.connections) == ("refuse", 2)
    assert p.summary()["pace"] == 2


@pytest.mark.parametrize("host,port,requests,page_loads,caps", [
    ("www.shop.example", 443, ["sites.yaml:3 pace *.shop.example requests_per_minute 120"],
     ["sites.yaml:3 pace *.shop.example page_loads_per_minute 20"], []),
    ("shop.example", 80, ["sites.yaml:3 pace *.shop.example requests_per_minute 120"],
     ["sites.yaml:3 pace *.shop.example page_loads_per_minute 20"], []),
    # every matching entry applies, each on its own counter
    ("api.shop.example", 443, ["sites.yaml:3 pace *.shop.example requests_per_minute 120",
                               "sites.yaml:8 pace api.shop.example, pay.example:8443 requests_per_minute 30"],
     ["sites.yaml:3 pace *.shop.example page_loads_per_minute 20",
      "sites.yaml:8 pace api.shop.example, pay.example:8443 min_gap_s 4"],
     ["sites.yaml:8 pace api.shop.example, pay.example:8443 connections 2"]),
    ("pay.example", 8443, ["sites.yaml:8 pace api.shop.example, pay.example:8443 requests_per_minute 30"],
     ["sites.yaml:8 pace api.shop.example, pay.example:8443 min_gap_s 4"],
     ["sites.yaml:8 pace api.shop.example, pay.example:8443 connections 2"]),
    ("pay.example", 443, [], [], []),            # the pattern names a port
    ("shopexample.com", 443, [], [], []),
])
def test_which_limits_a_host_gets(p, host, port, requests, page_loads, caps):
    pace = p.pace.pace(host, port)
    assert [r.rule for r in pace.requests] == requests
    assert [r.rule for r in pace.page_loads] == page_loads
    assert [c.rule for c in pace.connections] == caps
    assert bool(pace) == bool(requests or page_loads or caps)


def test_strictest_and_the_stage_answer(p):
    got = p.pace.strictest("api.shop.example", 443)
    assert got["requests_per_minute"] == (
        30, "sites.yaml:8 pace api.shop.example, pay.example:8443 requests_per_minute 30")
    assert got["page_loads_per_minute"][0] == 20 and got["min_gap_s"][0] == 4
    # a stage's own rate only tightens; a looser one changes nothing
    eff = effective(p.pace, Budget(requests_per_minute=10, page_loads_per_minute=100), "api.shop.example", 443)
    assert eff["requests_per_minute"] == 10 and eff["page_loads_per_minute"] == 20
    assert eff["rules"]["requests_per_minute"] == "browser.budget.requests_per_minute 10"
    assert eff["rules"]["page_loads_per_minute"].startswith("sites.yaml:3 ")
    assert effective(p.pace, None, "other.example") == {}


R = Rate("requests", "s", 1.0, 1, "wait", 5.0, "r")
R3 = Rate("requests", "s", 1.0, 3, "wait", 5.0, "r3")
RF = Rate("requests", "s", 1.0, 1, "refuse", 5.0, "rf")
T2 = Total("requests", 2, "t2")


def run(limit, times):
    """(wait or 'refused') for events at `times` on one counter."""
    states: dict = {}
    out = []
    for t in times:
        a = admit(states, [("k", limit)], t)
        states.update(a.updates)
        out.append("refused" if a.refused else round(a.wait, 3))
    return out


@pytest.mark.parametrize("limit,times,expect", [
    (R, [0, 0, 0], [0, 1.0, 2.0]),                       # a burst waits its turn
    (R, [0, 2, 4], [0, 0, 0]),                           # under the pace: no wait
    (R, [0] * 7, [0, 1, 2, 3, 4, 5, "refused"]),         # a wait over max_wait_s is refused
    (R3, [0, 0, 0, 0], [0, 0, 0, 1.0]),                  # burst 3 go at once
    (RF, [0, 0, 1.0], [0, "refused", 0]),                # over: refuse
    (T2, [0, 0, 100], [0, 0, "refused"]),                # a total does not come back
])
def test_admit(limit, times, expect):
    assert run(limit, times) == expect


def test_admit_is_all_or_nothing():
    states: dict = {}
    a = admit(states, [("a", R), ("b", T2)], 0)
    states.update(a.updates)
    states.update(admit(states, [("b", T2)], 0).updates)       # the total is used up
    refused = admit(states, [("a", R), ("b", T2)], 10)
    assert refused.refused is T2 and "a" not in refused.updates  # the rate was not counted


@pytest.mark.parametrize("new_interval,expect_wait", [(0.1, 0.3), (10.0, 30.0)])
def test_an_edited_rate_keeps_its_debt_in_events(new_interval, expect_wait):
    """Three events at once on 1/s put the next one three intervals away; counted at an edited
    interval it is three of the new ones (looser: sooner; stricter: later)."""
    states: dict = {}
    for _ in range(3):
        states.update(admit(states, [("k", R)], 0).updates)
    edited = Rate("requests", "s", new_interval, 1, "wait", 60.0, "r")
    a = admit(states, [("k", edited)], 0)
    assert a.wait == pytest.approx(expect_wait)


def test_budget_limits():
    b = Budget(page_loads=5, requests_per_minute=6)
    assert [type(x).__name__ for x in b.limits("page_loads")] == ["Total"]
    rate = b.limits("requests")[0]
    assert rate.interval == 10.0 and rate.reason == "budget" and rate.rule == "browser.budget.requests_per_minute 6"
    assert not Budget() and b.as_dict() == {"page_loads": 5, "requests_per_minute": 6}
