"""`sfguard validate`: run as a subprocess on fixture pipelines; each fixture lists what it
must produce in `# expect: FILE:LINE:COL: PATH: TEXT` comments (TEXT is a substring of the
message). Every printed finding must be expected and every expectation printed."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "cases"
EXAMPLE = ROOT / "supervisor" / "demo" / "login-pipeline.yaml"
FINDING = re.compile(r"^(\S+?:\d+:\d+: \S+): (.*)$")


def sfguard(*args: str, cwd: Path = CASES, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", "validate", *args], cwd=cwd,
                          env=full, capture_output=True, text=True, timeout=120)


def expectations(name: str) -> list[tuple[str, str]]:
    out = []
    for line in (CASES / name).read_text().splitlines():
        if line.startswith("# expect: "):
            m = FINDING.match(line[len("# expect: "):])
            assert m, f"bad expectation in {name}: {line}"
            out.append((m.group(1), m.group(2)))
    return out


ERROR_CASES = sorted(p.name for p in CASES.glob("*.yaml") if expectations(p.name))


@pytest.mark.parametrize("name", ERROR_CASES)
def test_each_error_kind_is_reported_at_its_line(name):
    expected = expectations(name)
    res = sfguard(name)
    printed = res.stdout.splitlines()
    unmatched = list(printed)
    for where, text in expected:
        hits = [p for p in unmatched if p.startswith(where + ": ") and text in p]
        assert hits, f"expected {where}: ...{text}... in\n{res.stdout}"
        unmatched.remove(hits[0])
    assert unmatched == [], f"unexpected findings: {unmatched}"
    errors = [e for e in expected if not e[1].startswith("warning:")]
    assert res.returncode == (1 if errors else 0), res.stderr
    assert f"{len(errors)} error(s)" in res.stderr


def test_valid_pipeline_exits_0_with_a_summary():
    res = sfguard("valid.yaml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == ""
    assert "valid.yaml: valid (2 stages, 1 with a browser)" in res.stderr


def test_the_example_pipeline_is_valid(tmp_path):
    from sfguard.supervisor.demo.run import write_demo_policy
    demo = write_demo_policy(tmp_path / "sites.yaml", 8080)   # consents to 127.0.0.1
    res = sfguard(str(EXAMPLE.relative_to(ROOT)), "--policy", str(demo), cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    # its only warnings: on a machine without a display, its headed stages (issue 35)
    assert all("warning: headed: true needs a display" in l for l in res.stdout.splitlines())
    assert "valid (3 stages, 3 with a browser" in res.stderr
    # without the reviewer's consent its fixture site on 127.0.0.1 is refused, at each entry
    res = sfguard(str(EXAMPLE.relative_to(ROOT)), "--no-tool-check", "--policy",
                  "policy/sites.yaml", cwd=ROOT)
    assert res.returncode == 1
    refused = [line for line in res.stdout.splitlines() if "[reviewer_only_address]" in line]
    assert len(refused) == 3, res.stdout
    # and the check page on 127.0.0.1: no advice to add it to allow_domains (that cannot help)
    checks = [line for line in res.stdout.splitlines() if "login_check.url" in line]
    assert len(checks) == 2 and all("only the security reviewer can" in c for c in checks)
    assert "to allow_domains" not in res.stdout


def test_the_example_uses_topology_a_and_only_the_fixture_site():
    import yaml
    data = yaml.safe_load(EXAMPLE.read_text())
    stages = {s["id"]: s for s in data["stages"]}
    assert list(stages) == ["check", "login", "work"]
    assert stages["check"]["next"] == [{"to": "login", "if": "logged_in eq false"}, {"to": "work"}]
    assert stages["login"]["next"] == ["work"]
    assert stages["login"]["gate"]["handoff"]["kind"] == "local_window"
    assert stages["login"]["verify"] == "login_check" and stages["login"]["on_verify_fail"] == "login"
    hosts = set(re.findall(r"https?://([^/\s\"']+)", EXAMPLE.read_text()))
    assert hosts == {"127.0.0.1:8080"}
    for s in stages.values():
        assert s["browser"]["allow_domains"] == ["127.0.0.1:8080"]


@pytest.mark.parametrize("env,tool", [
    ({"SFGUARD_AGENT_BROWSER": "/nonexistent/agent-browser"}, "agent-browser"),
    ({"SFGUARD_BROWSER": "no-such-browser-sfguard"}, "browser"),
])
def test_a_missing_tool_is_an_error_at_the_first_browser_field(env, tool):
    res = sfguard("valid.yaml", env=env)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [
        line for line in res.stdout.splitlines()
        if line.startswith(f"valid.yaml:6:5: stages[0].browser: {tool} is not installed on this machine")]
    assert len(res.stdout.splitlines()) == 1
    # --no-tool-check is for validating on a machine that will not run the pipeline
    assert sfguard("valid.yaml", "--no-tool-check", env=env).returncode == 0


def test_a_pipeline_without_browser_stages_needs_no_tools(tmp_path):
    (tmp_path / "p.yaml").write_text("stages:\n  - id: a\n    prompt: hi\n")
    res = sfguard("p.yaml", cwd=tmp_path, env={"SFGUARD_AGENT_BROWSER": "/nonexistent"})
    assert res.returncode == 0 and "valid (1 stages, 0 with a browser)" in res.stderr


def test_policy_option_blocks_and_report_mode_warns(tmp_path):
    block = tmp_path / "block.yaml"
    block.write_text("version: 1\nmode: enforce\nblock:\n  - pattern: \"*.example.com\"\n"
                     "    reason: \"no examples\"\nprivate_networks:\n  allow: [127.0.0.1/32]\n")
    res = sfguard("valid.yaml", "--policy", str(block))
    assert res.returncode == 1
    assert res.stdout.startswith("valid.yaml:7:41: stages[0].browser.allow_domains[1]: "
                                 "'*.example.com' is blocked by the site policy (block.yaml:4")
    report = tmp_path / "report.yaml"
    report.write_text(block.read_text().replace("enforce", "report"))
    res = sfguard("valid.yaml", "--policy", str(report))
    assert res.returncode == 0, res.stdout
    assert "stages[0].browser.allow_domains[1]: warning: '*.example.com' is blocked" in res.stdout


@pytest.mark.parametrize("args,needle", [
    (["no-such-pipeline.yaml"], "cannot read the pipeline"),
    (["valid.yaml", "--policy", "no-such-policy.yaml"], "site policy is invalid"),
])
def test_unusable_input_exits_2(args, needle):
    res = sfguard(*args)
    assert res.returncode == 2
    assert needle in res.stdout + res.stderr


@pytest.mark.parametrize("text,where,needle", [
    ("", "p.yaml: (top)", "empty"),
    ("- a\n- b\n", "p.yaml:1:1: ", "must be a mapping"),
    ("stages: []\n", "p.yaml:1:9: stages", "non-empty list"),
    ("name: x\n", "p.yaml:1:1: stages", "missing required key 'stages'"),
    ("stages:\n  - prompt: x\n", "p.yaml:2:5: stages[0].id", "missing required key 'id'"),
    ("stages:\n  - id: ../x\n", "p.yaml:2:9: stages[0].id", "not valid"),
    ("stages:\n  - id: a\n  - id: a\n", "p.yaml:3:5: stages[1].id", "duplicate stage id 'a'"),
    ("stages:\n  - id: a\n    browser: fixture\n", "p.yaml:3:14: stages[0].browser", "must be a mapping"),
    ("stages:\n  - id: a\n    browser:\n      <<: {profile: a}\n      profile: b\n",
     "p.yaml:5:7: stages[0].browser.profile", "duplicate key 'profile'"),
])
def test_shape_errors(tmp_path, text, where, needle):
    (tmp_path / "p.yaml").write_text(text)
    res = sfguard("p.yaml", "--no-tool-check", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert any(line.startswith(where) and needle in line for line in res.stdout.splitlines()), res.stdout
