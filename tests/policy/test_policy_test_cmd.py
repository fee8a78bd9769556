"""`sfguard policy test|replay|diff` as a reviewer runs them in CI: subprocesses on fixture
files (tests/policy/cases), their output lines and exit codes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "cases"
SHIPPED_CASES = ROOT / "policy" / "tests"


def sfguard(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, input=stdin)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr, proc.stderr
    return proc


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_shipped_policy_cases_pass():
    """policy/tests/ holds the cases for the shipped policy/sites.yaml; they must all pass."""
    files = sorted(SHIPPED_CASES.glob("*.yaml"))
    assert files
    proc = sfguard("policy", "test", *map(str, files))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith(" passed, 0 failed")
    assert int(proc.stdout.split()[-4]) >= 20


def test_shipped_cases_fail_against_a_policy_without_the_block_list(tmp_path):
    """The shipped cases can fail: a policy that drops the LinkedIn block is caught."""
    weak = tmp_path / "weak.yaml"
    weak.write_text("version: 1\n")
    proc = sfguard("policy", "test", str(SHIPPED_CASES / "sites.yaml"), "--policy", str(weak))
    assert proc.returncode == 1
    assert "www.linkedin.com: expected deny (blocked_by_policy), got deny (not_allowed)" in proc.stdout


def test_failing_cases_name_their_file_and_line():
    proc = sfguard("policy", "test", rel(CASES / "failing.yaml"))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines == [
        "tests/policy/cases/failing.yaml:4: example.org [a host nobody allowed]: expected allow, "
        "got deny (not_allowed)",
        "tests/policy/cases/failing.yaml:7: example.com:8443: expected deny (not_allowed), "
        "got deny (port_not_allowed)",
        "1 passed, 2 failed",
    ]


def test_passing_file_uses_its_own_policy_entry():
    proc = sfguard("policy", "test", rel(CASES / "passing.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "3 passed, 0 failed"
    # the same cases under the shipped policy: docs.python.org and the block do not hold there
    proc = sfguard("policy", "test", rel(CASES / "passing.yaml"), "--policy", "policy/sites.yaml")
    assert proc.returncode == 1
    assert "2 failed" in proc.stdout


def test_json_lists_every_result():
    proc = sfguard("policy", "test", rel(CASES / "failing.yaml"), rel(CASES / "passing.yaml"), "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert (out["passed"], out["failed"]) == (4, 2)
    bad = [(r["file"], r["line"], r["reason"]) for r in out["results"] if not r["ok"]]
    assert bad == [("tests/policy/cases/failing.yaml", 4, "not_allowed"),
                   ("tests/policy/cases/failing.yaml", 7, "port_not_allowed")]


def test_unusable_case_file_exits_2_with_every_problem_sorted_by_line():
    proc = sfguard("policy", "test", rel(CASES / "unusable.yaml"))
    assert proc.returncode == 2
    problems = [l for l in proc.stderr.splitlines() if l.startswith("tests/")]
    assert [p.split(":")[1] for p in problems] == ["2", "3", "4", "6", "8"]
    text = proc.stderr
    assert "cases[0].expct: unknown key (did you mean 'expect'?)" in text
    assert 'quote it: host: "12345"' in text
    assert "cases[2].expect: required, allow or deny (got 'maybe')" in text
    assert "cases[3].allow: a bare * would match every host" in text


@pytest.mark.parametrize("args,needle", [
    (["policy", "test", "tests/policy/cases/no-such.yaml"], "no such file"),
    (["policy", "test", "tests/policy/cases"], "is a folder"),
    (["policy", "test", "tests/policy/cases/passing.yaml", "--policy", "tests/policy/broken/many_errors.yaml"],
     "is not valid"),
    (["policy", "replay", "tests/policy/cases/failing.yaml", "--policy", "policy/sites.yaml"],
     "no decision records"),
    (["policy", "replay", "tests/policy/cases/decisions.jsonl", "--policy", "nope.yaml"], "is not valid"),
    (["policy", "replay", "tests/policy/cases/decisions.jsonl", "--policy", "policy/sites.yaml",
      "--allow", "*"], "bad --allow pattern"),
    (["policy", "diff", "policy/sites.yaml", "nope.yaml"], "is not valid"),
])
def test_unusable_input_exits_2(args, needle):
    proc = sfguard(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr


def test_empty_case_list_is_not_a_pass(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("cases: []\n")
    proc = sfguard("policy", "test", str(f))
    assert proc.returncode == 2
    assert "no cases" in proc.stderr


def test_replay_lists_what_would_change_per_host():
    proc = sfguard("policy", "replay", rel(CASES / "decisions.jsonl"), "--policy", rel(CASES / "candidate.yaml"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["allow->deny", "www.example.com:443", "x1", "allowed_by_run", "->",
                                "blocked_by_policy"]
    assert lines[1].split() == ["deny->allow", "docs.python.org:443", "x2", "not_allowed", "->",
                                "allowed_by_policy"]
    # 6 lines + 3 quiet denials = 9; the SNI refusal is kept; the private address still refused
    assert ("9 request(s) replayed" in lines[2] and "1 allow->deny, 2 deny->allow, 0 reason changed, "
            "5 unchanged, 1 kept" in lines[2])
    assert "1 line(s) skipped (first: line 8, not JSON)" in proc.stderr


def test_replay_json_and_exit_code_and_stdin():
    log = (CASES / "decisions.jsonl").read_text()
    proc = sfguard("policy", "replay", "-", "--policy", rel(CASES / "candidate.yaml"), "--json",
                   "--exit-code", stdin=log)
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["counts"] == {"allow->deny": 1, "deny->allow": 2, "reason": 0}
    assert {(c["host"], c["change"], c["count"]) for c in out["changes"]} == {
        ("www.example.com", "allow->deny", 1), ("docs.python.org", "deny->allow", 2)}
    # the shipped policy decides this traffic as logged: nothing changes, exit 0
    same = sfguard("policy", "replay", "-", "--policy", "policy/sites.yaml", "--exit-code", stdin=log)
    assert same.returncode == 0, same.stdout
    assert "0 allow->deny, 0 deny->allow, 0 reason changed" in same.stdout


def test_diff_shows_changed_rules_and_their_effect():
    proc = sfguard("policy", "diff", "policy/sites.yaml", rel(CASES / "candidate.yaml"),
                   "--log", rel(CASES / "decisions.jsonl"))
    assert proc.returncode == 1
    out = proc.stdout
    assert "+ allow_always: docs.python.org  [tests/policy/cases/candidate.yaml:2]" in out
    assert "+ block: www.example.com  (the old shop)  [tests/policy/cases/candidate.yaml:4]" in out
    assert "- block: *.linkedin.com" in out and "[policy/sites.yaml:" in out
    assert "- quiet: *.gstatic.com" in out
    assert "mode:" not in out     # both enforce (the candidate by default)
    assert "(policy/sites.yaml -> tests/policy/cases/candidate.yaml): 1 allow->deny, 2 deny->allow" in out


def test_diff_of_equal_policies_exits_0(tmp_path):
    copy = tmp_path / "copy.yaml"
    copy.write_text((ROOT / "policy" / "sites.yaml").read_text())
    proc = sfguard("policy", "diff", "policy/sites.yaml", str(copy), "--json")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == {"rules": []}
    reordered = tmp_path / "reordered.yaml"
    reordered.write_text("version: 1\nmode: report\nports: [443, 80, 8443]\n")
    proc = sfguard("policy", "diff", "policy/sites.yaml", str(reordered), "--json")
    rules = {(r["section"], r["op"], r["entry"]) for r in json.loads(proc.stdout)["rules"]}
    assert ("mode", "~", "enforce -> report") in rules
    assert ("ports", "+", "8443") in rules
    assert not any(r[0] == "ports" and r[2] in ("80", "443") for r in rules)


@pytest.mark.parametrize("hosts,code", [
    (["example.com", "--allow", "example.com"], 0),
    (["example.com", "www.linkedin.com", "--allow", "example.com"], 1),
    (["example.com"], 1),
])
def test_explain_exit_code(hosts, code):
    proc = sfguard("policy", "explain", *hosts, "--exit-code")
    assert proc.returncode == code, proc.stdout
    without = sfguard("policy", "explain", *hosts)
    assert without.returncode == 0


def test_explain_reads_hosts_from_stdin():
    proc = sfguard("policy", "explain", "-", "--json", "--exit-code", "--allow", "*.example.com",
                   stdin="# a comment\na.example.com\n\nwww.linkedin.com:443\n")
    assert proc.returncode == 1
    got = [(d["normalized_host"], d["decision"]) for d in map(json.loads, proc.stdout.splitlines())]
    assert got == [("a.example.com", "allow"), ("www.linkedin.com", "deny")]
    assert sfguard("policy", "explain", "-", stdin="\n").returncode == 2
    assert sfguard("policy", "explain", "-", "a.com").returncode == 2


def test_policy_validate_json_and_policy_option():
    proc = sfguard("policy", "validate", "--policy", "tests/policy/broken/many_errors.yaml", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["valid"] is False
    assert [(e["line"], e["field"]) for e in out["errors"]][:2] == [(2, "mode"), (3, "ports[0]")]
    ok = json.loads(sfguard("policy", "validate", "--json").stdout)
    assert ok["valid"] is True and ok["summary"]["block"] == 2
    assert sfguard("policy", "validate", "--policy", "policy/sites.yaml").returncode == 0
    assert sfguard("policy", "validate", "a.yaml", "--policy", "b.yaml").returncode == 2
