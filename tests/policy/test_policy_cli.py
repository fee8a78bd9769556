"""`sfguard policy validate|explain` as a user runs them: a subprocess, its output and exit status."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BROKEN = Path(__file__).resolve().parent / "broken"
SHIPPED = ROOT / "policy" / "sites.yaml"


def sfguard(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr, proc.stderr
    return proc


def shipped_line(text: str) -> int:
    return next(i for i, line in enumerate(SHIPPED.read_text().splitlines(), 1) if text in line)


def test_validate_shipped_policy():
    proc = sfguard("policy", "validate")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid" in proc.stdout and "mode enforce" in proc.stdout
    assert "2 block" in proc.stdout and "7 quiet" in proc.stdout and "tab_quota 8" in proc.stdout


def test_validate_a_good_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text('version: 1\nmode: report\nallow_always: ["*.example.com", docs.python.org]\n')
    proc = sfguard("policy", "validate", str(path))
    assert proc.returncode == 0
    assert "mode report" in proc.stdout and "2 allow_always" in proc.stdout


@pytest.mark.parametrize("name,expected", [
    ("unknown_key.yaml",
     ["unknown_key.yaml:3:1: alow_always: unknown key 'alow_always' (hint: did you mean 'allow_always'?)"]),
    ("leading_dot.yaml",
     ["leading_dot.yaml:4:5: allow_always[1]: a pattern cannot start with a dot", "write *.example.com"]),
    ("port_range.yaml", ["port_range.yaml:2:18: ports[2]:", "hint: ports are 1-65535"]),
    ("block_no_reason.yaml", ["block_no_reason.yaml:5:5: block[1].reason: 'reason' is required"]),
    ("yaml_syntax.yaml", ["yaml_syntax.yaml:3:5: (yaml): not valid YAML"]),
    ("alias_bomb.yaml", ["alias_bomb.yaml:2:4: (yaml): YAML anchors (&a) are not allowed"]),
    ("unquoted_star.yaml", ["unquoted_star.yaml:3:14:", 'quoted: "*.example.com"']),
    ("many_errors.yaml", ["many_errors.yaml:2:7: mode:", "many_errors.yaml:3:9: ports[0]:",
                          "many_errors.yaml:5:5: allow_always[0]:", "many_errors.yaml:7:5: block[0].reason:",
                          "many_errors.yaml:8:1: extra:"]),
])
def test_validate_broken_files(name, expected):
    proc = sfguard("policy", "validate", str(BROKEN / name))
    assert proc.returncode == 1
    for text in expected:
        assert text in proc.stdout, proc.stdout
    assert "not valid" in proc.stderr


def test_validate_missing_file(tmp_path):
    """A file that cannot be read is an input error (2), as for `sfguard validate`."""
    proc = sfguard("policy", "validate", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert "cannot read the file" in proc.stderr


def test_explain_human_output():
    proc = sfguard("policy", "explain", "www.LinkedIn.com:443", "a.example.com", "0x7f.1",
                   "--allow", "*.example.com")
    assert proc.returncode == 0, proc.stderr
    blocks = proc.stdout.strip().split("\n\n")
    assert len(blocks) == 3
    assert "normalised: www.linkedin.com" in blocks[0]
    assert "DENY (blocked_by_policy)" in blocks[0]
    assert f"rule:       sites.yaml:{shipped_line('*.linkedin.com')} *.linkedin.com" in blocks[0]
    assert "ALLOW (allowed_by_run)" in blocks[1]
    assert "rule:       --allow *.example.com" in blocks[1]
    assert "the proxy still checks the addresses it resolves to" in blocks[1]
    assert "DENY (malformed_host)" in blocks[2] and "(malformed)" in blocks[2]


def test_explain_json_lines(tmp_path):
    proc = sfguard("policy", "explain", "www.linkedin.com", "[2606:4700::1]:8080", "api.example.com:8443",
                   "user:pw@example.com", "--allow", "*.example.com,[2606:4700::1]:8080", "--allow",
                   "api.example.com:8443", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    keys = {"host", "port", "normalized_host", "decision", "reason", "rule"}
    assert all(keys <= set(r) for r in rows)
    got = [(r["normalized_host"], r["port"], r["decision"], r["reason"], r["rule"]) for r in rows]
    assert got == [
        ("www.linkedin.com", None, "deny", "blocked_by_policy",
         f"sites.yaml:{shipped_line('*.linkedin.com')} *.linkedin.com"),
        ("2606:4700::1", 8080, "allow", "allowed_by_run", "--allow [2606:4700::1]:8080"),
        ("api.example.com", 8443, "allow", "allowed_by_run", "--allow api.example.com:8443"),
        (None, None, "deny", "malformed_host", None),
    ]
    assert "pw" not in proc.stdout  # user info is redacted


def test_explain_ip_literal_gets_the_address_check():
    proc = sfguard("policy", "explain", "169.254.169.254", "--allow", "*.example.com", "--json")
    row = json.loads(proc.stdout)
    assert (row["decision"], row["reason"]) == ("deny", "reviewer_only_address")
    # no allow pattern of a run opens it (tests/policy/test_special_addresses.py)
    proc = sfguard("policy", "explain", "169.254.169.254", "--allow", "169.254.0.0/16", "--json")
    row = json.loads(proc.stdout)
    assert (row["decision"], row["reason"]) == ("deny", "reviewer_only_address")
    proc = sfguard("policy", "explain", "2606:4700::1", "--allow", "2606:4700::/32", "--json")
    row = json.loads(proc.stdout)
    assert (row["decision"], row["reason"], row["allowed_by_ip"]) == ("allow", "allowed_by_run", True)


def test_explain_with_policy_file_in_report_mode(tmp_path):
    path = tmp_path / "review.yaml"
    path.write_text('version: 1\nmode: report\nblock:\n  - pattern: "*.evil.example"\n    reason: phishing\n')
    proc = sfguard("policy", "explain", "a.evil.example", "--policy", str(path), "--json")
    row = json.loads(proc.stdout)
    assert (row["decision"], row["reason"], row["rule"]) == ("allow", "would_deny:blocked_by_policy",
                                                            "review.yaml:4 *.evil.example")
    # a name that passes only as would_deny still meets the address check (localhost resolves
    # to loopback, which the proxy refuses in every mode): the human answer says so
    proc = sfguard("policy", "explain", "localhost", "--policy", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "ALLOW (would_deny:not_allowed)" in proc.stdout
    assert "the proxy still checks the addresses it resolves to" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--allow", "*"], "bad --allow pattern"),
    (["--allow", "*.com"], "public suffix com"),
    (["--allow", ","], "--allow needs at least one pattern"),
    (["--policy", "/nonexistent/sites.yaml"], "cannot read the file"),
    (["--policy", str(BROKEN / "unknown_key.yaml")], "unknown_key.yaml:3:1: alow_always"),
])
def test_explain_bad_arguments(args, message):
    proc = sfguard("policy", "explain", "example.com", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args", [["policy", "explain"], ["policy"], ["policy", "frobnicate"],
                                  ["policy", "explain", "a.com", "--bogus"]])
def test_usage_errors(args):
    proc = sfguard(*args)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr


def test_explain_malformed_port_is_a_denial_not_an_error():
    proc = sfguard("policy", "explain", "example.com:99999", "--json")
    assert proc.returncode == 0
    row = json.loads(proc.stdout)
    assert (row["decision"], row["reason"]) == ("deny", "malformed_host")
    assert "out of range" in row["explanation"]
