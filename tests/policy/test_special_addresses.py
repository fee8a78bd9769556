"""Special addresses only with the security reviewer's consent (issue 35, section 1).

A run's allow_domains may name a loopback, link-local, private or other special address (IP,
CIDR, or a name that resolves to one) only inside a range the site policy lists in
`private_networks.allow`; link-local and cloud metadata addresses only through an entry that is
that very address. Tables: decisions for IP literals, the connect-time check of resolved
addresses, the run-pattern check `sfguard validate` and the stage API use, and `explain` as a
user runs it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sfguard import policy
from sfguard.policy import PolicyError, compile_patterns, parse_pattern, parse_policy

ROOT = Path(__file__).resolve().parents[2]

NONE = []                                         # the shipped default: no consent
PRIVATE = ["10.0.0.0/8", "127.0.0.0/8", "::1", "fd00::/8"]   # a reviewer's private ranges
META_EXACT = ["169.254.169.254", "fd00:ec2::254"]            # the metadata IPs, named exactly
META_WIDE = ["169.254.0.0/16", "fd00::/8"]                   # wider ranges: never enough


def site(consent: list[str]) -> policy.SitePolicy:
    items = "".join(f'    - "{c}"\n' for c in consent)
    return parse_policy("version: 1\nprivate_networks:\n  allow:\n" + items if consent
                        else "version: 1\n", "/etc/sfguard/sites.yaml")


R = "reviewer_only_address"
RUN = "allowed_by_run"

# (consent, the run's allow_domains, host (IPv4, IPv6, mapped), decision reason)
DECISIONS = [
    # without the reviewer's consent a run opens nothing special, whatever it names
    (NONE, ["127.0.0.0/8"], "127.0.0.1", R),
    (NONE, ["127.0.0.1"], "::ffff:127.0.0.1", R),
    (NONE, ["10.0.0.0/8"], "10.20.30.40", R),
    (NONE, ["169.254.169.254"], "169.254.169.254", R),
    (NONE, ["169.254.169.254"], "::ffff:169.254.169.254", R),
    (NONE, ["169.254.169.254"], "::ffff:a9fe:a9fe", R),
    (NONE, ["fd00:ec2::254"], "fd00:ec2::254", R),
    (NONE, ["::1"], "::1", R),
    (NONE, ["*.example.com"], "169.254.169.254", R),    # never "ask the pipeline owner"
    (NONE, [], "192.168.1.1", R),
    # a public IP is still the run's to allow
    (NONE, ["93.184.216.34"], "93.184.216.34", RUN),
    (NONE, ["93.184.0.0/16"], "::ffff:93.184.1.2", RUN),
    (NONE, ["2606:4700::/32"], "2606:4700::6810:84e5", RUN),
    (NONE, [], "93.184.216.34", "not_allowed"),
    # the reviewer consents to private ranges: the run may now allow addresses inside them
    (PRIVATE, ["10.0.0.0/8"], "10.20.30.40", RUN),
    (PRIVATE, ["127.0.0.1"], "127.0.0.1", RUN),
    (PRIVATE, ["127.0.0.1"], "::ffff:127.0.0.1", RUN),
    (PRIVATE, ["::1"], "::1", RUN),
    (PRIVATE, ["fd00:1::/64"], "fd00:1::5", RUN),
    (PRIVATE, [], "10.1.1.1", "not_allowed"),            # consented, but the run must allow it
    (PRIVATE, ["192.168.0.0/16"], "192.168.1.1", R),     # outside the consent
    # ... but never the metadata addresses through a range (fd00::/8 holds fd00:ec2::254)
    (PRIVATE, ["fd00::/8"], "fd00:ec2::254", R),
    (META_WIDE, ["169.254.169.254"], "169.254.169.254", R),
    (META_WIDE, ["169.254.0.0/16"], "169.254.1.1", R),
    (META_WIDE, ["fd00:ec2::254"], "fd00:ec2::254", R),
    # only through an entry that names them exactly
    (META_EXACT, ["169.254.169.254"], "169.254.169.254", RUN),
    (META_EXACT, ["169.254.169.254"], "::ffff:169.254.169.254", RUN),
    (META_EXACT, ["fd00:ec2::254"], "fd00:ec2::254", RUN),
    (META_EXACT, ["169.254.169.254"], "169.254.169.253", R),
]


@pytest.mark.parametrize("consent,allow,host,reason", DECISIONS,
                         ids=[f"{'+'.join(c) or 'none'}|{','.join(a)}|{h}" for c, a, h, _ in DECISIONS])
def test_decision_for_a_special_ip_literal(consent, allow, host, reason):
    p = site(consent)
    d = p.decide(host, 443, compile_patterns(allow))
    assert d.reason == reason, d.explanation
    # the proxy checks the address too (the literal is its own address): the same answer
    assert p.check_address(d, host).reason == reason
    if reason == R:
        assert "pipeline owner" not in d.explanation
        assert "security reviewer" in d.explanation
        assert "private_networks.allow of /etc/sfguard/sites.yaml" in d.explanation


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_report_mode_does_not_relax_it(mode):
    p = parse_policy(f"version: 1\nmode: {mode}\n", "sites.yaml")
    d = p.decide("169.254.169.254", 80, compile_patterns(["169.254.169.254"]))
    assert (d.decision, d.reason) == ("deny", R)


def test_a_wider_range_names_itself_as_the_rule():
    p = parse_policy("version: 1\nprivate_networks:\n  allow:\n    - 10.0.0.0/8\n"
                     "    - 169.254.0.0/16\n", "sites.yaml")
    d = p.decide("169.254.169.254", 443, compile_patterns(["169.254.169.254"]))
    assert (d.reason, d.rule) == (R, "sites.yaml:5 169.254.0.0/16")
    assert "as the exact address 169.254.169.254" in d.explanation


# (consent, address a name resolves to, reason after check_address; None: allowed)
RESOLVED = [
    (NONE, "10.0.0.5", "private_address"),
    (NONE, "169.254.169.254", "private_address"),
    (NONE, "fd00:ec2::254", "private_address"),
    (NONE, "::ffff:127.0.0.1", "private_address"),
    (NONE, "93.184.216.34", None),
    (PRIVATE, "10.0.0.5", None),
    (PRIVATE, "::1", None),
    (PRIVATE, "fd00:ec2::254", "private_address"),
    (META_WIDE, "169.254.169.254", "private_address"),
    (META_EXACT, "169.254.169.254", None),
    (META_EXACT, "::ffff:169.254.169.254", None),
]


@pytest.mark.parametrize("consent,address,reason", RESOLVED)
def test_a_name_that_resolves_to_a_special_address(consent, address, reason):
    p = site(consent)
    allowed = p.decide("intranet.example.com", 443, compile_patterns(["*.example.com"]))
    assert allowed.allowed
    d = p.check_address(allowed, address)
    if reason is None:
        assert d is allowed
    else:
        assert (d.decision, d.reason) == ("deny", reason)
        assert "only the security reviewer can" in d.explanation


# (consent, allow_domains entry, refused?) for `sfguard validate` and the stage API
RUN_PATTERNS = [
    (NONE, "127.0.0.0/8", True),
    (NONE, "10.0.0.0/8", True),
    (NONE, "169.254.169.254", True),
    (NONE, "fd00:ec2::254", True),
    (NONE, "::1", True),
    (NONE, "[::1]:8080", True),
    (NONE, "::ffff:127.0.0.1", True),
    (NONE, "93.184.216.34", False),
    (NONE, "2606:4700::/32", False),
    (NONE, "100.0.0.0/8", False),      # mostly public: its CGNAT part is refused at connect time
    (NONE, "*.example.com", False),    # names are checked at connect time
    (PRIVATE, "10.0.0.0/8", False),
    (PRIVATE, "10.1.0.0/16", False),
    (PRIVATE, "127.0.0.1:8080", False),
    (PRIVATE, "::1", False),
    (PRIVATE, "fd00:ec2::254", True),
    (PRIVATE, "192.168.0.0/16", True),
    (META_WIDE, "169.254.169.254", True),
    (META_WIDE, "169.254.0.0/16", True),
    (META_WIDE, "fd00:ec2::254", True),
    (META_EXACT, "169.254.169.254", False),
    (META_EXACT, "fd00:ec2::254", False),
    (META_EXACT, "169.254.169.0/24", True),
]


@pytest.mark.parametrize("consent,pattern,refused", RUN_PATTERNS)
def test_run_pattern_refusal(consent, pattern, refused):
    why = site(consent).run_pattern_refusal(parse_pattern(pattern))
    assert (why is not None) == refused, why
    if why:
        assert "security reviewer" in why and "private_networks.allow" in why


@pytest.mark.parametrize("pattern", ["0.0.0.0/0", "::/0"])
def test_catch_alls_stay_refused_everywhere(pattern):
    with pytest.raises(PolicyError, match="catch-all"):
        compile_patterns([pattern])
    with pytest.raises(PolicyError, match="catch-all"):
        site([pattern])


def sfguard(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_explain_metadata_names_who_can_open_it(tmp_path):
    pol = tmp_path / "sites.yaml"
    pol.write_text("version: 1\n")
    for allow in ([], ["--allow", "169.254.169.254"], ["--allow", "169.254.0.0/16"]):
        proc = sfguard("policy", "explain", "169.254.169.254", "--policy", str(pol), *allow)
        assert proc.returncode == 0, proc.stderr
        assert f"DENY ({R})" in proc.stdout
        assert "pipeline owner" not in proc.stdout and "add it to allow_domains" not in proc.stdout
        assert "only the security reviewer can" in proc.stdout
        assert f"private_networks.allow of {pol}" in proc.stdout
    # with the reviewer's exact entry, the run may open it
    pol.write_text('version: 1\nprivate_networks:\n  allow: ["169.254.169.254"]\n')
    proc = sfguard("policy", "explain", "169.254.169.254", "--policy", str(pol),
                   "--allow", "169.254.169.254", "--json")
    assert json.loads(proc.stdout)["reason"] == RUN


# (policy text, fields `policy validate` warns about: special addresses listed where they do nothing)
LINT = [
    ("version: 1\nallow_always: [10.0.0.5, 93.184.216.34]\n", ["allow_always[0]"]),
    ("version: 1\nallow_always: [10.0.0.5]\nprivate_networks:\n  allow: [10.0.0.0/8]\n", []),
    ("version: 1\nprivate_networks:\n  allow: [169.254.0.0/16, 169.254.169.254]\n",
     ["private_networks.allow[0]"]),
    ('version: 1\nprivate_networks:\n  allow: ["fd00::/8", "fd00:ec2::254", 10.0.0.0/8]\n',
     ["private_networks.allow[0]"]),
    ('version: 1\nprivate_networks:\n  allow: ["fe80::/64", 127.0.0.0/8]\n', ["private_networks.allow[0]"]),
]


@pytest.mark.parametrize("text,fields", LINT)
def test_validate_warns_about_special_addresses_that_do_nothing(text, fields):
    from sfguard.policy.lint import lint_text
    warnings = lint_text(parse_policy(text, "sites.yaml"), text)
    assert [w.field for w in warnings] == fields, warnings
    for w in warnings:
        assert w.line is not None and w.hint
