"""Reading policy files: the shipped default, every broken file in broken/, limits and scale."""
from __future__ import annotations

from pathlib import Path

import pytest

from sfguard import policy
from sfguard.policy import PolicyError, default_policy_path, load_policy, parse_policy

BROKEN = Path(__file__).resolve().parent / "broken"

# file -> [(line, col, field, part of the message, part of the hint)], in file order
EXPECTED = {
    "unknown_key.yaml": [(3, 1, "alow_always", "unknown key 'alow_always'", "did you mean 'allow_always'?")],
    "leading_dot.yaml": [(4, 5, "allow_always[1]", "cannot start with a dot", "write *.example.com")],
    "wildcard_middle.yaml": [(3, 5, "allow_always[0]", "whole leftmost label", "write *.example.com")],
    "bare_star.yaml": [(3, 5, "allow_always[0]", "bare * would match every host", "*.example.com")],
    "public_suffix.yaml": [(5, 5, "allow_always[0]", "public suffix com", "registrable domain")],
    "bad_mode.yaml": [(2, 7, "mode", "'enforcing'", "mode: enforce")],
    "port_range.yaml": [(2, 18, "ports[2]", "70000", "ports are 1-65535")],
    "block_no_reason.yaml": [(5, 5, "block[1].reason", "'reason' is required", "every block entry needs a reason")],
    "yaml_syntax.yaml": [(3, 5, "(yaml)", "started at line 2", "close each [ ]")],
    "alias_bomb.yaml": [(2, 4, "(yaml)", "anchors (&a) are not allowed", "aliases")],
    "wrong_type.yaml": [(2, 12, "tab_quota", "valid integer", "whole number")],
    "unquoted_star.yaml": [(3, 14, "(yaml)", "unquoted * starts a YAML alias", 'quoted: "*.example.com"')],
    "duplicate_key.yaml": [(3, 1, "mode", "duplicate key 'mode' (first at line 2)", "keep one")],
    "missing_version.yaml": [(2, 1, "version", "'version' is required", "version: 1")],
    "yaml_tag.yaml": [(3, 5, "(yaml)", "tags", "plain value")],
    "private_network_name.yaml": [(5, 7, "private_networks.allow[1]", "only IP addresses and CIDR", "allow_always")],
    "cidr_host_bits.yaml": [(3, 5, "allow_always[0]", "host bits", "write 10.0.0.0/8")],
    "noncanonical_ip.yaml": [(3, 5, "allow_always[0]", "canonical IPv4", "as 127.0.0.1")],
    "pattern_and_patterns.yaml": [(3, 5, "block[0]", "either 'pattern' or 'patterns'", "patterns: [HOST")],
    "pattern_port_zero.yaml": [(3, 5, "allow_always[0]", "port 0 is out of range", "1-65535")],
    "empty.yaml": [(1, 1, "(file)", "empty", "version: 1")],
    "tab_indent.yaml": [(4, 1, "(yaml)", "tab", "spaces, not tabs")],
    "control_char.yaml": [(2, 22, "(yaml)", "U+0007", "control characters")],
    "two_documents.yaml": [(2, 1, "(document)", "more than one YAML document", "'---'")],
    "writes_bad_mode.yaml": [(4, 11, "writes[0].mode", "'hold'", "allow, gate or deny")],
    "writes_no_reason.yaml": [(3, 5, "writes[0].reason", "'reason' is required", "every writes entry needs a reason")],
    "writes_reads_get.yaml": [(6, 9, "writes[0].reads[0]", "GET already only reads", '"POST /search"')],
    "writes_writes_post.yaml": [(6, 9, "writes[0].writes[0]", "every POST already is a write", '"GET /logout"')],
    "writes_bad_path.yaml": [(6, 9, "writes[0].reads[0]", "'search?q=1' is not usable", "no query")],
    "writes_public_suffix.yaml": [(3, 14, "writes[0].pattern", "public suffix com", "registrable domain")],
    "writes_ignore_case_unknown_key.yaml": [(7, 9, "writes[0].writes[0].any_case", "unknown key 'any_case'",
                                             "did you mean 'ignore_case'?")],
    "writes_request_post.yaml": [(6, 9, "writes[0].writes[0]", "every POST already is a write", '"GET /logout"')],
    "pace_no_limit.yaml": [(3, 5, "pace[0]", "names no limit", "at least one of page_loads_per_minute")],
    "pace_no_reason.yaml": [(3, 5, "pace[0].reason", "'reason' is required", "every pace entry needs a reason")],
    "pace_bad_over.yaml": [(6, 11, "pace[0].over", "'queue'", "over: wait (hold a request")],
    "pace_zero_rate.yaml": [(5, 26, "pace[0].requests_per_minute", "greater than 0, got 0", "above 0")],
    "pace_unknown_key.yaml": [(5, 5, "pace[0].page_load_per_minute", "unknown key 'page_load_per_minute'",
                               "did you mean 'page_loads_per_minute'?")],
    "pace_quoted_rate.yaml": [(5, 28, "pace[0].page_loads_per_minute", "valid number, got '20'",
                               "without quotes: a number of page loads a minute")],
    "pace_long_wait.yaml": [(6, 17, "pace[0].max_wait_s", "less than or equal to 30, got 120", "0 to 30 seconds")],
    "pace_public_suffix.yaml": [(3, 14, "pace[0].pattern", "public suffix com", "registrable domain")],
    "pace_fraction_connections.yaml": [(5, 18, "pace[0].connections", "valid integer, got 2.5", "whole number")],
    "many_errors.yaml": [
        (2, 7, "mode", "'loud'", "mode: enforce"),
        (3, 9, "ports[0]", "valid integer", "without quotes"),
        (5, 5, "allow_always[0]", "bare *", "*.example.com"),
        (7, 5, "block[0].reason", "'reason' is required", "reason"),
        (8, 1, "extra", "unknown key 'extra'", "allowed keys here: version, mode"),
    ],
}


def test_every_broken_file_has_expectations():
    assert sorted(p.name for p in BROKEN.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_file(name):
    path = BROKEN / name
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    issues = info.value.issues
    got = [(i.line, i.col, i.field) for i in issues]
    assert got == [(line, col, field) for line, col, field, _, _ in EXPECTED[name]]
    for issue, (_, _, _, message, hint) in zip(issues, EXPECTED[name], strict=True):
        assert issue.file == str(path)
        assert message in issue.message
        assert issue.hint and hint in issue.hint
        assert str(issue).startswith(f"{path}:{issue.line}:{issue.col}: {issue.field}: ")


def test_shipped_policy():
    p = load_policy()
    assert default_policy_path().name == "sites.yaml"
    assert (p.mode, sorted(p.ports), p.tab_quota, p.version) == ("enforce", [80, 443], 8, 1)
    d = p.decide("www.linkedin.com", 443)
    assert (d.decision, d.reason) == ("deny", "blocked_by_policy")
    line = next(i for i, text in enumerate(default_policy_path().read_text().splitlines(), 1)
                if '"*.linkedin.com"' in text)
    assert d.rule == f"sites.yaml:{line} *.linkedin.com"
    for host in ("clients1.google.com", "update.googleapis.com", "redirector.gvt1.com", "www.gstatic.com"):
        d = p.decide(host, 443)
        assert (d.decision, d.quiet) == ("deny", True), host


def test_size_cap_is_checked_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as fh:  # sparse: large on paper, nothing to parse
        fh.truncate(policy.MAX_POLICY_BYTES + 1)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert "MiB limit" in str(info.value)


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"version: 1\nblock:\n  - pattern: caf\xe9.example\n    reason: x\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert (info.value.issues[0].line, info.value.issues[0].col) == (3, 17)  # the byte 0xe9


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "nope.yaml")
    assert "cannot read" in info.value.issues[0].message


def test_yaml_12_scalars_and_strict_types():
    # yes/no/on/off stay text (no Norway problem); "443" is not a port
    with pytest.raises(PolicyError) as info:
        parse_policy("version: 1\nmode: on\n", "p.yaml")
    assert "'on'" in info.value.issues[0].message
    with pytest.raises(PolicyError):
        parse_policy("version: 1\nports: [true]\n", "p.yaml")
    with pytest.raises(PolicyError):
        parse_policy('version: "1"\n', "p.yaml")


def test_block_reason_must_not_be_blank():
    with pytest.raises(PolicyError) as info:
        parse_policy('version: 1\nblock:\n  - pattern: a.example\n    reason: "  "\n', "p.yaml")
    assert info.value.issues[0].field == "block[0]"


def test_error_list_is_capped_but_counted():
    text = "version: 1\nallow_always:\n" + "".join(f'  - ".bad{i}.example"\n' for i in range(500))
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert len(info.value.issues) == 200 and info.value.more == 300
    assert "... and 300 more" in str(info.value)


def _generated(n: int, grouped: bool) -> str:
    lines = ["version: 1", "block:"]
    names = []
    for i in range(n):
        name = f"h{i}.feed{i % 13}.example" if i % 3 else f"*.w{i}.feed.example"
        names.append(name)
    if grouped:
        lines += ['  - reason: "feed"', "    patterns:"] + [f'      - "{n_}"' for n_ in names]
    else:
        lines += [f'  - {{pattern: "{n_}", reason: "feed"}}' for n_ in names]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "one-mapping-per-entry"])
def test_generated_block_list_keeps_line_numbers(grouped):
    n = 20_000
    p = parse_policy(_generated(n, grouped), "big.yaml")
    assert len(p.block) == n
    first_line = 5 if grouped else 3
    for i in (0, 1, 2, 4_999, 19_998, 19_999):
        name = f"h{i}.feed{i % 13}.example" if i % 3 else f"x.w{i}.feed.example"
        d = p.decide(name, 443)
        pattern = name if i % 3 else f"*.w{i}.feed.example"
        assert (d.reason, d.rule) == ("blocked_by_policy", f"big.yaml:{first_line + i} {pattern}"), i
    assert p.decide("h1.feed1.example.org", 443).reason == "not_allowed"


def test_fast_and_full_pattern_paths_agree():
    # The bulk loader takes plain names straight into the index; everything else takes
    # parse_pattern. Both must give the same rules and refuse the same entries.
    entries = ["Upper.Example", "a.example", "*.b.example", "*.com", "*.github.io", "*.co.uk",
               "x" * 64 + ".example", "a..example", "xn--bcher-kva.example", "xn--zz.example",
               "1.2.3.4", "10.0.0.0/8", "example.123", "0x7f.1", "under_score.example",
               "-lead.example", "*.xn--bcher-kva.example", "a.example:8443"]
    text = "version: 1\nblock:\n  - reason: r\n    patterns:\n" + "".join(f'      - "{e}"\n' for e in entries)
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    refused = sorted(i.field for i in info.value.issues)
    expected_refused = []
    for i, entry in enumerate(entries):
        try:
            policy.parse_pattern(entry, allow_list=False)
        except policy.PatternError:
            expected_refused.append(f"block[0].patterns[{i}]")
    assert refused == sorted(expected_refused)
    # *.com, *.co.uk, the 64-character label, a..example, xn--zz, example.123, 0x7f.1
    assert len(refused) == 7


def test_alias_bomb_is_refused_at_the_first_anchor():
    levels = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for k in range(1, 12):
        prev, cur = chr(ord("a") + k - 1), chr(ord("a") + k)
        levels.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    with pytest.raises(PolicyError) as info:
        parse_policy("version: 1\n" + "\n".join(levels) + "\n", "bomb.yaml")
    assert [(i.line, i.field) for i in info.value.issues] == [(2, "(yaml)")]


def test_fast_path_rules_match_like_full_path_rules():
    entries = ["Upper.Example", "a.example", "*.b.example", "*.github.io", "xn--bcher-kva.example",
               "1.2.3.4", "10.0.0.0/8", "under_score.example", "*.xn--bcher-kva.example", "a.example:8443"]
    text = ("version: 1\nports: [443, 8443]\nblock:\n  - reason: r\n    patterns:\n"
            + "".join(f'      - "{e}"\n' for e in entries))
    p = parse_policy(text, "p.yaml")
    for i, entry in enumerate(entries):
        pattern = policy.parse_pattern(entry, allow_list=False)
        host = pattern.key
        if pattern.kind == "cidr":
            host = "10.1.2.3"
        elif pattern.kind == "wild":
            host = "x." + pattern.key
        d = p.decide(host, pattern.port or 443)
        assert (d.reason, d.rule) == ("blocked_by_policy", f"p.yaml:{6 + i} {pattern.text}"), entry
