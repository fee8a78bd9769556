"""`read_request_head`: mitmproxy's HTTP/1 request-head parser, with its pure checks remembered.

`read_request_head(lines)` gives the same request, and refuses the same request lines, as
mitmproxy's `http1.read_request_head`, but checks an absolute-form line's authority once per
(scheme, authority); any line it cannot answer for goes through mitmproxy's own parser.
tests/proxy/test_request_head.py holds the parity table. Why, the measurements, and when the
remembered check stands for mitmproxy's: docs/decisions/0031-request-head-checked-once-per-authority.md.

It also holds the guard's one check of a request head's framing and Host (RFC 9112 2.2, 5.2,
3.2, 3.2.2), used on every path: plain proxied requests (plain_http.PlainHttpLayer, and
ConnectGuard's `requestheaders`/`http_connect`, which the stock mitmproxy layers reach too),
CONNECT heads (layers.BoundedHttpLayer) and every request inside a plain-HTTP tunnel
(tunnel_http): `head_fault`/`raw_head_fault` (`head_lone_cr`, `head_bare_lf`, `head_obs_fold`,
`head_nul`), `field_fault` and `host_fault` (`host_header_missing`, `host_header_repeated`,
`host_header_mismatch`). A refused head gets `400` with `X-Sfguard-Decision: deny; reason=CODE`
(`refusal_answer`). What each code refuses, and why: docs/proxy.md, "Request heads: what is
refused and why".
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from mitmproxy import http
from mitmproxy.net.http import http1, url
from mitmproxy.net.http.http1 import read as http1_read

from sfguard import policy
from sfguard.proxy_addons.state import DECISION_HEADER

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


HEAD_LONE_CR = "head_lone_cr"
HEAD_BARE_LF = "head_bare_lf"
HEAD_OBS_FOLD = "head_obs_fold"
HEAD_NUL = "head_nul"
HOST_MISSING = "host_header_missing"
HOST_REPEATED = "host_header_repeated"
HOST_MISMATCH = "host_header_mismatch"

#: What each refusal means, for the one-line answer an agent reads.
EXPLAIN = {
    HEAD_LONE_CR: "its head holds a CR that does not end a line (RFC 9112 2.2)",
    HEAD_BARE_LF: "a line of its head ends in LF without CR (RFC 9112 2.2)",
    HEAD_OBS_FOLD: "a header line starts with a space or tab (obs-fold, RFC 9112 5.2)",
    HEAD_NUL: "its head holds a NUL byte (RFC 9110 5.5)",
    HOST_MISSING: "an HTTP/1.1 request needs a Host header (RFC 9112 3.2)",
    HOST_REPEATED: "it has more than one Host header (RFC 9112 3.2)",
    HOST_MISMATCH: "its Host header or target names another host than the one judged (RFC 9112 3.2.2)",
}


def head_fault(lines: Sequence[bytes], taken: int) -> str | None:
    """The framing fault of a request head, or None. `lines`: the head as h11's
    `ReceiveBuffer.maybe_extract_lines` returns it (split at LF, one CR before it removed, the
    empty last line dropped); `taken`: how many bytes the head took from the buffer. A head
    whose every line ends in CRLF took exactly the lines plus two bytes each, plus the CRLF of
    the empty line: fewer means some line ended in a bare LF."""
    size = 2
    for i, line in enumerate(lines):
        size += len(line) + 2
        if b"\r" in line:
            return HEAD_LONE_CR
        if b"\x00" in line:
            return HEAD_NUL
        if i and line[:1] in (b" ", b"\t"):
            return HEAD_OBS_FOLD
    if size != taken:
        return HEAD_BARE_LF
    return None


def raw_head_fault(head: bytes) -> str | None:
    """`head_fault` of raw bytes that hold a whole head (up to and with its empty line)."""
    if head.count(b"\r") != head.count(b"\r\n"):
        return HEAD_LONE_CR
    if b"\x00" in head:
        return HEAD_NUL
    if b"\n " in head or b"\n\t" in head:
        return HEAD_OBS_FOLD
    if head.count(b"\n") != head.count(b"\r\n"):
        return HEAD_BARE_LF
    return None


def field_fault(fields: Sequence[tuple[bytes, bytes]]) -> str | None:
    """A parsed head's fault that its fields still show: a CR, LF or NUL in a name or value
    (mitmproxy's parser keeps a lone CR in a value, and joins an obs-fold into it with CRLF).
    This is what the `requestheaders` and `http_connect` hooks can check on any layer stack."""
    for name, value in fields:
        for text in (name, value):
            if b"\n" in text:
                return HEAD_OBS_FOLD
            if b"\r" in text:
                return HEAD_LONE_CR
            if b"\x00" in text:
                return HEAD_NUL
    return None


def host_fault(hosts: Sequence[str], http_version: str, host: str, port: int,
               default_port: int) -> str | None:
    """The Host fault of a request judged for (normalised `host`, `port`), or None. `hosts`:
    the values of its Host lines. A Host without a port names `default_port`."""
    if len(hosts) > 1:
        return HOST_REPEATED
    if not hosts:
        return HOST_MISSING if http_version == "HTTP/1.1" else None
    return None if same_host(hosts[0], host, port, default_port) else HOST_MISMATCH


def same_host(value: str, host: str, port: int, default_port: int) -> bool:
    """True when `value` (HOST[:PORT]; without a port: `default_port`) names normalised `host`
    and `port`."""
    try:
        return policy.split_host_port(value.strip(), default_port=default_port) == (host, port)
    except policy.MalformedHost:
        return False


def refusal_answer(code: str, explanation: str | None = None) -> bytes:
    """The `400` answer to a refused head: the decision header and a one-line explanation;
    the connection is closed after it."""
    text = explanation or f"The guard refused this request: {EXPLAIN[code]}."
    body = ("sfguard: " + text.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "replace")
    return (f"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"{DECISION_HEADER}: deny; reason={code}\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body
