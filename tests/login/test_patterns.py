"""URL patterns of the login check and the decision table (pure, no browser)."""
from __future__ import annotations

import pytest

from sfguard.supervisor.browsers.login import (
    LoginCheckError,
    compile_pattern,
    decide_login,
    match_pattern,
    shown_url,
)

SITE = "http://127.0.0.1:8080"

PATTERN_CASES = [
    # (pattern, url, expected)
    # glob: whole URL, `*` = any run of characters (also none, also "/")
    (f"{SITE}/account", f"{SITE}/account", True),
    (f"{SITE}/account", f"{SITE}/account/", False),             # whole URL, no prefix match
    (f"{SITE}/account", f"{SITE}/accounts", False),
    (f"{SITE}/login*", f"{SITE}/login?next=/account", True),
    (f"{SITE}/login*", f"{SITE}/login", True),                  # * matches nothing too
    (f"{SITE}/login*", f"{SITE}/account?from=/login", False),   # anchored at the start
    ("*/login*", f"{SITE}/sso/login/start", True),             # * spans "/"
    ("*", "about:blank", True),                                 # * alone matches everything
    ("*", "", True),
    ("**", f"{SITE}/x", True),                                  # runs of * collapse
    (f"{SITE}/a*b*c", f"{SITE}/a-b-c", True),
    (f"{SITE}/a*b*c", f"{SITE}/a-c-b", False),
    # literal characters that are special elsewhere
    (f"{SITE}/login?next=*", f"{SITE}/login?next=/account", True),   # ? is literal
    (f"{SITE}/login?next=*", f"{SITE}/loginXnext=/account", False),  # ... not "any one char"
    ("http://127.0.0.1:8080/a.b", "http://127.0.0.1:8080/aXb", False),  # . is literal
    (f"{SITE}/[ab]", f"{SITE}/[ab]", True),                     # brackets literal
    (f"{SITE}/[ab]", f"{SITE}/a", False),
    (f"{SITE}/a+b", f"{SITE}/a+b", True),
    (f"{SITE}/a+b", f"{SITE}/aab", False),
    (f"{SITE}/ACCOUNT", f"{SITE}/account", False),              # case-sensitive
    # regular expressions: re.fullmatch over the whole URL
    (r"re:http://127\.0\.0\.1:8080/(account|home)", f"{SITE}/home", True),
    (r"re:http://127\.0\.0\.1:8080/(account|home)", f"{SITE}/home/x", False),  # implicit end anchor
    (r"re:/account", f"{SITE}/account", False),                 # implicit start anchor
    (r"re:.*/account", f"{SITE}/account", True),
    (r"re:^http://127\.0\.0\.1:8080/login.*$", f"{SITE}/login?next=/account", True),  # explicit anchors ok
    (r"re:.*/login\?next=.*", f"{SITE}/login?next=/account", True),
    (r"re:.*/login\?next=.*", f"{SITE}/login", False),
]


@pytest.mark.parametrize("pattern,url,expected", PATTERN_CASES)
def test_match_pattern(pattern, url, expected):
    assert match_pattern(pattern, url) is expected


@pytest.mark.parametrize("pattern,fragment", [
    ("re:(unclosed", "re:(unclosed"),
    ("re:a{2,1}", "re:a{2,1}"),
    ("re:", "empty regular expression"),
    ("", "non-empty"),
])
def test_invalid_patterns_raise_a_value_error_naming_the_pattern(pattern, fragment):
    with pytest.raises(ValueError) as exc:
        compile_pattern(pattern)
    assert fragment in str(exc.value)
    with pytest.raises(ValueError):
        match_pattern(pattern, f"{SITE}/x")


IN = f"{SITE}/account"
OUT = [f"{SITE}/login*", f"{SITE}/sso/*"]

DECIDE_CASES = [
    # (final_url, logged_in, logged_out, selector_found, expected)
    (f"{SITE}/account", IN, OUT, None, True),
    (f"{SITE}/login?next=/account", IN, OUT, None, False),
    (f"{SITE}/sso/start", IN, OUT, None, False),
    # selector rule: a logged-in URL also needs the selector when one is given
    (f"{SITE}/account", IN, OUT, True, True),
    (f"{SITE}/account", IN, OUT, False, False),
    # a logged-out URL is False whatever the selector says
    (f"{SITE}/login", IN, OUT, True, False),
    (f"{SITE}/login", IN, OUT, False, False),
    # no logged_out patterns at all: a logged-in URL still decides
    (f"{SITE}/account", IN, [], None, True),
]


@pytest.mark.parametrize("url,li,lo,sel,expected", DECIDE_CASES)
def test_decide_login(url, li, lo, sel, expected):
    assert decide_login(url, li, lo, sel) is expected


@pytest.mark.parametrize("url,li,lo,needle", [
    (f"{SITE}/welcome", IN, OUT, "matches neither"),         # neither: never a guess
    (f"{SITE}/welcome", IN, [], "none given"),
    (f"{SITE}/login", f"{SITE}/*", OUT, "matches both"),      # both: ambiguous
    (f"{SITE}/account", "*", ["*"], "matches both"),
])
def test_decide_login_refuses_to_guess(url, li, lo, needle):
    with pytest.raises(LoginCheckError) as exc:
        decide_login(url, li, lo)
    assert needle in str(exc.value)
    assert url in str(exc.value)


@pytest.mark.parametrize("url,shown", [
    ("https://idp.test/auth?client_id=app&state=s3cr3t&code_challenge=abc", "https://idp.test/auth?client_id=…&state=…&code_challenge=…"),
    ("https://user:pw@app.test:8443/cb?code=xyz#frag", "https://app.test:8443/cb?code=…"),
    ("http://[::1]:8080", "http://[::1]:8080/"),
    ("http://site-a.test/account", "http://site-a.test/account"),
    ("chrome-error://chromewebdata/", "chrome-error:"),
    ("http://a.test:99999/", "(an address that does not parse)"),
])
def test_an_answers_address_hides_query_values_and_user_info(url, shown):
    assert shown_url(url) == shown
