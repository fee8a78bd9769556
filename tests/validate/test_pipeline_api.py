"""sfguard.supervisor.pipeline.spec as a library (what `sfguard demo` and the daemon use)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sfguard.supervisor.browsers import tools
from sfguard.supervisor.demo.run import write_demo_policy
from sfguard.supervisor.pipeline.spec import Route, validate_pipeline

EXAMPLE = Path(__file__).resolve().parents[2] / "supervisor" / "demo" / "login-pipeline.yaml"


@pytest.fixture
def demo_policy(tmp_path) -> Path:
    """The policy `sfguard demo` runs the example with: the reviewer's consent for 127.0.0.1."""
    return write_demo_policy(tmp_path / "sites.yaml", 8080)


def test_example_report_exposes_stages_routes_and_browser_fields(demo_policy):
    report = validate_pipeline(EXAMPLE, policy_path=demo_policy, check_tools=False)
    assert report.ok and report.issues == []
    check, login, work = report.stages
    assert check.routes == [Route("check", "login", "logged_in eq false"), Route("check", "work", None)]
    assert login.routes == [Route("login", "work", None)]
    assert check.browser.login_check == login.browser.login_check      # the YAML anchor reused
    assert check.browser.login_check.selector == "#signed-in"
    assert login.verify == "login_check" and login.on_verify_fail == "login"
    assert work.browser.profile == "fixture" and work.browser.login_check is None


def test_injected_tool_finder_is_used(demo_policy):
    missing = tools.Tool("agent-browser", None, None, "not found here", "install it")
    report = validate_pipeline(EXAMPLE, policy_path=demo_policy, find_tools=lambda: [missing])
    assert [i.code for i in report.errors] == ["tool_missing"]
    assert str(report.errors[0]).startswith(f"{EXAMPLE}:30:5: stages[0].browser: agent-browser is not installed")
