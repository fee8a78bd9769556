"""One schema for the browser field: `sfguard validate` (sfguard.supervisor.pipeline.spec) and the control
API refuse the same documents, at the same field path. Table-driven: each browser document is
put in a one-stage pipeline file and in a real stage request to a real guard."""
from __future__ import annotations

import re

import yaml

from sfguard.supervisor.pipeline.spec import validate_pipeline

OK_CHECK = {"url": "http://127.0.0.1:8080/account", "logged_in": "*/account"}

# (browser field, the field path both must name, relative to the browser field)
BAD = [
    ({"headed": "yes"}, "headed"),
    ({"headed": 1}, "headed"),
    ({"headed": False, "allow_domains": "example.com"}, "allow_domains"),
    ({"headed": False, "allow_domains": ["ok.example", "*"]}, "allow_domains.1"),
    ({"headed": False, "allow_domains": [5]}, "allow_domains.0"),
    ({"headed": False, "allow_domains": [".example.com"]}, "allow_domains.0"),
    ({"headed": False, "profile": "../etc"}, "profile"),
    ({"headed": False, "profile": 7}, "profile"),
    ({"headed": False, "surprise": 1}, "surprise"),
    ({"headed": False, "login_check": "x"}, "login_check"),
    ({"headed": False, "login_check": {"url": "http://127.0.0.1:8080/"}}, "login_check.logged_in"),
    ({"headed": False, "login_check": {**OK_CHECK, "selectr": "#x"}}, "login_check.selectr"),
    ({"headed": False, "login_check": {**OK_CHECK, "url": "ftp://127.0.0.1/"}}, "login_check.url"),
    ({"headed": False, "login_check": {**OK_CHECK, "logged_out": "*/login"}}, "login_check.logged_out"),
    ({"headed": False, "login_check": {**OK_CHECK, "logged_in": "re:(x"}}, "login_check.logged_in"),
    ({"headed": False, "login_check": {**OK_CHECK, "logged_out": ["*/a", "re:"]}}, "login_check.logged_out.1"),
    ({"headed": False, "login_check": {**OK_CHECK, "selector": ""}}, "login_check.selector"),
]
GOOD = [
    {"headed": False, "allow_domains": ["127.0.0.1:8080"], "login_check": {**OK_CHECK, "selector": "#in"}},
]


#: refused by the site policy (403 in the API): a special address without the reviewer's consent
POLICY_BAD = [
    ({"headed": False, "allow_domains": ["127.0.0.1:8080", "169.254.169.254"]}, "allow_domains.1"),
    ({"headed": False, "allow_domains": ["10.0.0.0/8"]}, "allow_domains.0"),
]


def validator_paths(tmp_path, browser, policy_path=None) -> set[str]:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"stages": [{"id": "s", "browser": browser}]}))
    report = validate_pipeline(f, policy_path=policy_path, check_tools=False)
    prefix = "stages[0].browser."
    return {re.sub(r"\[(\d+)\]", r".\1", i.path[len(prefix):]) for i in report.errors
            if i.path.startswith(prefix)}


def test_validate_and_api_refuse_alike(daemon, tmp_path):
    daemon.call("POST", "/v1/runs", {"run_id": "parity"})
    mismatches = []
    for n, (browser, path) in enumerate(BAD):
        status, body = daemon.call("POST", "/v1/runs/parity/stages",
                                   {"stage_id": f"s{n}", "attempt": 1, "browser": browser})
        api_field = (body.get("error") or {}).get("field") if isinstance(body, dict) else None
        found = validator_paths(tmp_path, browser)
        if status != 400 or api_field != f"browser.{path}" or found != {path}:
            mismatches.append((browser, path, status, api_field, found))
        else:
            # the same words: the API message is the validator's message for that field
            report = validate_pipeline(tmp_path / "p.yaml", check_tools=False)
            assert body["error"]["message"].split(": ", 1)[1] == report.errors[0].message
    assert mismatches == []
    # the site policy the guard enforces (its home's sites.yaml), checked by both alike
    live = daemon.home / "sites.yaml"
    for n, (browser, path) in enumerate(POLICY_BAD):
        status, body = daemon.call("POST", "/v1/runs/parity/stages",
                                   {"stage_id": f"p{n}", "attempt": 1, "browser": browser})
        assert (status, body["error"]["code"], body["error"]["field"]) == (
            403, "reviewer_only_address", f"browser.{path}"), body
        assert validator_paths(tmp_path, browser, live) == {path}
        report = validate_pipeline(tmp_path / "p.yaml", policy_path=live, check_tools=False)
        assert body["error"]["message"].split(": ", 1)[1] == report.errors[0].message
    for n, browser in enumerate(GOOD):
        assert validator_paths(tmp_path, browser, live) == set()
        status, body = daemon.call("POST", "/v1/runs/parity/stages",
                                   {"stage_id": f"good{n}", "attempt": 1, "browser": browser})
        assert status in (200, 202), body
