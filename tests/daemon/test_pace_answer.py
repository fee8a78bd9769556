"""What a runner sees of pacing (issue 49) through a real `sfguard start` (fake browser): the
stage answer's effective pace per allowed pattern and its budget, a budget refused at the edge
with its field, and a live edit of the pace section shown to the next stage request."""
from __future__ import annotations

import time

import pytest

from sfguard.policy import parse_policy
from sfguard.supervisor.daemon.pacing import pace_view
from sfguard.supervisor.daemon.runs import Stage
from sfguard.supervisor.models import BrowserField

PACE = """
pace:
  - pattern: "*.shop.test"
    reason: "the shop locks accounts that browse fast"
    page_loads_per_minute: 20
    requests_per_minute: 120
  - pattern: pay.shop.test
    reason: "payments count every call"
    requests_per_minute: 10
    connections: 2
"""


def stage(budget=None, allow=("*.shop.test", "other.test")) -> Stage:
    browser = BrowserField.model_validate({"allow_domains": list(allow), "budget": budget})
    s = Stage("r1", "s1", 1, browser, False)
    s.started = 1_800_000_000.0
    return s


@pytest.mark.parametrize("budget,allow,want_pace,want_budget", [
    (None, ["other.test"], {}, {}),
    (None, ["*.shop.test"], {
        "*.shop.test": {"page_loads_per_minute": 20, "requests_per_minute": 120,
                        "rules": {"page_loads_per_minute": "sites.yaml:3 pace *.shop.test page_loads_per_minute 20",
                                  "requests_per_minute": "sites.yaml:3 pace *.shop.test requests_per_minute 120"}},
        # an entry on a host inside the wildcard is named beside it, with every entry that applies
        "pay.shop.test": {"page_loads_per_minute": 20, "requests_per_minute": 10, "connections": 2,
                          "rules": {"page_loads_per_minute": "sites.yaml:3 pace *.shop.test page_loads_per_minute 20",
                                    "requests_per_minute": "sites.yaml:7 pace pay.shop.test requests_per_minute 10",
                                    "connections": "sites.yaml:7 pace pay.shop.test connections 2"}}}, {}),
    # a budget's rates only tighten: 60 requests a minute is looser than the site's 10 on pay
    ({"requests": 500, "active_minutes": 30, "requests_per_minute": 60}, ["pay.shop.test"], {
        "pay.shop.test": {"page_loads_per_minute": 20, "requests_per_minute": 10, "connections": 2,
                          "rules": {"page_loads_per_minute": "sites.yaml:3 pace *.shop.test page_loads_per_minute 20",
                                    "requests_per_minute": "sites.yaml:7 pace pay.shop.test requests_per_minute 10",
                                    "connections": "sites.yaml:7 pace pay.shop.test connections 2"}}},
     {"requests": 500, "active_minutes": 30, "requests_per_minute": 60, "active_until": "2027-01-15T08:30:00Z"}),
    ({"page_loads_per_minute": 5}, ["other.test"],
     {"other.test": {"page_loads_per_minute": 5,
                     "rules": {"page_loads_per_minute": "browser.budget.page_loads_per_minute 5"}}},
     {"page_loads_per_minute": 5}),
])
def test_the_stage_answer_per_allowed_pattern(budget, allow, want_pace, want_budget):
    p = parse_policy("version: 1" + PACE, "sites.yaml")
    assert pace_view(p, stage(budget, allow)) == (want_pace, want_budget)


@pytest.mark.parametrize("budget,field", [
    ({"requests": 0}, "browser.budget.requests"),
    ({"requests": "5"}, "browser.budget.requests"),             # no coercion
    ({"active_minutes": 2000}, "browser.budget.active_minutes"),
    ({"page_loads_per_minute": -1}, "browser.budget.page_loads_per_minute"),
    ({"page_load": 5}, "browser.budget.page_load"),            # unknown key
])
def test_a_bad_budget_is_refused_at_the_edge(daemon, budget, field):
    d = daemon
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    status, body = d.call("POST", "/v1/runs/r1/stages", {
        "stage_id": "s1", "attempt": 1, "browser": {"headed": False, "allow_domains": ["shop.test"],
                                                     "budget": budget}})
    assert status == 400, body
    assert body["error"]["code"] == "invalid_request" and body["error"]["field"] == field


def test_the_answer_follows_a_live_edit(daemon):
    d = daemon
    policy_file = d.home / "sites.yaml"
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    body = {"stage_id": "s1", "attempt": 1,
            "browser": {"headed": False, "allow_domains": ["*.shop.test"], "budget": {"requests": 100}}}
    status, answer = d.call("POST", "/v1/runs/r1/stages", body)
    assert status == 200, answer
    assert answer["pace"] == {} and answer["budget"] == {"requests": 100}
    text = policy_file.read_text()
    assert "\npace: []\n" in text                 # the shipped template's empty section
    policy_file.write_text(text.replace("\npace: []\n", PACE))
    deadline = time.monotonic() + 10
    attempt = 1
    while time.monotonic() < deadline:
        d.call("POST", "/v1/runs/r1/stages/s1/end", {"outcome": "succeeded"})
        attempt += 1
        status, answer = d.call("POST", "/v1/runs/r1/stages", {**body, "attempt": attempt})
        assert status == 200, answer
        if answer["pace"]:
            break
        time.sleep(0.2)
    assert answer["pace"]["*.shop.test"]["requests_per_minute"] == 120
    assert answer["pace"]["pay.shop.test"]["connections"] == 2
