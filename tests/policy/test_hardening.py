"""Policy hardening (issue 14): catch-all refusals, the private-address exemption of IP
patterns, report mode that keeps the hard checks, explain per port, the host:port helpers and
`policy validate` warnings. Tables; CLI cases run the command as a user does."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sfguard import policy
from sfguard.policy import PolicyError, compile_patterns, parse_policy

ROOT = Path(__file__).resolve().parents[2]


def sfguard(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


# --- catch-all patterns ------------------------------------------------------------------------

CATCH_ALLS = ["0.0.0.0/0", "0.0.0.0/1", "128.0.0.0/1", "0.0.0.0/7", "8.0.0.0/5", "::/0", "2000::/3",
              "2a00::/12", "::ffff:0:0/96", "[::/0]:443", "0.0.0.0/0:443"]
NOT_CATCH_ALLS = ["10.0.0.0/8", "93.0.0.0/8", "2001:db8::/32", "fd00::/8", "fc00::/7", "127.0.0.1",
                  "192.168.0.0/16"]


def _policy_with(field: str, pattern: str) -> str:
    if field == "private_networks.allow":
        return f'version: 1\nprivate_networks:\n  allow: ["{pattern}"]\n'
    return f'version: 1\n{field}: ["{pattern}"]\n'


@pytest.mark.parametrize("pattern", CATCH_ALLS)
@pytest.mark.parametrize("where", ["--allow", "allow_always", "private_networks.allow"])
def test_catch_all_refused_everywhere(where, pattern):
    if where == "private_networks.allow" and ":443" in pattern:
        pytest.skip("a port is refused there anyway")
    with pytest.raises(PolicyError) as info:
        if where == "--allow":
            compile_patterns([pattern])
        else:
            parse_policy(_policy_with(where, pattern), "t.yaml")
    text = str(info.value)
    assert "catch-all" in text and "hint:" in text, text


@pytest.mark.parametrize("pattern", NOT_CATCH_ALLS)
def test_narrow_ranges_still_accepted(pattern):
    compile_patterns([pattern])
    parse_policy(_policy_with("allow_always", pattern), "t.yaml")
    parse_policy(_policy_with("private_networks.allow", pattern), "t.yaml")


def test_catch_all_in_block_is_fine():
    # Blocking everything is safe; only allowing it is refused.
    site = parse_policy('version: 1\nblock:\n  - pattern: "0.0.0.0/0"\n    reason: all\n', "t.yaml")
    assert site.decide("93.184.216.34", 443).reason == "blocked_by_policy"


def test_catch_all_refused_by_the_proxy_cli():
    proc = sfguard("proxy", "--allow", "0.0.0.0/1,128.0.0.0/1")
    assert proc.returncode != 0
    assert "catch-all" in proc.stderr


# --- an IP pattern exempts nothing: only private_networks.allow opens a special address ------

# (allow pattern, address, decision reason after check_address) under a policy without consent
EXEMPTIONS = [
    ("127.0.0.1", "127.0.0.1", "reviewer_only_address"),
    ("127.0.0.0/8", "127.0.0.9", "reviewer_only_address"),
    ("10.1.0.0/16", "10.1.2.3", "reviewer_only_address"),
    ("::1", "::1", "reviewer_only_address"),
    ("fd00::/8", "fd00::5", "reviewer_only_address"),
    ("100.0.0.0/8", "100.64.0.1", "reviewer_only_address"),  # spans CGNAT and public space
    ("8.0.0.0/8", "8.8.8.8", "allowed_by_run"),                 # public: no consent needed
    ("2001:db8::/32", "2001:db8::1", "reviewer_only_address"),  # documentation block
]


@pytest.mark.parametrize("pattern,address,reason", EXEMPTIONS)
def test_ip_pattern_exempts_nothing(pattern, address, reason):
    site = parse_policy("version: 1\n", "t.yaml")
    d = site.decide(address, 443, compile_patterns([pattern]))
    assert site.check_address(d, address).reason == reason


def test_wide_pattern_in_block_of_its_own_does_not_open_loopback():
    site = parse_policy("version: 1\n", "t.yaml")
    assert not policy.engine.exempting_network(__import__("ipaddress").ip_network("0.0.0.0/1"))
    d = site.decide("127.0.0.1", 443, compile_patterns(["127.0.0.1"]))
    assert d.reason == "reviewer_only_address"


# --- report mode keeps the hard checks ------------------------------------------------------

REPORT = "version: 1\nmode: report\n"

# (HOST[:PORT] for explain, decision, reason)
REPORT_EXPLAIN = [
    ("169.254.169.254", "deny", "reviewer_only_address"),
    ("127.0.0.1", "deny", "reviewer_only_address"),
    ("[::1]:443", "deny", "reviewer_only_address"),
    ("10.0.0.1:80", "deny", "reviewer_only_address"),
    ("example.com:8443", "deny", "port_not_allowed"),
    ("0x7f.1", "deny", "malformed_host"),
    ("example.com:443", "allow", "would_deny:not_allowed"),
    ("93.184.216.34:443", "allow", "would_deny:not_allowed"),
]


@pytest.mark.parametrize("host,decision,reason", REPORT_EXPLAIN)
def test_explain_in_report_mode(tmp_path, host, decision, reason):
    path = tmp_path / "report.yaml"
    path.write_text(REPORT)
    proc = sfguard("policy", "explain", host, "--policy", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(g["decision"], g["reason"]) for g in got} == {(decision, reason)}, got


def test_report_mode_note_is_true(tmp_path):
    path = tmp_path / "report.yaml"
    path.write_text(REPORT)
    proc = sfguard("policy", "explain", "169.254.169.254", "--policy", str(path))
    assert "DENY (reviewer_only_address)" in proc.stdout
    assert "every other check still denies" in proc.stdout


# --- explain without a port -------------------------------------------------------------------

PORT_POLICY = """\
version: 1
block:
  - pattern: docs.python.org:443
    reason: only https
allow_always:
  - docs.python.org
  - example.org
"""

# (argument, [(port, decision, reason)])
EXPLAIN_PORTS = [
    ("docs.python.org", [(80, "allow", "allowed_by_policy"), (443, "deny", "blocked_by_policy")]),
    ("docs.python.org:443", [(443, "deny", "blocked_by_policy")]),
    ("docs.python.org:80", [(80, "allow", "allowed_by_policy")]),
    ("example.org", [(None, "allow", "allowed_by_policy")]),
    ("elsewhere.test", [(None, "deny", "not_allowed")]),
]


@pytest.mark.parametrize("arg,expected", EXPLAIN_PORTS)
def test_explain_each_default_port_when_they_differ(tmp_path, arg, expected):
    path = tmp_path / "p.yaml"
    path.write_text(PORT_POLICY)
    proc = sfguard("policy", "explain", arg, "--policy", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(g["port"], g["decision"], g["reason"]) for g in got] == expected
    human = sfguard("policy", "explain", arg, "--policy", str(path)).stdout
    for port, decision, _ in expected:
        assert f"decision:   {decision.upper()}" in human
        if port is not None and ":" not in arg:
            assert f"port:       {port}" in human


# --- one host:port join, one allow pattern for a URL -----------------------------------------

JOINS = [
    ("example.com", 443, "example.com:443"),
    ("::1", 8080, "[::1]:8080"),
    ("[::1]", 8080, "[::1]:8080"),
    ("2001:db8::1", None, "2001:db8::1"),
    ("127.0.0.1", 80, "127.0.0.1:80"),
]


@pytest.mark.parametrize("host,port,text", JOINS)
def test_join_host_port(host, port, text):
    assert policy.join_host_port(host, port) == text
    if port is not None:
        assert policy.split_host_port(text) == (policy.normalize_host(host), port)


URL_PATTERNS = [
    ("http://[::1]:8080/account", "[::1]:8080", ("::1", 8080)),
    ("https://Example.COM/login?x=1", "example.com", ("example.com", 443)),
    ("http://127.0.0.1:9000/", "127.0.0.1:9000", ("127.0.0.1", 9000)),
    ("http://[::ffff:127.0.0.1]/", "127.0.0.1", ("127.0.0.1", 80)),
    ("http://b\u00fccher.example:8443/", "xn--bcher-kva.example:8443", ("xn--bcher-kva.example", 8443)),
]


@pytest.mark.parametrize("url,pattern,target", URL_PATTERNS)
def test_allow_pattern_for_url_allows_exactly_that_url(url, pattern, target):
    assert policy.allow_pattern_for_url(url) == pattern
    site = parse_policy("version: 1\nprivate_networks:\n  allow: [127.0.0.1, \"::1\"]\n", "t.yaml")
    d = site.decide(target[0], target[1], compile_patterns([pattern]))
    assert d.allowed and d.reason == "allowed_by_run", d.explanation


@pytest.mark.parametrize("url", ["ftp://a.com/", "a.com", "http:///x", "http://a.com:99999/",
                                 "http://0x7f.1/"])
def test_allow_pattern_for_url_refuses(url):
    with pytest.raises(policy.MalformedHost):
        policy.allow_pattern_for_url(url)


# --- validate warnings --------------------------------------------------------------------

LINT_POLICY = """\
version: 1
block:
  - pattern: docs.python.org:443
    reason: only http
  - reason: feed
    patterns: [bad.example, evil.example, BAD.example]
allow_always:
  - docs.python.org
  - "*.example.org"
  - "*.example.org"
  - evil.example
  - fine.example
quiet: [a.com, a.com]
private_networks:
  allow: [10.0.0.0/8, "10.0.0.0/8"]
"""

# (field, words in the message)
LINT_EXPECTED = [
    ("block[1].patterns[2]", "duplicate entry"),
    ("allow_always[0]", "shadowed by block rule"),
    ("allow_always[2]", "duplicate entry"),
    ("allow_always[3]", "shadowed by block rule"),
    ("quiet[1]", "duplicate entry"),
    ("private_networks.allow[1]", "duplicate entry"),
]


def test_validate_warns_and_exits_0(tmp_path):
    path = tmp_path / "lint.yaml"
    path.write_text(LINT_POLICY)
    proc = sfguard("policy", "validate", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == len(LINT_EXPECTED), proc.stdout
    for field, words in LINT_EXPECTED:
        assert any(f": {field}: " in w and words in w for w in warnings), (field, proc.stdout)
    assert "6 warnings" in proc.stdout
    assert "fine.example" not in proc.stdout


def test_validate_strict_makes_warnings_errors(tmp_path):
    path = tmp_path / "lint.yaml"
    path.write_text(LINT_POLICY)
    proc = sfguard("policy", "validate", "--strict", str(path))
    assert proc.returncode == 1
    assert sum(line.startswith("error: ") for line in proc.stdout.splitlines()) == len(LINT_EXPECTED)


def test_validate_strict_passes_a_clean_policy(tmp_path):
    path = tmp_path / "clean.yaml"
    path.write_text("version: 1\nallow_always: [docs.python.org]\n")
    proc = sfguard("policy", "validate", "--strict", str(path))
    assert proc.returncode == 0 and "warning" not in proc.stdout
    assert sfguard("policy", "validate", "--strict").returncode == 0  # the shipped policy
