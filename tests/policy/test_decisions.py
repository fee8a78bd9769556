"""Decisions asserted verbatim (decision, reason code, rule), like Smokescreen's acl tests.

The policy below is parsed as "sites.yaml", so its rules read "sites.yaml:LINE PATTERN"; the
line numbers in the tables are the lines of POLICY (the first line is 1).
"""
from __future__ import annotations

import dataclasses

import pytest

from sfguard.policy import Decision, compile_patterns, parse_policy

POLICY = """\
version: 1
mode: enforce
ports: [80, 443]
allow_always:
  - "*.always.example"
  - docs.python.org
  - "intranet.corp.example:8443"
  - 198.51.100.7
block:
  - pattern: "*.linkedin.com"
    reason: "LinkedIn forbids automation"
  - pattern: evil.always.example
    reason: compromised
  - pattern: 10.66.0.0/16
    reason: lab network
  - pattern: "blocked.example.net:8080"
    reason: only this port
  - reason: feed
    patterns:
      - bad1.example.org
      - "*.bad2.example.org"
      - "2001:db8:bad::/48"
quiet:
  - "*.google.com"
private_networks:
  allow:
    - 192.168.50.0/24
"""

RUN_ALLOW = ["*.example.com", "api.partner.net:8443", "127.0.0.1", "10.0.0.0/8", "[::1]:8080",
             "fd00:1::/64", "blocked.example.net:8080", "93.184.0.0/16", "2606:4700::/32"]
#: the same policy, with the reviewer's consent for the run's private ranges
CONSENT = "    - 10.0.0.0/8\n    - 127.0.0.1\n    - ::1\n    - fd00:1::/64\n"

ALLOW = "allow"
DENY = "deny"

# (host, port, decision, reason, rule, normalized host)
CASES = [
    # block, wildcard edges
    ("www.linkedin.com", 443, DENY, "blocked_by_policy", "sites.yaml:10 *.linkedin.com", "www.linkedin.com"),
    ("linkedin.com", 443, DENY, "blocked_by_policy", "sites.yaml:10 *.linkedin.com", "linkedin.com"),
    ("LINKEDIN.COM.", 443, DENY, "blocked_by_policy", "sites.yaml:10 *.linkedin.com", "linkedin.com"),
    ("a.b.c.linkedin.com", 80, DENY, "blocked_by_policy", "sites.yaml:10 *.linkedin.com", "a.b.c.linkedin.com"),
    ("www.ｌｉｎｋｅｄｉｎ.com", 443, DENY, "blocked_by_policy", "sites.yaml:10 *.linkedin.com", "www.linkedin.com"),
    ("www.linkedin。com", 443, DENY, "blocked_by_policy", "sites.yaml:10 *.linkedin.com", "www.linkedin.com"),
    ("xlinkedin.com", 443, DENY, "not_allowed", None, "xlinkedin.com"),
    ("linkedin.com.evil.com", 443, DENY, "not_allowed", None, "linkedin.com.evil.com"),
    ("linkedin.co", 443, DENY, "not_allowed", None, "linkedin.co"),
    # run allow list: *.a.com matches a.com and subdomains, nothing else
    ("a.example.com", 443, ALLOW, "allowed_by_run", "--allow *.example.com", "a.example.com"),
    ("example.com", 443, ALLOW, "allowed_by_run", "--allow *.example.com", "example.com"),
    ("EXAMPLE.com.", 80, ALLOW, "allowed_by_run", "--allow *.example.com", "example.com"),
    ("a.b.c.d.e.f.example.com", 80, ALLOW, "allowed_by_run", "--allow *.example.com", "a.b.c.d.e.f.example.com"),
    ("xexample.com", 443, DENY, "not_allowed", None, "xexample.com"),
    ("example.com.evil.net", 443, DENY, "not_allowed", None, "example.com.evil.net"),
    ("exаmple.com", 443, DENY, "not_allowed", None, "xn--exmple-4nf.com"),  # Cyrillic a
    ("bücher.example.com", 443, ALLOW, "allowed_by_run", "--allow *.example.com", "xn--bcher-kva.example.com"),
    ("under_score.example.com", 443, ALLOW, "allowed_by_run", "--allow *.example.com", "under_score.example.com"),
    ("a.example.com", None, ALLOW, "allowed_by_run", "--allow *.example.com", "a.example.com"),
    # ports
    ("example.com", 8443, DENY, "port_not_allowed", None, "example.com"),
    ("example.com", 22, DENY, "port_not_allowed", None, "example.com"),
    ("example.com", 0, DENY, "port_not_allowed", None, "example.com"),
    ("api.partner.net", 8443, ALLOW, "allowed_by_run", "--allow api.partner.net:8443", "api.partner.net"),
    ("api.partner.net", 443, DENY, "not_allowed", None, "api.partner.net"),
    ("x.api.partner.net", 8443, DENY, "port_not_allowed", None, "x.api.partner.net"),
    ("intranet.corp.example", 8443, ALLOW, "allowed_by_policy", "sites.yaml:7 intranet.corp.example:8443",
     "intranet.corp.example"),
    ("intranet.corp.example", 443, DENY, "not_allowed", None, "intranet.corp.example"),
    # a port-specific block: the run allows the port, the block still wins
    ("blocked.example.net", 8080, DENY, "blocked_by_policy", "sites.yaml:16 blocked.example.net:8080",
     "blocked.example.net"),
    ("blocked.example.net", 443, DENY, "not_allowed", None, "blocked.example.net"),
    # allow_always, and block beating it
    ("x.always.example", 443, ALLOW, "allowed_by_policy", "sites.yaml:5 *.always.example", "x.always.example"),
    ("always.example", 443, ALLOW, "allowed_by_policy", "sites.yaml:5 *.always.example", "always.example"),
    ("evil.always.example", 443, DENY, "blocked_by_policy", "sites.yaml:12 evil.always.example", "evil.always.example"),
    ("sub.evil.always.example", 443, ALLOW, "allowed_by_policy", "sites.yaml:5 *.always.example",
     "sub.evil.always.example"),
    ("docs.python.org", 443, ALLOW, "allowed_by_policy", "sites.yaml:6 docs.python.org", "docs.python.org"),
    ("www.docs.python.org", 443, DENY, "not_allowed", None, "www.docs.python.org"),
    # grouped block entries keep their own line numbers
    ("bad1.example.org", 443, DENY, "blocked_by_policy", "sites.yaml:20 bad1.example.org", "bad1.example.org"),
    ("x.bad2.example.org", 443, DENY, "blocked_by_policy", "sites.yaml:21 *.bad2.example.org", "x.bad2.example.org"),
    ("bad2.example.org", 443, DENY, "blocked_by_policy", "sites.yaml:21 *.bad2.example.org", "bad2.example.org"),
    ("x.bad1.example.org", 443, DENY, "not_allowed", None, "x.bad1.example.org"),
    # IPv4 literals and CIDRs
    ("10.66.1.2", 443, DENY, "blocked_by_policy", "sites.yaml:14 10.66.0.0/16", "10.66.1.2"),
    # a special address is the reviewer's (private_networks.allow), never a run's: the run's
    # 10.0.0.0/8 and 127.0.0.1 do not open them (tests/policy/test_special_addresses.py)
    ("10.1.2.3", 443, DENY, "reviewer_only_address", None, "10.1.2.3"),
    ("11.1.2.3", 443, DENY, "not_allowed", None, "11.1.2.3"),
    ("127.0.0.1", 443, DENY, "reviewer_only_address", None, "127.0.0.1"),
    ("127.0.0.1.", 443, DENY, "reviewer_only_address", None, "127.0.0.1"),
    ("127.0.0.2", 443, DENY, "reviewer_only_address", None, "127.0.0.2"),
    ("93.184.216.34", 443, ALLOW, "allowed_by_run", "--allow 93.184.0.0/16", "93.184.216.34"),
    # allow_always does not open a special (here: documentation) address either
    ("198.51.100.7", 443, DENY, "reviewer_only_address", None, "198.51.100.7"),
    ("192.168.50.7", 443, DENY, "not_allowed", None, "192.168.50.7"),  # consented, not allowed
    # IPv4-mapped IPv6 is its IPv4
    ("::ffff:127.0.0.1", 443, DENY, "reviewer_only_address", None, "127.0.0.1"),
    ("::ffff:93.184.1.1", 443, ALLOW, "allowed_by_run", "--allow 93.184.0.0/16", "93.184.1.1"),
    ("[::ffff:7f00:1]", 443, DENY, "reviewer_only_address", None, "127.0.0.1"),
    ("::ffff:10.66.0.9", 443, DENY, "blocked_by_policy", "sites.yaml:14 10.66.0.0/16", "10.66.0.9"),
    # IPv6 literals and CIDRs
    ("[::1]", 8080, DENY, "reviewer_only_address", None, "::1"),
    ("::1", 443, DENY, "reviewer_only_address", None, "::1"),
    ("2001:db8:bad::5", 443, DENY, "blocked_by_policy", "sites.yaml:22 2001:db8:bad::/48", "2001:db8:bad::5"),
    ("2001:db8:bae::5", 443, DENY, "reviewer_only_address", None, "2001:db8:bae::5"),
    ("2606:4700::1", 443, ALLOW, "allowed_by_run", "--allow 2606:4700::/32", "2606:4700::1"),
    ("[FD00:1::ABCD]", 443, DENY, "reviewer_only_address", None, "fd00:1::abcd"),
    ("fd00:2::1", 443, DENY, "reviewer_only_address", None, "fd00:2::1"),
    # malformed: denied before anything else
    ("2130706433", 443, DENY, "malformed_host", None, None),
    ("0177.0.0.1", 443, DENY, "malformed_host", None, None),
    ("0x7f.0.0.1", 443, DENY, "malformed_host", None, None),
    ("127.1", 443, DENY, "malformed_host", None, None),
    ("a.example.com@127.0.0.1", 443, DENY, "malformed_host", None, None),
    ("a.example.com/x", 443, DENY, "malformed_host", None, None),
    ("a.example.com#x", 443, DENY, "malformed_host", None, None),
    ("a.example.com?x", 443, DENY, "malformed_host", None, None),
    ("a.example.com%2f", 443, DENY, "malformed_host", None, None),
    ("a.example.com\\x", 443, DENY, "malformed_host", None, None),
    ("a.example.com ", 443, DENY, "malformed_host", None, None),
    ("a.example.com\n", 443, DENY, "malformed_host", None, None),
    ("a..example.com", 443, DENY, "malformed_host", None, None),
    ("x" * 64 + ".example.com", 443, DENY, "malformed_host", None, None),
    ("fe80::1%eth0", 443, DENY, "malformed_host", None, None),
    ("example.com:443", 443, DENY, "malformed_host", None, None),
    ("", 443, DENY, "malformed_host", None, None),
    ("*.example.com", 443, DENY, "malformed_host", None, None),
]


@pytest.fixture(scope="module")
def site():
    return parse_policy(POLICY, "/etc/sfguard/sites.yaml")


@pytest.fixture(scope="module")
def run_allow():
    return compile_patterns(RUN_ALLOW)


@pytest.mark.parametrize("host,port,decision,reason,rule,normalized", CASES,
                         ids=[f"{h!r}:{p}" for h, p, *_ in CASES])
def test_decision(site, run_allow, host, port, decision, reason, rule, normalized):
    d = site.decide(host, port, run_allow)
    assert (d.decision, d.reason, d.rule, d.normalized_host) == (decision, reason, rule, normalized)
    assert d.allowed == (decision == ALLOW)
    assert d.explanation and "\n" not in d.explanation
    assert d.mode == "enforce"


def test_no_run_allow_list_means_only_allow_always(site):
    assert site.decide("a.example.com", 443).reason == "not_allowed"
    assert site.decide("docs.python.org", 443, None).reason == "allowed_by_policy"


def test_allowed_by_ip_and_network(run_allow):
    site = parse_policy(POLICY + CONSENT, "sites.yaml")
    by_cidr = site.decide("10.1.2.3", 443, run_allow)
    assert (by_cidr.allowed_by_ip, by_cidr.network) == (True, "10.0.0.0/8")
    by_ip = site.decide("127.0.0.1", 443, run_allow)
    assert (by_ip.allowed_by_ip, by_ip.network) == (True, "127.0.0.1/32")
    by_name = site.decide("a.example.com", 443, run_allow)
    assert (by_name.allowed_by_ip, by_name.network) == (False, None)


def test_quiet_marks_denials_only(site, run_allow):
    assert site.decide("clients1.google.com", 443, run_allow).quiet is True
    assert site.decide("google.com", 443, run_allow).quiet is True
    assert site.decide("notgoogle.com", 443, run_allow).quiet is False
    # a quiet host is still denied
    assert site.decide("update.google.com", 443, run_allow).decision == "deny"
    # and an allowed one is not quiet
    allowed = site.decide("www.google.com", 443, compile_patterns(["*.google.com"]))
    assert (allowed.decision, allowed.quiet) == ("allow", False)


def test_malformed_host_is_redacted_and_escaped(site):
    d = site.decide("user:secret@example.com", 443)
    assert d.reason == "malformed_host"
    assert "secret" not in d.host and "secret" not in d.explanation
    d = site.decide("a.com\r\nX-Evil: 1", 443)
    assert "\n" not in d.host and "\r" not in d.explanation


def test_block_explanation_names_the_reason(site):
    d = site.decide("www.linkedin.com", 443)
    assert "LinkedIn forbids automation" in d.explanation


def test_decision_is_a_frozen_value(site):
    d = site.decide("www.linkedin.com", 443)
    assert d == site.decide("www.linkedin.com", 443)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.reason = "allowed_by_run"
    assert d.as_dict()["rule"] == "sites.yaml:10 *.linkedin.com"


# --- report mode ---------------------------------------------------------------------------

REPORT_CASES = [
    ("www.linkedin.com", 443, ALLOW, "would_deny:blocked_by_policy", "sites.yaml:10 *.linkedin.com"),
    ("nowhere.test", 443, ALLOW, "would_deny:not_allowed", None),
    # Report mode relaxes only the allow and block lists: ports and malformed hosts still deny.
    ("example.com", 8443, DENY, "port_not_allowed", None),
    ("0x7f.1", 443, DENY, "malformed_host", None),
    ("a.example.com", 443, ALLOW, "allowed_by_run", "--allow *.example.com"),
    ("docs.python.org", 443, ALLOW, "allowed_by_policy", "sites.yaml:6 docs.python.org"),
]


@pytest.mark.parametrize("host,port,decision,reason,rule", REPORT_CASES, ids=[c[0] for c in REPORT_CASES])
def test_report_mode(run_allow, host, port, decision, reason, rule):
    site = parse_policy(POLICY.replace("mode: enforce", "mode: report"), "sites.yaml")
    d = site.decide(host, port, run_allow)
    assert (d.decision, d.reason, d.rule) == (decision, reason, rule)
    assert d.would_deny == reason.startswith("would_deny:")
    assert d.mode == "report"


def test_report_mode_keeps_quiet_flag():
    site = parse_policy(POLICY.replace("mode: enforce", "mode: report"), "sites.yaml")
    d = site.decide("clients2.google.com", 443)
    assert (d.decision, d.reason, d.quiet) == ("allow", "would_deny:not_allowed", True)


# --- second stage: resolved addresses --------------------------------------------------------

# (address, expected reason: None = unchanged (allowed_by_run), words in the explanation)
ADDRESSES = [
    ("93.184.216.34", None, None),
    ("2606:4700::1111", None, None),
    ("127.0.0.1", "private_address", "loopback"),
    ("127.255.255.254", "private_address", "loopback"),
    ("10.0.0.5", "private_address", "RFC 1918"),
    ("172.16.0.1", "private_address", "RFC 1918"),
    ("172.31.255.255", "private_address", "RFC 1918"),
    ("172.32.0.1", None, None),
    ("192.168.1.1", "private_address", "RFC 1918"),
    ("192.168.50.7", None, None),  # listed in private_networks.allow
    ("169.254.169.254", "private_address", "cloud metadata"),
    ("169.254.1.1", "private_address", "link-local"),
    ("100.64.0.1", "private_address", "carrier-grade NAT"),
    ("100.127.255.255", "private_address", "carrier-grade NAT"),
    ("0.0.0.0", "private_address", "unspecified"),
    ("224.0.0.1", "private_address", "multicast"),
    ("255.255.255.255", "private_address", "reserved"),
    ("::1", "private_address", "loopback"),
    ("::", "private_address", "unspecified"),
    ("fe80::1", "private_address", "link-local"),
    ("fc00::1", "private_address", "unique local"),
    ("fd12:3456::1", "private_address", "unique local"),
    ("ff02::1", "private_address", "multicast"),
    ("::ffff:127.0.0.1", "private_address", "loopback"),
    ("::ffff:169.254.169.254", "private_address", "cloud metadata"),
    ("[::ffff:192.168.50.9]", None, None),  # mapped form of an allowed private network
    ("64:ff9b::a9fe:a9fe", "private_address", "cloud metadata"),  # NAT64 of 169.254.169.254
    ("64:ff9b::5db8:d822", None, None),  # NAT64 of a public address
    ("2002:7f00:1::", "private_address", "loopback"),  # 6to4 of 127.0.0.1
    ("2001:db8::1", "private_address", "documentation"),
    ("not-an-address", "invalid_address", "not an IP"),
    ("fe80::1%eth0", "invalid_address", "not an IP"),
]


@pytest.mark.parametrize("address,reason,words", ADDRESSES, ids=[a for a, _, _ in ADDRESSES])
def test_check_address(site, run_allow, address, reason, words):
    allowed = site.decide("a.example.com", 443, run_allow)
    d = site.check_address(allowed, address)
    if reason is None:
        assert d is allowed
        return
    assert (d.decision, d.reason, d.rule) == ("deny", reason, None)
    assert d.normalized_host == "a.example.com"
    assert words in d.explanation


@pytest.mark.parametrize("host,inside,outside", [
    ("10.1.2.3", ["10.1.2.3", "10.200.0.1", "::ffff:10.9.9.9", "127.0.0.1"],
     ["192.168.1.1", "127.0.0.2", "169.254.169.254"]),
    ("[::1]", ["::1", "10.0.0.1"], ["fe80::1", "fd00:2::1", "fd00:ec2::254"]),
])
def test_only_the_reviewers_consent_opens_an_address(run_allow, host, inside, outside):
    # The allowing pattern no longer matters: only private_networks.allow opens an address.
    site = parse_policy(POLICY + CONSENT, "sites.yaml")
    port = 8080 if host == "[::1]" else 443
    allowed = site.decide(host, port, run_allow)
    assert allowed.allowed_by_ip
    for address in inside:
        assert site.check_address(allowed, address) is allowed, address
    for address in outside:
        assert site.check_address(allowed, address).reason == "private_address", address
    assert site.check_address(allowed, "11.0.0.1") is allowed   # public: fine


def test_check_address_leaves_denials_alone(site, run_allow):
    denied = site.decide("www.linkedin.com", 443, run_allow)
    assert site.check_address(denied, "127.0.0.1") is denied


def test_check_address_in_report_mode(run_allow):
    # Report mode relaxes the lists only: private addresses deny, for a would-deny host too.
    site = parse_policy(POLICY.replace("mode: enforce", "mode: report"), "sites.yaml")
    allowed = site.decide("a.example.com", 443, run_allow)
    d = site.check_address(allowed, "169.254.169.254")
    assert (d.decision, d.reason) == ("deny", "private_address")
    would = site.decide("nowhere.test", 443)
    assert would.would_deny
    d = site.check_address(would, "127.0.0.1")
    assert (d.decision, d.reason) == ("deny", "private_address")
    assert site.check_address(would, "93.184.216.34") is would


def test_refuse_for_proxy_checks(site, run_allow):
    allowed = site.decide("a.example.com", 443, run_allow)
    d = site.refuse(allowed, "sni_mismatch", "the TLS server name differs from the CONNECT host.")
    assert (d.decision, d.reason, d.normalized_host, d.port) == ("deny", "sni_mismatch", "a.example.com", 443)
    report = parse_policy(POLICY.replace("mode: enforce", "mode: report"), "sites.yaml")
    for reason in ("host_header_mismatch", "sni_mismatch", "resolve_failed"):
        d = report.refuse(report.decide("a.example.com", 443, run_allow), reason, "x")
        assert (d.decision, d.reason) == ("deny", reason)


def test_decision_fields_are_the_contract(site):
    d = site.decide("www.linkedin.com", 443)
    assert isinstance(d, Decision)
    for name in ("host", "port", "normalized_host", "decision", "reason", "rule", "allowed_by_ip",
                 "quiet", "explanation"):
        assert hasattr(d, name)
