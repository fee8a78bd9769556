"""HOST:PORT as sfguard writes it back to people: IPv6 bracketed (the live view's URL is in
tests/console/test_liveview_tab.py)."""
from __future__ import annotations

import pytest

from sfguard import policy
from sfguard.policy.patterns import parse_pattern


@pytest.mark.parametrize("text, canonical", [
    ("example.com:8443", "example.com:8443"),
    ("*.Example.com:8443", "*.example.com:8443"),
    ("[2001:db8::1]:8080", "[2001:db8::1]:8080"),
    ("2001:db8::1", "2001:db8::1"),
    ("example.com", "example.com"),
])
def test_pattern_text(text, canonical):
    assert str(parse_pattern(text)) == canonical


@pytest.mark.parametrize("host, port, hint", [
    ("example.com", 8080, "a pattern such as example.com:8080 allows one more"),
    ("2001:db8::1", 8080, "a pattern such as [2001:db8::1]:8080 allows one more"),
])
def test_port_hint_is_a_pattern_that_parses(host, port, hint):
    site = policy.parse_policy("version: 1\n")
    d = site.decide(host, port, allow=policy.compile_patterns([host]))
    assert d.reason == "port_not_allowed"
    assert hint in d.explanation
    suggested = d.explanation.split("a pattern such as ", 1)[1].split(" ", 1)[0]
    assert parse_pattern(suggested).port == port

