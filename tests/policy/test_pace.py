"""The `pace` section (policy/pace.py): reading it, which limits a host gets, and the counter
arithmetic every store uses (`admit`), with time passed in."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sfguard.policy import parse_policy
from sfguard.policy.pace import Budget, Rate, Total, admit, effective

ROOT = Path(__file__).resolve().parents[2]

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


def sfguard(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_explain_names_each_pace_and_its_rule(tmp_path):
    (tmp_path / "sites.yaml").write_text(POLICY)
    proc = sfguard("policy", "explain", "api.shop.example:443", "--allow", "*.shop.example",
                   "--policy", str(tmp_path / "sites.yaml"))
    assert proc.returncode == 0, proc.stderr
    lines = [x.strip() for x in proc.stdout.splitlines() if x.strip().startswith("pace")]
    assert lines[:4] == [
        "pace:       20 page loads a minute, 120 requests a minute, 3 at once before the pace applies; "
        "over it: wait up to 5 s, then 429",
        "pace rule:  sites.yaml:3 pace *.shop.example (the shop locks accounts that browse fast)",
        "pace:       at least 4 s between page loads, 30 requests a minute, 2 connections at once; "
        "over it: 429 at once",
        "pace rule:  sites.yaml:8 pace api.shop.example, pay.example:8443 (the API counts every call)"]
    assert lines[4].startswith("pace note:  counted per profile")
    proc = sfguard("policy", "explain", "api.shop.example:443", "--allow", "*.shop.example", "--json",
                   "--policy", str(tmp_path / "sites.yaml"))
    paced = json.loads(proc.stdout)["pace"]
    assert [(x["rule"], x["limits"]) for x in paced] == [
        ("sites.yaml:3 pace *.shop.example", {"page_loads_per_minute": 20, "requests_per_minute": 120}),
        ("sites.yaml:8 pace api.shop.example, pay.example:8443",
         {"min_gap_s": 4, "requests_per_minute": 30, "connections": 2})]
    # a denied host sees no request: no pace is named
    proc = sfguard("policy", "explain", "api.shop.example:443", "--json", "--policy", str(tmp_path / "sites.yaml"))
    assert json.loads(proc.stdout)["pace"] == []


def test_policy_test_checks_expect_pace(tmp_path):
    (tmp_path / "sites.yaml").write_text(POLICY)
    (tmp_path / "cases.yaml").write_text("""\
policy: sites.yaml
cases:
  - {host: www.shop.example, allow: "*.shop.example", expect: allow,
     expect_pace: {page_loads_per_minute: 20, requests_per_minute: 120}}
  - {host: api.shop.example:443, allow: "*.shop.example", expect: allow,
     expect_pace: {page_loads_per_minute: 20, min_gap_s: 4, requests_per_minute: 30, connections: 2}}
  - {host: other.example, allow: other.example, expect: allow, expect_pace: none}
  - {host: www.shop.example, allow: "*.shop.example", expect: allow, expect_pace: none, name: unpaced}
""")
    proc = sfguard("policy", "test", str(tmp_path / "cases.yaml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "3 passed, 1 failed" in proc.stdout
    assert ("cases.yaml:8: www.shop.example [unpaced]: expected allow, pace none, got allow (allowed_by_run, "
            "rule allow *.shop.example), pace page_loads_per_minute 20, requests_per_minute 120") in proc.stdout
    (tmp_path / "bad.yaml").write_text("policy: sites.yaml\ncases:\n"
                                       "  - {host: a.example, expect: deny, expect_pace: {rpm: 5}}\n")
    proc = sfguard("policy", "test", str(tmp_path / "bad.yaml"))
    assert proc.returncode == 2 and "expect_pace: none, or limits such as" in proc.stderr


def test_the_shipped_templates_example_is_valid():
    """The commented example in policy/sites.yaml, uncommented, is a valid pace entry."""
    text = (ROOT / "policy" / "sites.yaml").read_text()
    block = text.split("# PACE:", 1)[1].split("\npace: []", 1)[0]
    example = block[block.index("#   - pattern"):].splitlines()
    p = parse_policy("version: 1\npace:\n" + "\n".join("  " + line[4:] for line in example) + "\n")
    (entry,) = p.pace.entries
    assert entry.limits() == {"page_loads_per_minute": 20, "min_gap_s": 2, "requests_per_minute": 120,
                              "connections": 6}
