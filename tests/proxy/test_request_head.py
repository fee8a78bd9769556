"""proxy_addons/request_head.py answers and refuses exactly as mitmproxy's `read_request_head`.

Every request line is read twice by the guard's reader (the second read answers from the
remembered authority check) and once by mitmproxy's; both must refuse it, or both must return
the same request.
"""
from __future__ import annotations

import random

import pytest
from mitmproxy.net.http import http1

from sfguard.proxy_addons import request_head

HEADERS = [b"Host: site-1.test:8080", b"Accept: */*", b"Proxy-Connection: keep-alive"]

LINES = [
    # what browsers send
    b"GET http://site-1.test:8080/s1.js HTTP/1.1",
    b"GET http://site-1.test/ HTTP/1.1",
    b"POST http://example.com/form?a=1&b=%20 HTTP/1.0",
    b"GET http://127.0.0.1:9/x HTTP/1.1",
    b"GET http://[::1]:8080/ HTTP/1.1",
    b"GET http://[2001:db8::1]/ HTTP/1.1",
    b"GET http://xn--bcher-kva.example/ HTTP/1.1",
    b"GET https://site-1.test/ HTTP/1.1",
    b"HEAD http://site-1.test:65535/ HTTP/1.1",
    b"GET http://site-1.test./trailing-dot HTTP/1.1",
    b"GET http://site-1.test HTTP/1.1",                     # no path
    b"GET http://site-1.test/a#frag HTTP/1.1",
    b"GET http://site-1.test/\x01ctl HTTP/1.1",
    b"get http://site-1.test/ HTTP/1.1",
    # refused
    b"GET http://site-1.test:0/ HTTP/1.1",
    b"GET http://site-1.test:65536/ HTTP/1.1",
    b"GET http://site-1.test:port/ HTTP/1.1",
    b"GET http://site-1.test:/ HTTP/1.1",
    b"GET http://user@site-1.test/ HTTP/1.1",
    b"GET http://user:pw@site-1.test/ HTTP/1.1",
    b"GET http:///nohost HTTP/1.1",
    b"GET http://site_1.test/ HTTP/1.1",
    b"GET http://-bad-.test/ HTTP/1.1",
    b"GET http://" + b"a" * 64 + b".test/ HTTP/1.1",       # a label over 63
    b"GET http://" + b"a." * 140 + b"test/ HTTP/1.1",       # a name over 255
    b"GET http://" + b"a" * 400 + b"/ HTTP/1.1",            # longer than the remembered limit
    b"GET http://[::1/ HTTP/1.1",
    b"GET http://[zz::1]/ HTTP/1.1",
    b"GET http://::1/ HTTP/1.1",
    b"GET http://site-1.test?x=1 HTTP/1.1",
    b"GET http://site-1.test#f HTTP/1.1",
    b"GET http://si\x00te.test/ HTTP/1.1",
    b"GET http://si te.test/ HTTP/1.1",
    b"GET ftp://site-1.test/ HTTP/1.1",                     # no default port
    b"GET ftp://site-1.test:21/ HTTP/1.1",
    b"GET HTTP://site-1.test/ HTTP/1.1",
    b"GET 1http://site-1.test:80/ HTTP/1.1",
    b"GET ://site-1.test:80/ HTTP/1.1",
    b"GET site-1.test:80 HTTP/1.1",
    b"GET http://b\xc3\xbccher.example/ HTTP/1.1",          # non-ASCII: mitmproxy's path
    b"GET http://site-1.test/p\xc3\xa4th HTTP/1.1",
    b"GET http://site-1.test/?q=\xc3\xa4 HTTP/1.1",
    b"GET http://site-1.test/\xff HTTP/1.1",
    b"GET http://site-1.test/ HTTP/2.0",
    b"GET http://site-1.test/ HTTP/1.1.1",
    b"GET http://site-1.test/ http/1.1",
    b"GET http://site-1.test/",
    b"GET http://site-1.test/ HTTP/1.1 extra",
    b"CONNECT site-1.test:443 HTTP/1.1",
    b"GET / HTTP/1.1",
    b"OPTIONS * HTTP/1.1",
    b"",
]


def _read(reader, lines):
    try:
        r = reader(lines)
    except ValueError as exc:
        return ("refused", str(exc))
    return ("read", r.host, r.port, r.method, r.scheme, r.authority, r.path, r.http_version,
            r.headers.fields)


def _same(line: bytes) -> None:
    lines = [line, *HEADERS]
    want = _read(http1.read_request_head, lines)
    for _ in range(2):  # the second read answers from the remembered check
        got = _read(request_head.read_request_head, lines)
        assert got[0] == want[0], (line, got, want)
        if want[0] == "read":
            assert got == want, line


@pytest.mark.parametrize("line", LINES, ids=[repr(x)[:60] for x in LINES])
def test_same_answer_as_mitmproxy(line):
    _same(line)


def test_same_answer_for_random_lines():
    """Request lines built from the pieces that matter to either parser (seeded, bounded)."""
    rng = random.Random(14)
    schemes = [b"http", b"https", b"HTTP", b"ftp", b"h", b""]
    hosts = [b"site-1.test", b"a.b", b"127.0.0.1", b"[::1]", b"[::1", b"::1", b"xn--bcher-kva.ex",
             b"-x.test", b"x_y.test", b"", b"u@h.test", b"h\x00", b"h%41.test", b"1.2.3.4.5", b"..",
             b"b\xc3\xbccher.ex", b"h.test.", b"H.TEST"]
    ports = [b"", b":80", b":0", b":65535", b":65536", b":", b":8x", b":080", b":-1", b":+80", b": 80"]
    paths = [b"/", b"", b"/a?b#c", b"?x", b"#x", b"/%00", b"/\xc3\xa4", b"/\x7f", b"//x", b"/?\xc3\xa4"]
    for _ in range(3000):
        target = rng.choice(schemes) + rng.choice([b"://", b":/", b"//"]) + rng.choice(hosts) \
            + rng.choice(ports) + rng.choice(paths)
        _same(rng.choice([b"GET", b"POST", b"CONNECT"]) + b" " + target + b" "
              + rng.choice([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b"HTTP/1"]))


def test_remembers_only_short_authorities():
    request_head._checked_authority.cache_clear()
    request_head.read_request_head([b"GET http://site-1.test:8080/x HTTP/1.1", *HEADERS])
    request_head.read_request_head([b"GET http://site-1.test:8080/y HTTP/1.1", *HEADERS])
    long_name = b".".join([b"a" * 60] * 5)  # 304 characters: checked every time, never kept
    with pytest.raises(ValueError):
        request_head.read_request_head([b"GET http://" + long_name + b"/ HTTP/1.1"])
    info = request_head._checked_authority.cache_info()
    assert (info.hits, info.currsize) == (1, 1)
    assert info.maxsize == request_head.CACHE_SIZE
