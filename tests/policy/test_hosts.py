"""Host normalisation and pattern parsing: table-driven, many adversarial spellings."""
from __future__ import annotations

import pytest

from sfguard.policy import MalformedHost, PatternError, compile_patterns, normalize_host, parse_pattern, split_host_port
from sfguard.policy.errors import PolicyError

BAD = MalformedHost  # marker: normalisation must refuse the input

NORMALIZE = [
    # plain names: case, trailing dot
    ("example.com", "example.com"),
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),
    ("example.com..", BAD),
    (".example.com", BAD),
    ("a..example.com", BAD),
    ("", BAD),
    (".", BAD),
    ("localhost", "localhost"),
    ("1.2.3.4.example.com", "1.2.3.4.example.com"),
    ("0x.example.com", "0x.example.com"),
    # underscores and hyphens are allowed in labels (Chrome resolves them)
    ("a_b.example.com", "a_b.example.com"),
    ("-a.example.com", "-a.example.com"),
    # label and name lengths
    ("a" * 63 + ".com", "a" * 63 + ".com"),
    ("a" * 64 + ".com", BAD),
    (".".join(["a" * 63] * 3 + ["b" * 61]), ".".join(["a" * 63] * 3 + ["b" * 61])),  # 253
    (".".join(["a" * 63] * 3 + ["b" * 62]), BAD),  # 254
    ("a" * 2000, BAD),
    # IDN: UTS #46 mapping, then A-labels
    ("BÜCHER.de", "xn--bcher-kva.de"),
    ("bücher.de.", "xn--bcher-kva.de"),
    ("xn--bcher-kva.de", "xn--bcher-kva.de"),
    ("XN--BCHER-KVA.DE", "xn--bcher-kva.de"),
    ("xn--zz.de", BAD),  # not valid punycode
    ("faß.de", "xn--fa-hia.de"),  # non-transitional, as browsers
    ("例え.テスト", "xn--r8jz45g.xn--zckzah"),
    ("ｅｘａｍｐｌｅ．ｃｏｍ", "example.com"),  # fullwidth letters and dot
    ("example。com", "example.com"),  # ideographic full stop
    ("goo\u00adgle.com", "google.com"),  # soft hyphen is ignored by UTS #46
    ("exаmple.com", "xn--exmple-4nf.com"),  # Cyrillic a: a different host, never example.com
    ("a\u200db.com", BAD),  # zero-width joiner outside its context
    ("ａ＠b.com", BAD),  # fullwidth @ maps to @
    ("a／b.com", BAD),  # fullwidth solidus maps to /
    # IPv4: canonical dotted quad only
    ("127.0.0.1", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"),
    ("１２７.０.０.１", "127.0.0.1"),  # fullwidth digits map to ASCII
    ("2130706433", BAD),  # decimal
    ("0177.0.0.1", BAD),  # octal
    ("0x7f.0.0.1", BAD),  # hex
    ("0x7f.1", BAD),  # hex, short
    ("0X7F000001", BAD),
    ("127.1", BAD),  # short
    ("127.0.1", BAD),
    ("127.0.0.01", BAD),  # leading zero
    ("127.0.0.1.5", BAD),  # five parts
    ("1.2.3.256", BAD),
    ("example.123", BAD),  # ends in a number: an IPv4 attempt
    ("example.0x1f", BAD),
    ("0", BAD),
    # IPv6
    ("::1", "::1"),
    ("[::1]", "::1"),
    ("[0:0:0:0:0:0:0:1]", "::1"),
    ("2001:DB8::1", "2001:db8::1"),
    ("::ffff:127.0.0.1", "127.0.0.1"),  # IPv4-mapped
    ("[::FFFF:7f00:1]", "127.0.0.1"),
    ("::ffff:169.254.169.254", "169.254.169.254"),
    ("::ffff:0177.0.0.1", BAD),
    ("[::1", BAD),
    ("::1]", BAD),
    ("[example.com]", BAD),
    (":::1", BAD),
    ("fe80::1%eth0", BAD),  # zone ids are refused
    ("[fe80::1%25eth0]", BAD),
    # smuggling: ports, user info, paths, queries, fragments, escapes, spaces, controls
    ("example.com:443", BAD),
    ("a.com@b.com", BAD),
    ("user:pass@b.com", BAD),
    ("a.com/x", BAD),
    ("a.com#b.com", BAD),
    ("a.com?x", BAD),
    ("a.com\\b.com", BAD),
    ("a%2ecom", BAD),
    ("example%2Ecom", BAD),
    (" example.com", BAD),
    ("example.com ", BAD),
    ("exa mple.com", BAD),
    ("a\tb.com", BAD),
    ("example.com\n", BAD),
    ("example.com\r\nX-Injected: 1", BAD),
    ("example.com\x00.evil.com", BAD),
    ("a\u3000b.com", BAD),  # ideographic space
    ("a.com\u2028", BAD),
    ("\ufeffexample.com", BAD),
    ("*.example.com", BAD),
    ("exa!mple.com", BAD),
    ("exa,mple.com", BAD),
]


@pytest.mark.parametrize("text,expected", NORMALIZE, ids=[repr(t)[:40] for t, _ in NORMALIZE])
def test_normalize_host(text, expected):
    if expected is BAD:
        with pytest.raises(MalformedHost) as info:
            normalize_host(text)
        assert info.value.reason  # always says why
        assert "pass" not in info.value.reason  # never echoes user info
    else:
        assert normalize_host(text) == expected
        assert normalize_host(expected) == expected  # idempotent


def test_normalize_refuses_non_text():
    for value in (None, 127, b"example.com"):
        with pytest.raises(MalformedHost):
            normalize_host(value)  # type: ignore[arg-type]  # non-text on purpose


SPLIT = [
    ("[::1]:443", None, ("::1", 443)),
    ("[::1]", 443, ("::1", 443)),
    ("::1", 443, ("::1", 443)),  # a bare IPv6 literal has no port
    ("a.com:80", None, ("a.com", 80)),
    ("A.com", 443, ("a.com", 443)),
    ("a.com", None, ("a.com", None)),
    ("127.0.0.1:8080", None, ("127.0.0.1", 8080)),
    ("a.com:65535", None, ("a.com", 65535)),
    ("a.com:0", None, BAD),
    ("a.com:65536", None, BAD),
    ("a.com:", None, BAD),
    ("a.com:+80", None, BAD),
    ("a.com:8o", None, BAD),
    ("a.com: 80", None, BAD),
    ("a.com:80:90", None, BAD),
    ("[::1]x", None, BAD),
    ("[::1", None, BAD),
    ("0x7f.1:80", None, BAD),
]


@pytest.mark.parametrize("text,default,expected", SPLIT, ids=[t for t, _, _ in SPLIT])
def test_split_host_port(text, default, expected):
    if expected is BAD:
        with pytest.raises(MalformedHost):
            split_host_port(text, default)
    else:
        assert split_host_port(text, default) == expected


PATTERNS_OK = [
    ("example.com", "name", "example.com"),
    ("Example.COM.", "name", "example.com"),
    ("*.Example.com", "wild", "*.example.com"),
    ("*.bücher.de", "wild", "*.xn--bcher-kva.de"),
    ("example.com:8443", "name", "example.com:8443"),
    ("*.example.com:8443", "wild", "*.example.com:8443"),
    ("192.0.2.10", "ip", "192.0.2.10"),
    ("192.0.2.10:8080", "ip", "192.0.2.10:8080"),
    ("10.0.0.5/32", "ip", "10.0.0.5"),
    ("10.0.0.0/8", "cidr", "10.0.0.0/8"),
    ("10.0.0.0/8:8080", "cidr", "10.0.0.0/8:8080"),
    ("2001:DB8::1", "ip", "2001:db8::1"),
    ("[::1]:8080", "ip", "[::1]:8080"),
    ("fd00::/8", "cidr", "fd00::/8"),
    ("[fd00::/8]:443", "cidr", "[fd00::/8]:443"),
    ("::ffff:127.0.0.1", "ip", "127.0.0.1"),
    ("::ffff:10.0.0.0/104", "cidr", "10.0.0.0/8"),
    ("*.www.ck", "wild", "*.www.ck"),  # an exception to the *.ck public-suffix rule
    ("*.example.co.uk", "wild", "*.example.co.uk"),
]


@pytest.mark.parametrize("text,kind,canonical", PATTERNS_OK, ids=[t for t, _, _ in PATTERNS_OK])
def test_parse_pattern(text, kind, canonical):
    pattern = parse_pattern(text)
    assert (pattern.kind, pattern.text) == (kind, canonical)


# (pattern, part of the message, part of the hint)
PATTERNS_BAD = [
    ("*", "bare *", "*.example.com"),
    ("**.a.com", "whole leftmost label", "*.a.com"),
    ("*a.com", "whole leftmost label", "write *.a.com"),
    ("a*.b.com", "whole leftmost label", "write *.b.com"),
    ("a.*.example.com", "whole leftmost label", "write *.example.com"),
    ("*.*.example.com", "whole leftmost label", "*.example.com"),
    (".example.com", "start with a dot", "write *.example.com"),
    ("*.com", "public suffix com", "*.example.com"),
    ("*.co.uk", "public suffix co.uk", "*.example.co.uk"),
    ("*.github.io", "public suffix github.io", "registrable domain"),
    ("*.foo.ck", "public suffix foo.ck", "registrable domain"),  # under the *.ck rule
    ("*.localhost", "public suffix localhost", "registrable domain"),  # any single label
    ("*.127.0.0.1", "cannot prefix an IP", "CIDR"),
    ("10.0.0.1/8", "host bits", "write 10.0.0.0/8"),
    ("10.0.0.0/33", "not a valid CIDR", "10.0.0.0/8"),
    ("010.0.0.0/8", "not a valid CIDR", "browsers read 010.0.0.0 as 8.0.0.0"),
    ("a.com:0", "port", "1-65535"),
    ("a.com:70000", "port", "1-65535"),
    ("a.com:http", "port", "1-65535"),
    ("http://a.com/x", "not URLs", "write the host only: a.com"),
    ("a.com/path", "not URLs", "write the host only: a.com"),
    ("user@a.com", "user info", "write the host only: a.com"),
    ("0x7f.1", "canonical IPv4", "browsers read 0x7f.1 as 127.0.0.1"),
    ("2130706433", "canonical IPv4", "browsers read 2130706433 as 127.0.0.1"),
    ("0177.0.0.1", "canonical IPv4", "browsers read 0177.0.0.1 as 127.0.0.1"),
    (" a.com", "spaces", "'a.com'"),
    ("", "empty pattern", "example.com"),
    ("a..com", "empty label", "doubled"),
    ("a.com%2f", "percent", None),
    ("[example.com]", "IPv6", None),
    ("fe80::1%eth0", "zone", None),
]


@pytest.mark.parametrize("text,message,hint", PATTERNS_BAD, ids=[repr(t) for t, _, _ in PATTERNS_BAD])
def test_bad_patterns_have_hints(text, message, hint):
    with pytest.raises(PatternError) as info:
        parse_pattern(text, allow_list=True)
    assert message in info.value.message
    if hint is None:
        return
    assert info.value.hint is not None and hint in info.value.hint


def test_private_section_suffixes_may_be_blocked_but_not_allowed():
    # blocking or quieting every GitHub Pages site is safe; allowing them all is not
    assert parse_pattern("*.github.io", allow_list=False).text == "*.github.io"
    assert parse_pattern("*.googleapis.com", allow_list=False).text == "*.googleapis.com"
    with pytest.raises(PatternError):
        parse_pattern("*.github.io", allow_list=True)
    with pytest.raises(PatternError):  # ICANN suffixes are refused everywhere
        parse_pattern("*.com", allow_list=False)


def test_compile_patterns_reports_every_bad_entry_with_its_index():
    with pytest.raises(PolicyError) as info:
        compile_patterns(["*.example.com", "*", "ok.example.org", ".example.net"])
    got = [(i.field, i.file, i.line, i.hint is not None) for i in info.value.issues]
    assert got == [("allow_domains[1]", "--allow", None, True), ("allow_domains[3]", "--allow", None, True)]
    assert str(info.value.issues[1]).startswith("--allow: allow_domains[3]: a pattern cannot start with a dot")


def test_compile_patterns_accepts_a_single_string_and_empty_list():
    assert len(compile_patterns("*.example.com")) == 1
    assert len(compile_patterns([])) == 0
