"""The `writes` section of sites.yaml (policy/writes.py): floors per site, requests that only
read although they POST, GETs that write, the stricter of stage and site, the stage shell's
refusal, and the reviewer's tools (`policy explain --method`, `policy test` with expect_write)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sfguard.policy import parse_policy
from sfguard.policy.writes import SHELL_REFUSAL, effective, shell_verdict

ROOT = Path(__file__).resolve().parents[2]

POLICY = """\
version: 1
writes:
  - pattern: "*.bank.example"
    mode: gate
    reason: "payments need a person"
    reads:
      - "POST /search"
      - "POST /api/**/graphql"
    writes:
      - "GET /logout"
      - "GET /api/*/delete"
  - patterns: ["shop.example", "10.0.0.0/8"]
    mode: deny
    reason: "no buying"
  - pattern: "news.example"
    reason: "reading is fine; signing out is a write"
    writes:
      - "GET /signout"
  - pattern: "pay.bank.example"
    mode: deny
    reason: "never pay"
"""


@pytest.fixture(scope="module")
def rules():
    return parse_policy(POLICY, "sites.yaml").writes


# host, method, path, stage mode -> write?, effective mode, reason, rule line
CASES = [
    # a floor holds every write of its site, whatever the stage asks
    ("www.bank.example", "POST", "/pay", "allow", True, "gate", "site_floor", 3),
    ("bank.example", "PUT", "/x", "allow", True, "gate", "site_floor", 3),
    ("www.bank.example", "DELETE", "/x", "deny", True, "deny", "stage_mode", None),
    # requests the reviewers name reads pass, even under a deny stage
    ("www.bank.example", "POST", "/search", "deny", False, "allow", "site_read", 7),
    ("www.bank.example", "POST", "/api/v1/x/graphql", "gate", False, "allow", "site_read", 8),
    ("www.bank.example", "POST", "/search/more", "allow", True, "gate", "site_floor", 3),
    ("www.bank.example", "PATCH", "/search", "allow", True, "gate", "site_floor", 3),
    # GETs the reviewers name writes, at the site's floor or the stage's mode
    ("www.bank.example", "GET", "/logout", "allow", True, "gate", "site_write_get", 10),
    ("www.bank.example", "GET", "/api/7/delete", "allow", True, "gate", "site_write_get", 11),
    ("www.bank.example", "GET", "/api/7/8/delete", "allow", False, "allow", "read_method", None),
    ("news.example", "GET", "/signout", "allow", True, "allow", "site_write_get", 18),
    ("news.example", "GET", "/signout", "gate", True, "gate", "stage_mode", None),
    ("news.example", "POST", "/comment", "allow", True, "allow", "write_method", None),
    # the strictest floor of every entry that matches
    ("pay.bank.example", "POST", "/", "allow", True, "deny", "site_floor", 19),
    ("pay.bank.example", "POST", "/search", "allow", False, "allow", "site_read", 7),
    # a pattern list and an address range
    ("shop.example", "POST", "/cart", "allow", True, "deny", "site_floor", 12),
    ("10.9.8.7", "POST", "/", "gate", True, "deny", "site_floor", 12),
    # no entry: the method decides, the stage's mode applies
    ("other.example", "POST", "/", "allow", True, "allow", "write_method", None),
    ("other.example", "POST", "/", "gate", True, "gate", "stage_mode", None),
    ("other.example", "GET", "/delete", "deny", False, "allow", "read_method", None),
    ("other.example", "HEAD", "/", "deny", False, "allow", "read_method", None),
    ("shop.example", "GET", "/cart", "deny", False, "allow", "read_method", None),
]


@pytest.mark.parametrize("host, method, path, stage, write, mode, reason, line", CASES)
def test_verdicts(rules, host, method, path, stage, write, mode, reason, line):
    v = effective(stage, rules.judge(host, method, path))
    assert (v.write, v.mode, v.reason, v.line) == (write, mode, reason, line)
    if line is not None:
        assert v.rule is not None and v.rule.startswith(f"sites.yaml:{line} writes ")
    assert v.explanation


def test_websocket_and_preflight(rules):
    assert effective("allow", rules.judge("www.bank.example", "GET", "/ws", websocket=True)).mode == "gate"
    assert effective("allow", rules.judge("other.example", "GET", "/ws", websocket=True)).write
    v = rules.judge("www.bank.example", "OPTIONS", "/pay", preflight=True)
    assert (v.write, v.reason) == (False, "cors_preflight")
    assert rules.judge("www.bank.example", "OPTIONS", "/pay").mode == "gate"


@pytest.mark.parametrize("host, stage, refused", [
    ("www.bank.example", "allow", True),       # the site's floor: the shell cannot reach it
    ("shop.example", "allow", True),
    ("news.example", "allow", False),          # a floor of allow: the shell may
    ("other.example", "allow", False),
    ("other.example", "gate", True),           # the stage's own mode
    ("other.example", "deny", True),
])
def test_shell_refusal(rules, host, stage, refused):
    v = shell_verdict(rules, stage, host, 443)
    assert (v is not None) == refused
    if v is not None:
        assert v.reason == SHELL_REFUSAL and "shell" in v.explanation


def test_no_section_means_methods_decide():
    rules = parse_policy("version: 1\n").writes
    assert len(rules) == 0 and not rules.guarded()
    assert effective("allow", rules.judge("a.example", "POST", "/")).mode == "allow"
    assert shell_verdict(rules, "allow", "a.example", 443) is None


def test_the_shipped_policy_has_an_empty_writes_section_and_a_commented_example():
    text = (ROOT / "policy" / "sites.yaml").read_text()
    assert "writes: []" in text and "#   - pattern:" in text.split("writes: []")[0].rsplit("# WRITE", 1)[-1]


def sfguard(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_explain_with_a_method_names_the_write_rule(tmp_path):
    (tmp_path / "sites.yaml").write_text(POLICY)
    proc = sfguard("policy", "explain", "www.bank.example:443", "--allow", "*.bank.example",
                   "--method", "post", "--path", "/pay?amount=5", "--policy", str(tmp_path / "sites.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "write gate: WRITE, HELD for a person (site_floor)" in proc.stdout
    assert "write rule: sites.yaml:3 writes *.bank.example" in proc.stdout
    proc = sfguard("policy", "explain", "www.bank.example:443", "--allow", "*.bank.example", "--json",
                   "--method", "GET", "--path", "/logout", "--writes", "deny",
                   "--policy", str(tmp_path / "sites.yaml"))
    write = json.loads(proc.stdout)["write"]
    assert (write["write"], write["mode"], write["reason"]) == (True, "deny", "stage_mode")
    # a listed GET in a spelling the server routes to it: caught, with the entry that names it
    proc = sfguard("policy", "explain", "news.example", "--allow", "news.example", "--json",
                   "--method", "GET", "--path", "/%73ignout/", "--policy", str(tmp_path / "sites.yaml"))
    write = json.loads(proc.stdout)["write"]
    assert (write["write"], write["reason"], write["line"]) == (True, "site_write_get", 18), write
    # a denied host has no write verdict: nothing is sent at all
    proc = sfguard("policy", "explain", "www.bank.example:443", "--json", "--method", "POST",
                   "--policy", str(tmp_path / "sites.yaml"))
    assert "write" not in json.loads(proc.stdout)


def test_policy_test_checks_expect_write(tmp_path):
    (tmp_path / "sites.yaml").write_text(POLICY)
    (tmp_path / "cases.yaml").write_text("""\
policy: sites.yaml
cases:
  - {host: www.bank.example, allow: "*.bank.example", expect: allow, method: POST, path: /pay, expect_write: gate}
  - {host: www.bank.example, allow: "*.bank.example", expect: allow, method: POST, path: /search, expect_write: read}
  - {host: news.example, allow: news.example, expect: allow, method: GET, path: /signout,
     writes: deny, expect_write: deny}
  - {host: shop.example, allow: shop.example, expect: allow, method: POST, expect_write: allow, name: loosened}
  - {host: news.example, allow: news.example, expect: allow, method: GET, path: "/signout;x", writes: gate,
     expect_write: gate, name: a listed GET as the server routes it}
""")
    proc = sfguard("policy", "test", str(tmp_path / "cases.yaml"))
    assert proc.returncode == 1
    assert "4 passed, 1 failed" in proc.stdout + proc.stderr
    assert "cases.yaml:7: shop.example [loosened]: expected allow, POST / allow" in proc.stdout + proc.stderr
    assert "POST / deny (site_floor, rule sites.yaml:12 writes shop.example, 10.0.0.0/8)" in proc.stdout + proc.stderr
    (tmp_path / "bad.yaml").write_text("policy: sites.yaml\ncases:\n"
                                       "  - {host: a.example, expect: deny, method: POST}\n"
                                       "  - {host: a.example, expect: deny, method: POST, expect_write: hold}\n")
    proc = sfguard("policy", "test", str(tmp_path / "bad.yaml"))
    assert proc.returncode == 2
    assert "method and expect_write go together" in proc.stderr
    assert "expect_write: one of read, allow, gate, deny (got 'hold')" in proc.stderr


# the path as a server routes it: what a listed GET is matched against, beside the path as sent
SERVER_PATHS = [
    ("/logout", "/logout"), ("/%6cogout", "/logout"), ("/%6Cogout", "/logout"), ("/logout/", "/logout"),
    ("/logout;jsessionid=1", "/logout"), ("//logout", "/logout"), ("/a/../logout", "/logout"),
    ("/./logout", "/logout"), ("/a/./b/../../logout", "/logout"), ("/%2e%2e/logout", "/logout"),
    ("/", "/"), ("", "/"), ("/..", "/"), ("/a%2fb", "/a%2Fb"), ("/%41%7e", "/A~"), ("/x%20y", "/x%20y"),
    ("/a;b/c;d/", "/a/c"),
]


@pytest.mark.parametrize("raw, routed", SERVER_PATHS)
def test_server_path(raw, routed):
    from sfguard.policy.writes import server_path
    assert server_path(raw) == routed


LISTED = """\
version: 1
writes:
  - pattern: "shop.example"
    reason: "signing out and wiping are writes"
    writes:
      - "GET /logout"
      - "GET /api/*/delete"
      - request: "GET /Admin/Wipe"
        ignore_case: true
    reads:
      - "POST /search"
"""


@pytest.mark.parametrize("method, path, write", [
    # a listed GET in every spelling a server routes to it
    ("GET", "/logout", True), ("GET", "/%6cogout", True), ("GET", "/logout/", True), ("GET", "/logout;x", True),
    ("GET", "//logout", True), ("GET", "/a/../logout", True), ("GET", "/api/7/delete", True),
    ("GET", "/api/7/delete/", True), ("GET", "/api//7//delete", True),
    ("GET", "/admin/wipe", True), ("GET", "/ADMIN/WIPE/", True), ("GET", "/Admin/%57ipe", True),
    # case matters unless the pattern says ignore_case; other paths are reads
    ("GET", "/Logout", False), ("GET", "/logoutx", False), ("GET", "/api/7/8/delete", False),
    ("GET", "/admin/wiped", False),
    # a read exception matches only the path as sent: it loosens, so it stays narrow
    ("POST", "/search", False), ("POST", "/search/", True), ("POST", "/%73earch", True), ("POST", "/Search", True),
])
def test_listed_gets_match_the_routed_path_and_reads_only_the_sent_one(method, path, write):
    rules = parse_policy(LISTED, "sites.yaml").writes
    assert rules.judge("shop.example", method, path).write is write, (method, path)


def test_floor_patterns_are_kept_canonical():
    rules = parse_policy('version: 1\nwrites:\n  - patterns: ["PAY.Shop.Example.", "*.B\u00fccher.de:8080"]\n'
                         '    mode: deny\n    reason: "r"\n', "sites.yaml").writes
    assert rules.entries[0].patterns == ("pay.shop.example", "*.xn--bcher-kva.de:8080")
    assert rules.floor("pay.shop.example").mode == "deny"
