"""`read_request_head`: mitmproxy's HTTP/1 request-head parser, with its pure checks remembered.

mitmproxy's `http1.read_request_head` checks an absolute-form request line
(`GET http://host:port/path HTTP/1.1`, how a browser sends every http:// request to a proxy)
with two parsers, both on every request: `url.parse_authority(authority, check=True)` (the host
and port it returns) and `url.parse(target)` (urllib, IDNA; a check only, its result unused).
Measured in the run proxy (cProfile, plain GETs on kept-alive connections) the two took about a
tenth of its CPU per request, for the same few authorities again and again.

This module gives the same answer and refuses the same request lines, doing that work once per
(scheme, authority). For an ASCII target whose authority holds no `?` or `#`, what `url.parse`
can refuse depends only on the scheme and the authority (the path of an ASCII target can make
neither urllib nor the ASCII re-encoding fail), so the check of `scheme://authority/` stands for
it. Any other request line (origin form, CONNECT, a non-ASCII target, `?`/`#` in the authority,
an authority longer than `MAX_CACHED_AUTHORITY`, any refusal) goes through mitmproxy's own
`read_request_head`, which produces the answer and the error message.
tests/proxy/test_request_head.py holds the parity table.
"""
from __future__ import annotations

import functools
import time

from mitmproxy import http
from mitmproxy.net.http import http1, url
from mitmproxy.net.http.http1 import read as http1_read

#: Longest authority whose check is remembered (a DNS name is at most 253 characters; a port
#: and brackets fit in what is left). Longer ones are checked every time, so the cache holds
#: at most `CACHE_SIZE` short keys.
MAX_CACHED_AUTHORITY = 300
CACHE_SIZE = 512
#: Versions mitmproxy's `raise_if_http_version_unknown` accepts that a browser sends.
_KNOWN_VERSIONS = frozenset((b"HTTP/1.0", b"HTTP/1.1"))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _checked_authority(scheme: bytes, authority: bytes) -> tuple[str, int]:
    """(host, port) of an absolute-form target's authority, checked exactly as mitmproxy's
    `_read_request_line` checks it. Raises ValueError (not remembered: lru_cache keeps only
    answers)."""
    host, port = url.parse_authority(authority, check=True)
    port = port or url.default_port(scheme)
    if not port:
        raise ValueError("no port")
    url.parse(scheme + b"://" + authority + b"/")
    return host, port


def read_request_head(lines: list[bytes]) -> http.Request:
    """A request head (request line and header lines, without the empty line) as mitmproxy's
    `http1.read_request_head` reads it. Raises ValueError for what that refuses."""
    parts = lines[0].split()
    if len(parts) == 3:
        method, target, version = parts
        if (version in _KNOWN_VERSIONS and method != b"CONNECT" and target.isascii()
                and not target.startswith(b"/") and target != b"*"):
            scheme, sep, rest = target.partition(b"://")
            authority, _, path = rest.partition(b"/")
            if (sep and len(authority) <= MAX_CACHED_AUTHORITY
                    and b"?" not in authority and b"#" not in authority):
                try:
                    host, port = _checked_authority(scheme, authority)
                except ValueError:
                    pass  # mitmproxy's own parser below raises with its message
                else:
                    return http.Request(
                        host=host, port=port, method=method, scheme=scheme, authority=authority,
                        path=b"/" + path, http_version=version,
                        headers=http1_read._read_headers(lines[1:]),
                        content=None, trailers=None, timestamp_start=time.time(), timestamp_end=None)
    return http1.read_request_head(lines)
