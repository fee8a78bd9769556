"""Attacks on the guard proxy (issue 14), each through a real `sfguard proxy` over raw sockets,
each asserting that NOTHING reached the upstream (a loopback server that records every byte)
and that the refusal is in the decision log. Then report mode: it relaxes the allow and block
lists only; every hard check still refuses."""
from __future__ import annotations

import contextlib
import inspect
import os
import socket
import struct
import time

import pytest

from sfguard.proxy_addons.state import GuardState

from .conftest import TOKEN_A, basic, connect, get, read_head, write_policy
from .test_proxy_cli import client_hello, log_lines, wait_closed, wait_for_log

#: the proxy's bound on a request head, which also bounds the first line inside a tunnel
GUARD_MAX_HEAD_BYTES = inspect.signature(GuardState.__init__).parameters["max_head_bytes"].default

A = basic("a", TOKEN_A)


# --- ClientHello builders -----------------------------------------------------------------------
def _ext(etype: int, data: bytes) -> bytes:
    return struct.pack("!HH", etype, len(data)) + data


def sni_ext(*entries: tuple[int, bytes]) -> bytes:
    body = b"".join(struct.pack("!BH", t, len(n)) + n for t, n in entries)
    return _ext(0, struct.pack("!H", len(body)) + body)


def hello(*extensions: bytes) -> bytes:
    """A well-formed ClientHello handshake message (type 1) with these extensions."""
    body = (b"\x03\x03" + os.urandom(32) + b"\x20" + os.urandom(32)
            + struct.pack("!H", 6) + b"\x13\x01\x13\x02\xc0\x2f" + b"\x01\x00")
    exts = b"".join(extensions) + _ext(0x002B, b"\x02\x03\x04")  # supported_versions: TLS 1.3
    body += struct.pack("!H", len(exts)) + exts
    return b"\x01" + len(body).to_bytes(3, "big") + body


def records(message: bytes, size: int = 1 << 14) -> bytes:
    """`message` framed as TLS handshake records of at most `size` bytes each."""
    out = b""
    for i in range(0, len(message), size):
        chunk = message[i:i + size]
        out += b"\x16\x03\x01" + struct.pack("!H", len(chunk)) + chunk
    return out


def ech_ext() -> bytes:
    return _ext(0xFE0D, b"\x00" + b"\x00\x01\x00\x01" + b"\x07" + struct.pack("!H", 32)
                + os.urandom(32) + struct.pack("!H", 64) + os.urandom(64))


# --- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture
def upstream(echo_server):
    return echo_server


@pytest.fixture
def guard(proxies, tmp_path, upstream):
    pol = write_policy(tmp_path / "sites.yaml", private_allow=["127.0.0.1/32"],
                       ports=(80, 443, upstream.port))
    log = tmp_path / "decisions.jsonl"
    p = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "site-a.test=127.0.0.1", "--decision-log", str(log),
                 "--head-timeout", "3"])
    p.log_path = log
    return p


def tunnel(guard, upstream) -> socket.socket:
    reply = connect(guard.port, f"site-a.test:{upstream.port}", A)
    assert reply.status == 200
    return reply.tunnel


def send_pieces(sock: socket.socket, data: bytes, sizes) -> None:
    """Write `data` in pieces of the given sizes (the rest in one piece), pausing in between
    so that each piece arrives as its own read at the proxy."""
    i = 0
    for n in sizes:
        if i >= len(data):
            break
        sock.sendall(data[i:i + n])
        i += n
        time.sleep(0.02)
    if i < len(data):
        sock.sendall(data[i:])


def assert_refused(guard, upstream, sock, reason: str) -> None:
    assert wait_closed(sock, timeout=8), "the guard kept the tunnel open"
    sock.close()
    lines = wait_for_log(guard.log_path, lambda x: x["reason"] == reason)
    hits = [x for x in lines if x["reason"] == reason]
    assert hits and hits[0]["decision"] == "deny", lines
    time.sleep(0.2)
    got = bytes(upstream.received)
    # the first bytes are named so that a failure says what arrived: this test's ClientHello
    # (a real leak) or a stray connection of another process to a reused loopback port
    assert upstream.connections == 0 and got == b"", \
        f"{len(got)} bytes on {upstream.connections} connection(s) reached the upstream: {got[:48]!r}"


def assert_passed(sock, data: bytes, upstream) -> None:
    sock.settimeout(10)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(65536)
        assert chunk, "closed instead of passed"
        got += chunk
    sock.close()
    assert got == data and bytes(upstream.received) == data


# --- TLS: the whole ClientHello before any decision -----------------------------------------------
FOREIGN = b"evil.test"
OWN = b"site-a.test"

# (name, bytes the client sends, write sizes, expected reason or None = passes byte-exact)
TLS_CASES = [
    ("fragmented-foreign-1-byte-first", records(hello(sni_ext((0, FOREIGN)))), [1, 1, 2, 7, 30], "sni_mismatch"),
    ("fragmented-own-1-byte-first", records(hello(sni_ext((0, OWN)))), [1, 1, 2, 7, 30], None),
    ("python-ssl-foreign-byte-by-byte", client_hello("evil.test"), [1] * 60, "sni_mismatch"),
    ("split-records-foreign", records(hello(sni_ext((0, FOREIGN))), 40), [len(b"x") * 45] * 8, "sni_mismatch"),
    ("split-records-own", records(hello(sni_ext((0, OWN))), 40), [45] * 8, None),
    ("one-byte-records-foreign", records(hello(sni_ext((0, FOREIGN))), 1), [], "sni_mismatch"),
    ("two-names-own-first", records(hello(sni_ext((0, OWN), (0, FOREIGN)))), [], "sni_mismatch"),
    ("two-names-foreign-first", records(hello(sni_ext((0, FOREIGN), (0, OWN)))), [], "sni_mismatch"),
    ("two-names-both-own", records(hello(sni_ext((0, OWN), (0, OWN)))), [], "sni_mismatch"),
    ("name-of-another-type", records(hello(sni_ext((1, FOREIGN)))), [], "sni_mismatch"),
    ("own-name-as-another-type", records(hello(sni_ext((1, OWN)))), [], "sni_mismatch"),
    ("own-plus-another-type", records(hello(sni_ext((0, OWN), (7, FOREIGN)))), [], "sni_mismatch"),
    ("ech-foreign-outer-name", records(hello(sni_ext((0, FOREIGN)), ech_ext())), [], "sni_mismatch"),
    ("ech-without-outer-name", records(hello(ech_ext())), [], "sni_mismatch"),
    ("ech-own-outer-name", records(hello(sni_ext((0, OWN)), ech_ext())), [3, 50], None),
    ("no-sni-for-a-name", records(hello()), [], "sni_missing"),
    ("two-sni-extensions", records(hello(sni_ext((0, OWN)), sni_ext((0, FOREIGN)))), [], "tls_hello_invalid"),
    ("ip-literal-as-name", records(hello(sni_ext((0, b"127.0.0.1")))), [], "sni_mismatch"),
    ("alert-record-first", b"\x16\x03\x01\x00\x05" + b"\x01\x00\x01\x00\x00" + b"\x15\x03\x03\x00\x02\x01\x00",
     [], "tls_hello_invalid"),
    ("not-a-client-hello", records(b"\x02" + hello(sni_ext((0, OWN)))[1:]), [], "tls_hello_invalid"),
]


@pytest.mark.parametrize("data,sizes,reason", [c[1:] for c in TLS_CASES], ids=[c[0] for c in TLS_CASES])
def test_client_hello_attacks(guard, upstream, data, sizes, reason):
    sock = tunnel(guard, upstream)
    send_pieces(sock, data, sizes)
    if reason is None:
        assert_passed(sock, data, upstream)
    else:
        assert_refused(guard, upstream, sock, reason)


def test_incomplete_client_hello_times_out_and_nothing_is_sent(guard, upstream):
    data = records(hello(sni_ext((0, OWN))))
    sock = tunnel(guard, upstream)
    sock.sendall(data[:-1])  # one byte short, forever
    start = time.monotonic()
    assert wait_closed(sock, timeout=10)
    assert time.monotonic() - start < 9
    sock.close()
    assert upstream.connections == 0 and bytes(upstream.received) == b""


def test_oversized_client_hello_is_refused(guard, upstream):
    # One extension of 60 KB: over the ClientHello bound, refused before it is complete.
    data = records(hello(sni_ext((0, OWN)), _ext(0x1234, b"\x00" * 60_000)))
    sock = tunnel(guard, upstream)
    try:
        sock.sendall(data)
    except OSError:
        pass
    assert_refused(guard, upstream, sock, "tls_hello_invalid")


# --- header limits ------------------------------------------------------------------------------------
MANY = b"".join(b"X-H%d: v\r\n" % i for i in range(5000))
HUGE = b"X-Big: " + b"a" * (1 << 20) + b"\r\n"


def _connect_head(port: int, headers: bytes) -> bytes:
    return (f"CONNECT site-a.test:{port} HTTP/1.1\r\nHost: site-a.test:{port}\r\n"
            f"Proxy-Authorization: {A}\r\n").encode() + headers + b"\r\n"


def _get_head(port: int, headers: bytes) -> bytes:
    return (f"GET http://site-a.test:{port}/ HTTP/1.1\r\nHost: site-a.test:{port}\r\n"
            f"Proxy-Authorization: {A}\r\n").encode() + headers + b"\r\n"


HEAD_CASES = [
    ("connect-5000-headers", _connect_head, MANY, "too_many_headers"),
    ("connect-1MiB-header", _connect_head, HUGE, "request_head_too_large"),
    ("http-5000-headers", _get_head, MANY, "too_many_headers"),
    ("http-1MiB-header", _get_head, HUGE, "request_head_too_large"),
]


@pytest.mark.parametrize("build,headers,reason", [c[1:] for c in HEAD_CASES], ids=[c[0] for c in HEAD_CASES])
def test_header_limits(guard, upstream, build, headers, reason):
    s = socket.create_connection(("127.0.0.1", guard.port), timeout=10)
    try:
        s.sendall(build(upstream.port, headers))
    except OSError:
        pass  # the guard may close before the client finished writing
    try:
        status, hdrs, _ = read_head(s)
    except OSError:
        status, hdrs = 0, {}
    assert status in (0, 431), status
    if status:
        assert hdrs.get("x-sfguard-decision", "").startswith("deny")
    assert wait_closed(s)
    s.close()
    lines = wait_for_log(guard.log_path, lambda x: x["reason"] == reason)
    assert any(x["reason"] == reason and x["decision"] == "deny" for x in lines), lines
    assert upstream.connections == 0 and bytes(upstream.received) == b""


@pytest.mark.parametrize("headers", [MANY, HUGE], ids=["5000-headers", "1MiB-header"])
def test_header_limits_inside_a_tunnel(guard, upstream, headers):
    sock = tunnel(guard, upstream)
    data = f"GET / HTTP/1.1\r\nHost: site-a.test:{upstream.port}\r\n".encode() + headers + b"\r\n"
    try:
        sock.sendall(data)
    except OSError:
        pass
    assert_refused(guard, upstream, sock, "request_head_too_large")


def test_a_normal_head_with_many_headers_still_passes(guard, upstream):
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(100))
    s = socket.create_connection(("127.0.0.1", guard.port), timeout=10)
    s.sendall(_connect_head(upstream.port, headers))
    status, _, _ = read_head(s)
    assert status == 200
    s.sendall(b"ping")
    assert s.recv(10) == b"ping"
    s.close()


@pytest.mark.parametrize("data,reason", [
    (b"GET / HTTP/1.1\r\nHost: site-a.test\r\nHost: evil.test\r\n\r\n", "host_header_repeated"),
    (b"G", None),  # a prefix: waits, then times out; nothing is sent
    (b"GET/x HTTP/1.1\r\n", "tunnel_protocol_refused"),
    (b"Get / HTTP/1.1\r\n", "tunnel_protocol_refused"),
    (b"GET / HTTP/1.1\n", "tunnel_protocol_refused"),
    (b"PING\r\n", "passes"),       # a text protocol on an allowed port: raw bytes
    (b"SEND 5\n", "passes"),
    (b"GET /\tHTTP/1.1\r\nHost: evil.test\r\n\r\n", "tunnel_protocol_refused"),
])
def test_http_inside_a_tunnel(guard, upstream, data, reason):
    sock = tunnel(guard, upstream)
    send_pieces(sock, data, [1, 2])
    if reason == "passes":
        assert_passed(sock, data, upstream)
    elif reason is None:
        assert wait_closed(sock, timeout=10)
        sock.close()
        assert upstream.connections == 0 and bytes(upstream.received) == b""
    else:
        assert_refused(guard, upstream, sock, reason)


@pytest.mark.parametrize("pieces", [
    [b"G", b"et", b" / HTTP/1.1\r\nHost: evil.test\r\n\r\n"],   # a lower-case method, trickled
    [b"PING", b" HTTP/1.1\r\n"],                                 # a prefix with no HTTP/ yet
    [b"GET", b"\t/ HTTP/1.1\r\nHost: evil.test\r\n\r\n"],
])
def test_a_first_line_trickled_in_pieces_is_judged_whole(guard, upstream, pieces):
    """Each piece arrives as a read of its own: no prefix of the first line lets it pass."""
    sock = tunnel(guard, upstream)
    for piece in pieces:
        sock.sendall(piece)
        time.sleep(0.25)
    assert_refused(guard, upstream, sock, "tunnel_protocol_refused")


def test_a_first_line_longer_than_a_request_head_is_refused(guard, upstream):
    sock = tunnel(guard, upstream)
    with contextlib.suppress(OSError):   # the guard may close while the rest is being sent
        sock.sendall(b"A" * (GUARD_MAX_HEAD_BYTES + 1024))
    assert_refused(guard, upstream, sock, "request_head_too_large")


# --- report mode: only the lists are relaxed ------------------------------------------------------
@pytest.fixture
def report_guard(proxies, tmp_path, upstream, http_server):
    """Report mode. public.example and site-a.test map to the 127.0.0.1 fixtures; only
    public.example's address is exempt from the private check (a CIDR entry that names
    127.0.0.2, which the fixture does not listen on, keeps 127.0.0.1 private for the rest)."""
    pol = write_policy(tmp_path / "report.yaml", mode="report", ports=(80, 443, upstream.port, http_server.port),
                       private_allow=["127.0.0.2/32"])
    log = tmp_path / "report.jsonl"
    p = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "site-a.test=127.0.0.1", "--resolve", "loop.example=127.0.0.1",
                 "--resolve", "meta.example=169.254.169.254",
                 "--resolve", "link.example=169.254.7.7", "--resolve", "public.example=127.0.0.2",
                 "--decision-log", str(log)])
    p.log_path = log
    return p


@pytest.mark.parametrize("target,reason", [
    ("site-a.test", "private_address"),      # allowed host, loopback address
    ("loop.example", "private_address"),     # not-allowed host, loopback address
    ("127.0.0.1", "reviewer_only_address"),        # an IP literal: before the lists
    ("[::1]", "reviewer_only_address"),
    ("169.254.169.254", "reviewer_only_address"),  # cloud metadata
    ("meta.example", "private_address"),
    ("169.254.7.7", "reviewer_only_address"),      # link-local
    ("link.example", "private_address"),
    ("0x7f.1", "malformed_host"),
])
def test_report_mode_refuses_hard_cases(report_guard, upstream, target, reason):
    r = connect(report_guard.port, f"{target}:{upstream.port}", A)
    assert r.status == 403, (r.status, r.body)
    assert r.headers["x-sfguard-decision"] == f"deny; reason={reason}"
    assert upstream.connections == 0


def test_report_mode_refuses_a_port_outside_the_policy(report_guard, upstream):
    r = connect(report_guard.port, "public.example:8", A)
    assert r.status == 403 and r.headers["x-sfguard-decision"] == "deny; reason=port_not_allowed"


def test_report_mode_refuses_missing_credentials(report_guard, upstream):
    for auth in (None, basic("a", "wrong-token-0123456789")):
        r = connect(report_guard.port, f"public.example:{upstream.port}", auth)
        assert r.status == 407
    assert upstream.connections == 0


def test_report_mode_refuses_foreign_sni(proxies, tmp_path, upstream):
    # A not-allowed public host passes in report mode, but its tunnel's SNI must still agree.
    pol = write_policy(tmp_path / "r.yaml", mode="report", ports=(80, 443, upstream.port),
                       private_allow=["127.0.0.1/32"])
    log = tmp_path / "r.jsonl"
    p = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "public.example=127.0.0.1", "--decision-log", str(log)])
    p.log_path = log
    r = connect(p.port, f"public.example:{upstream.port}", A)
    assert r.status == 200
    send_pieces(r.tunnel, records(hello(sni_ext((0, FOREIGN)))), [1, 5])
    assert_refused(p, upstream, r.tunnel, "sni_mismatch")
    assert any(x["reason"] == "would_deny:not_allowed" for x in log_lines(log))


def test_report_mode_refuses_mismatched_host_header(proxies, tmp_path, http_server):
    pol = write_policy(tmp_path / "r.yaml", mode="report", ports=(80, 443, http_server.port),
                       private_allow=["127.0.0.1/32"])
    p = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "public.example=127.0.0.1"])
    r = get(p.port, f"http://public.example:{http_server.port}/", A, host_header="evil.test")
    assert r.status == 400
    assert r.headers["x-sfguard-decision"] == "deny; reason=host_header_mismatch"
    assert http_server.connections == 0


def test_report_mode_lets_a_not_allowed_public_host_through_with_would_deny(proxies, tmp_path, upstream):
    pol = write_policy(tmp_path / "r.yaml", mode="report", ports=(80, 443, upstream.port),
                       private_allow=["127.0.0.1/32"])  # the fixture stands in for a public host
    log = tmp_path / "r.jsonl"
    p = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "public.example=127.0.0.1", "--decision-log", str(log)])
    r = connect(p.port, f"public.example:{upstream.port}", A)
    assert r.status == 200
    data = records(hello(sni_ext((0, b"public.example"))))
    r.tunnel.sendall(data)
    assert_passed(r.tunnel, data, upstream)
    line = wait_for_log(log, lambda x: x["host"] == "public.example")[0]
    assert (line["decision"], line["reason"]) == ("allow", "would_deny:not_allowed")


# --- catch-all patterns through the proxy ---------------------------------------------------------
@pytest.mark.parametrize("allow", ["0.0.0.0/0", "0.0.0.0/1,128.0.0.0/1", "::/0"])
def test_catch_all_allow_is_refused_at_start(proxies, allow):
    import subprocess

    from .conftest import ROOT, SFGUARD
    proc = subprocess.run(SFGUARD + ["proxy", "--allow", allow], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "catch-all" in proc.stderr and "hint" in proc.stderr


def test_wide_allowed_range_does_not_open_loopback(proxies, tmp_path, upstream):
    # 64.0.0.0/2 is refused; an allowed range never opens a special address: a /8 that spans
    # public space and CGNAT (100.0.0.0/8) does not open 100.64.0.1 (only private_networks.allow
    # would).
    pol = write_policy(tmp_path / "p.yaml", ports=(80, 443, upstream.port))
    p = proxies(["--allow", "100.0.0.0/8", "--policy", str(pol), "--client", f"a:{TOKEN_A}"])
    r = connect(p.port, f"100.64.0.1:{upstream.port}", A)
    assert r.status == 403 and r.headers["x-sfguard-decision"] == "deny; reason=reviewer_only_address"
