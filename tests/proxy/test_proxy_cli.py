"""Black-box tests of `sfguard proxy` run as a subprocess: what clients and upstream servers see."""
from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import subprocess
import time

import pytest

from .conftest import ROOT, SFGUARD, TOKEN_A, TOKEN_B, basic, connect, get, read_head, write_policy

A = basic("a", TOKEN_A)


def client_hello(sni: str | None) -> bytes:
    """The bytes of a real TLS ClientHello (Python's ssl module, no network)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def wait_closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closes the socket (EOF or reset) within timeout."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.fixture
def site_policy(tmp_path, echo_server, http_server):
    """A policy allowing the fixture servers' ports and 127.0.0.1 as a private network."""
    return write_policy(tmp_path / "sites.yaml", private_allow=["127.0.0.1/32"],
                        ports=(80, 443, echo_server.port, http_server.port))


@pytest.fixture
def guard(proxies, site_policy, tmp_path):
    """A proxy for client a (site-a.test allowed; site-b.test resolves to loopback too)."""
    log = tmp_path / "decisions.jsonl"
    p = proxies(["--allow", "site-a.test", "--policy", str(site_policy),
                 "--client", f"a:{TOKEN_A}", "--resolve", "site-a.test=127.0.0.1",
                 "--resolve", "site-b.test=127.0.0.1", "--decision-log", str(log)])
    p.log_path = log
    return p


def log_lines(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_log(path, pred, timeout=5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log_lines(path)
        if any(pred(x) for x in lines):
            return lines
        time.sleep(0.05)
    return log_lines(path)


# --- start-up and arguments ----------------------------------------------------------------------
def test_ready_line_and_generated_credential_work(proxies, site_policy, echo_server):
    p = proxies(["--allow", "site-a.test", "--policy", str(site_policy),
                 "--resolve", "site-a.test=127.0.0.1"], extra_lines=1)
    assert p.first_lines[0] == f"ready http://127.0.0.1:{p.port}"
    url = p.first_lines[1]
    assert url.startswith("http://operator:") and url.endswith(f"@127.0.0.1:{p.port}")
    cred = url[len("http://"):].rsplit("@", 1)[0]
    name, token = cred.split(":", 1)
    reply = connect(p.port, f"site-a.test:{echo_server.port}", basic(name, token))
    assert reply.status == 200
    reply.tunnel.sendall(b"ping")
    assert reply.tunnel.recv(100) == b"ping"
    reply.tunnel.close()
    assert token not in p.stderr()


@pytest.mark.parametrize("args,needle", [
    (["--listen", "0.0.0.0:0"], "--listen-public"),
    (["--listen", "localhost:80x"], "--listen"),
    (["--listen", "example.com:80"], "IP address"),
    (["--client", "nocolon"], "NAME:TOKEN"),
    (["--client", "a:short"], "token"),
    (["--client", "bad name:0123456789abcdefXYZ"], "client name"),
    (["--resolve", "site-a.test"], "HOST=IP"),
    (["--resolve", "site-a.test=not-an-ip"], "not an IP"),
    (["--allow", "*"], "--allow"),
    (["--policy", "/nonexistent/sites.yaml"], "sites.yaml"),
    (["--head-timeout", "0"], "--head-timeout"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, needle):
    r = subprocess.run(SFGUARD + ["proxy", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert "0123456789abcdefXYZ" not in r.stderr  # a token never echoed


def test_clients_file_readable_by_others_is_refused(tmp_path):
    f = tmp_path / "clients"
    f.write_text(f"a:{TOKEN_A}\n")
    f.chmod(0o644)
    r = subprocess.run(SFGUARD + ["proxy", "--clients-file", str(f)], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "chmod 600" in r.stderr and TOKEN_A not in r.stderr


# --- CONNECT ---------------------------------------------------------------------------------------
def test_allowed_tunnel_carries_bytes_both_ways(guard, echo_server):
    reply = connect(guard.port, f"site-a.test:{echo_server.port}", A)
    assert reply.status == 200
    payload = b"\x00" + os.urandom(199_999)   # binary: a first byte 0x16 would be judged as TLS
    reply.tunnel.sendall(payload)
    got = b""
    reply.tunnel.settimeout(10)
    while len(got) < len(payload):
        chunk = reply.tunnel.recv(65536)
        assert chunk
        got += chunk
    assert got == payload
    reply.tunnel.close()
    assert bytes(echo_server.received) == payload


def test_denied_connect_gets_403_with_reason_and_explanation(guard, echo_server):
    reply = connect(guard.port, f"site-b.test:{echo_server.port}", A)
    assert reply.status == 403
    assert reply.headers["x-sfguard-decision"] == "deny; reason=not_allowed"
    body = reply.body.decode()
    assert body.endswith("\n") and body.count("\n") == 1 and "site-b.test" in body
    assert echo_server.connections == 0


@pytest.mark.parametrize("auth", [
    None,
    basic("a", "wrong-token-0123456789"),
    basic("nobody", TOKEN_A),
    "Basic !!!not-base64",
    "Bearer " + TOKEN_A,
], ids=["none", "wrong-token", "unknown-name", "garbage", "not-basic"])
def test_missing_or_wrong_credentials_get_407(guard, echo_server, auth):
    reply = connect(guard.port, f"site-a.test:{echo_server.port}", auth)
    assert reply.status == 407
    assert reply.headers["proxy-authenticate"].startswith("Basic")
    assert echo_server.connections == 0
    guard.stop()
    assert TOKEN_A not in guard.log_path.read_text() if guard.log_path.exists() else True
    assert TOKEN_A not in guard.stderr()


# (what site-x.test resolves to, the client's allow list, private_networks.allow, the CONNECT
# host, the answer): special addresses only with the reviewer's consent (issue 35)
SPECIAL = [
    ("127.0.0.1", "site-x.test", [], "site-x.test", "private_address"),    # loopback, not consented
    ("169.254.169.254", "site-x.test", [], "site-x.test", "private_address"),  # metadata: before connect
    ("10.1.2.3", "site-x.test", [], "site-x.test", "private_address"),
    ("127.0.0.1", "site-x.test", ["127.0.0.1/32"], "site-x.test", "allow"),   # the reviewer's consent
    ("169.254.169.254", "site-x.test", ["169.254.0.0/16"], "site-x.test", "private_address"),  # a range
    ("127.0.0.1", "127.0.0.1", [], "127.0.0.1", "reviewer_only_address"),   # the run's IP pattern alone
    ("127.0.0.1", "127.0.0.0/8", [], "[::ffff:127.0.0.1]", "reviewer_only_address"),
    ("127.0.0.1", "127.0.0.1", ["127.0.0.1/32"], "127.0.0.1", "allow"),
]


@pytest.mark.parametrize("resolve_to,allow,private,target,expected", SPECIAL)
def test_special_addresses_need_the_reviewers_consent(proxies, tmp_path, echo_server, resolve_to,
                                                      allow, private, target, expected):
    pol = write_policy(tmp_path / "p.yaml", ports=(80, 443, echo_server.port), private_allow=private)
    p = proxies(["--allow", allow, "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", f"site-x.test={resolve_to}"])
    reply = connect(p.port, f"{target}:{echo_server.port}", A)
    if expected == "allow":
        assert reply.status == 200
        reply.tunnel.sendall(b"hi")
        assert reply.tunnel.recv(10) == b"hi"
        reply.tunnel.close()
    else:
        assert reply.status == 403
        assert reply.headers["x-sfguard-decision"] == f"deny; reason={expected}"
        assert b"security reviewer" in reply.body
        assert echo_server.connections == 0


def test_name_with_one_private_address_among_several_is_denied(proxies, tmp_path, echo_server):
    pol = write_policy(tmp_path / "p.yaml", ports=(80, 443, echo_server.port),
                       private_allow=["127.0.0.1/32"])
    p = proxies(["--allow", "site-x.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "site-x.test=127.0.0.1,169.254.169.254"])
    reply = connect(p.port, f"site-x.test:{echo_server.port}", A)
    assert reply.status == 403
    assert reply.headers["x-sfguard-decision"] == "deny; reason=private_address"
    assert echo_server.connections == 0


# --- TLS ClientHello SNI ---------------------------------------------------------------------------
def test_foreign_sni_in_allowed_tunnel_is_killed_and_logged(guard, echo_server):
    reply = connect(guard.port, f"site-a.test:{echo_server.port}", A)
    assert reply.status == 200
    reply.tunnel.sendall(client_hello("evil.test"))
    assert wait_closed(reply.tunnel)
    reply.tunnel.close()
    assert echo_server.connections == 0 and echo_server.received == b""
    lines = wait_for_log(guard.log_path, lambda x: x["reason"] == "sni_mismatch")
    hits = [x for x in lines if x["reason"] == "sni_mismatch"]
    assert hits and hits[0]["decision"] == "deny" and hits[0]["host"] == "site-a.test"
    assert hits[0]["client"] == "a"


@pytest.mark.parametrize("sni,connect_host", [
    ("site-a.test", "site-a.test"), ("SITE-A.test.", "site-a.test"),
    (None, "127.0.0.1"),  # no SNI: accepted only for an IP-literal CONNECT host
])
def test_matching_or_absent_sni_passes_through_untouched(proxies, site_policy, echo_server, sni,
                                                        connect_host):
    guard = proxies(["--allow", "site-a.test,127.0.0.1", "--policy", str(site_policy),
                     "--client", f"a:{TOKEN_A}", "--resolve", "site-a.test=127.0.0.1"])
    reply = connect(guard.port, f"{connect_host}:{echo_server.port}", A)
    assert reply.status == 200
    hello = client_hello(sni)
    reply.tunnel.sendall(hello)
    got = b""
    reply.tunnel.settimeout(10)
    while len(got) < len(hello):
        chunk = reply.tunnel.recv(65536)
        assert chunk
        got += chunk
    reply.tunnel.close()
    assert got == hello and bytes(echo_server.received) == hello  # not intercepted, byte-exact


@pytest.mark.parametrize("host_header,passes", [
    ("site-a.test:{port}", True), ("SITE-A.test.:{port}", True),
    ("evil.test", False), ("site-a.test:1", False),
])
def test_plain_http_inside_a_tunnel_must_name_the_tunnel_host(guard, echo_server, host_header,
                                                             passes):
    """E.g. a browser tunnelling ws:// with CONNECT: the request inside must match."""
    reply = connect(guard.port, f"site-a.test:{echo_server.port}", A)
    assert reply.status == 200
    request = (f"GET /chat HTTP/1.1\r\nHost: {host_header.format(port=echo_server.port)}\r\n"
               "Upgrade: websocket\r\n\r\n").encode()
    reply.tunnel.sendall(request)
    if passes:
        reply.tunnel.settimeout(10)
        got = b""
        while len(got) < len(request):
            chunk = reply.tunnel.recv(65536)
            assert chunk
            got += chunk
        assert got == request
    else:
        assert wait_closed(reply.tunnel)
        assert echo_server.connections == 0
    reply.tunnel.close()


# --- plain HTTP --------------------------------------------------------------------------------------
def test_plain_http_allowed_strips_proxy_credentials(guard, http_server):
    reply = get(guard.port, f"http://site-a.test:{http_server.port}/page?q=1", A)
    assert reply.status == 200 and reply.body == b"hello from upstream\n"
    seen = bytes(http_server.received)
    assert seen.startswith(b"GET /page?q=1 HTTP/1.1")
    assert b"proxy-authorization" not in seen.lower() and TOKEN_A.encode() not in seen


def test_plain_http_keep_alive_reuses_the_checked_connection(guard, http_server):
    """Many requests on one client connection: none may stall (mitmproxy allows 5 open server
    connections per address), and the upstream still sees the original Host header."""
    s = socket.create_connection(("127.0.0.1", guard.port), timeout=10)
    target = f"site-a.test:{http_server.port}"
    for i in range(12):
        s.sendall(f"GET http://{target}/r{i} HTTP/1.1\r\nHost: {target}\r\n"
                  f"Proxy-Authorization: {A}\r\n\r\n".encode())
        status, headers, rest = read_head(s, timeout=5)
        assert status == 200, i
        n = int(headers["content-length"])
        while len(rest) < n:
            rest += s.recv(65536)
    s.close()
    seen = bytes(http_server.received)
    assert seen.count(f"Host: {target}".encode()) == 12
    assert http_server.connections == 1  # one checked server connection, reused


@pytest.mark.parametrize("host_header", ["site-b.test", "evil.example", "site-a.test:1",
                                         "site-a.test:%d/x"])
def test_plain_http_with_mismatched_host_header_is_denied(guard, http_server, host_header):
    if "%d" in host_header:
        host_header = host_header % http_server.port
    reply = get(guard.port, f"http://site-a.test:{http_server.port}/", A, host_header=host_header)
    assert reply.status == 400  # a head naming two hosts is malformed (RFC 9112 3.2.2)
    assert reply.headers["x-sfguard-decision"] == "deny; reason=host_header_mismatch"
    assert http_server.connections == 0


def test_plain_http_denied_host(guard, http_server):
    reply = get(guard.port, f"http://site-b.test:{http_server.port}/secret", A)
    assert reply.status == 403 and b"site-b.test" in reply.body
    assert http_server.connections == 0


def test_curl_through_the_guard(guard, http_server):
    proxy = f"http://a:{TOKEN_A}@127.0.0.1:{guard.port}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    def curl(*args):
        return subprocess.run(["/usr/bin/curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                               "--max-time", "10", "-x", proxy, *args],
                              capture_output=True, text=True, timeout=20, env=env).stdout
    assert curl(f"http://site-a.test:{http_server.port}/") == "200"
    assert curl("-p", f"http://site-a.test:{http_server.port}/") == "200"   # via CONNECT
    assert curl(f"http://site-b.test:{http_server.port}/") == "403"
    # a denied CONNECT: curl reports the proxy's 403 as the CONNECT status
    r = subprocess.run(["/usr/bin/curl", "-s", "-p", "--max-time", "10", "-x", proxy,
                        "-w", "%{http_connect}", "-o", "/dev/null",
                        f"http://site-b.test:{http_server.port}/"],
                       capture_output=True, text=True, timeout=20, env=env)
    assert r.stdout == "403"


# --- decision log ---------------------------------------------------------------------------------
def test_decision_log_fields_mode_and_no_secrets(guard, http_server, echo_server):
    get(guard.port, f"http://site-a.test:{http_server.port}/private/path?token=SEKRIT", A)
    connect(guard.port, f"site-b.test:{echo_server.port}", A)
    assert guard.stop() == 0
    assert stat.S_IMODE(guard.log_path.stat().st_mode) == 0o600
    text = guard.log_path.read_text()
    lines = log_lines(guard.log_path)
    assert len(lines) == 2
    keys = {"ts", "run", "client", "method", "host", "port", "decision", "reason", "rule", "addr"}
    assert all(set(x) == keys for x in lines)
    allow, deny = lines
    assert (allow["client"], allow["method"], allow["host"], allow["port"], allow["decision"],
            allow["addr"]) == ("a", "GET", "site-a.test", http_server.port, "allow", "127.0.0.1")
    assert allow["rule"] and "site-a.test" in allow["rule"]
    assert (deny["method"], deny["host"], deny["decision"], deny["reason"]) == \
        ("CONNECT", "site-b.test", "deny", "not_allowed")
    for secret in ("/private", "path", "SEKRIT", "token=", TOKEN_A):
        assert secret not in text


def test_decision_log_to_stdout_follows_ready_line(proxies, site_policy, echo_server):
    p = proxies(["--allow", "site-a.test", "--policy", str(site_policy), "--client",
                 f"a:{TOKEN_A}", "--resolve", "site-a.test=127.0.0.1", "--decision-log", "-"])
    connect(p.port, f"site-a.test:{echo_server.port}", A).tunnel.close()
    time.sleep(0.3)
    p.stop()
    rest = p.read_stdout_rest()
    assert p.first_lines == [f"ready http://127.0.0.1:{p.port}"]
    assert json.loads(rest[0])["decision"] == "allow"


def test_quiet_denials_are_counted_not_logged_one_by_one(proxies, tmp_path, echo_server):
    pol = write_policy(tmp_path / "p.yaml", quiet=["*.google.com"])
    log = tmp_path / "d.jsonl"
    p = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--decision-log", str(log), "--run", "r-1"])
    for host in ("clients1.google.com", "clients2.google.com", "clients1.google.com"):
        reply = connect(p.port, f"{host}:443", A)
        assert reply.status == 403
    assert connect(p.port, "other.test:443", A).status == 403
    assert p.stop() == 0
    lines = log_lines(log)
    assert [x["host"] for x in lines if x["reason"] != "quiet_denials"] == ["other.test"]
    agg = [x for x in lines if x["reason"] == "quiet_denials"]
    assert len(agg) == 1 and agg[0]["count"] == 3 and agg[0]["client"] == "a"
    assert agg[0]["hosts"] == {"clients1.google.com": 2, "clients2.google.com": 1}
    assert agg[0]["run"] == "r-1"


def test_report_mode_lets_denials_pass_and_logs_would_deny(proxies, tmp_path, echo_server):
    pol = write_policy(tmp_path / "p.yaml", mode="report", private_allow=["127.0.0.1/32"],
                       ports=(80, 443, echo_server.port))
    log = tmp_path / "d.jsonl"
    p = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "site-b.test=127.0.0.1", "--decision-log", str(log)])
    reply = connect(p.port, f"site-b.test:{echo_server.port}", A)
    assert reply.status == 200
    reply.tunnel.sendall(b"r")
    assert reply.tunnel.recv(10) == b"r"
    reply.tunnel.close()
    p.stop()
    line = log_lines(log)[0]
    assert (line["decision"], line["reason"]) == ("allow", "would_deny:not_allowed")


# --- clients -----------------------------------------------------------------------------------------
def test_several_clients_have_their_own_allowlists(proxies, site_policy, tmp_path, echo_server):
    clients = tmp_path / "clients.json"
    clients.write_text(json.dumps([
        {"name": "a", "token": TOKEN_A, "allow": ["site-a.test"], "run": "run-a"},
        {"name": "b", "token": TOKEN_B, "allow": ["site-b.test"], "run": "run-b"},
    ]))
    clients.chmod(0o600)
    log = tmp_path / "d.jsonl"
    p = proxies(["--policy", str(site_policy), "--clients-file", str(clients),
                 "--resolve", "site-a.test=127.0.0.1", "--resolve", "site-b.test=127.0.0.1",
                 "--decision-log", str(log)])
    B = basic("b", TOKEN_B)
    cases = [(A, "site-a.test", 200), (A, "site-b.test", 403),
             (B, "site-b.test", 200), (B, "site-a.test", 403)]
    for auth, host, status in cases:
        reply = connect(p.port, f"{host}:{echo_server.port}", auth)
        assert reply.status == status, (auth, host)
        if reply.sock:
            reply.tunnel.close()
    p.stop()
    got = [(x["client"], x["run"], x["host"], x["decision"]) for x in log_lines(log)]
    assert got == [("a", "run-a", "site-a.test", "allow"), ("a", "run-a", "site-b.test", "deny"),
                   ("b", "run-b", "site-b.test", "allow"), ("b", "run-b", "site-a.test", "deny")]
    assert TOKEN_A not in log.read_text() and TOKEN_B not in log.read_text()


def test_clients_from_environment(proxies, site_policy, echo_server):
    p = proxies(["--allow", "site-a.test", "--policy", str(site_policy),
                 "--resolve", "site-a.test=127.0.0.1"],
                env={"SFGUARD_PROXY_CLIENTS": f"# clients\nb:{TOKEN_B}\n"})
    assert len(p.first_lines) == 1
    assert connect(p.port, f"site-a.test:{echo_server.port}", A).status == 407
    r = connect(p.port, f"site-a.test:{echo_server.port}", basic("b", TOKEN_B))
    assert r.status == 200
    r.tunnel.close()


# --- hot reload -------------------------------------------------------------------------------------
def test_policy_edit_applies_within_a_second_and_bad_edit_keeps_last_good(
        proxies, tmp_path, echo_server):
    pol = write_policy(tmp_path / "p.yaml", ports=(80, 443, echo_server.port),
                       private_allow=["127.0.0.1/32"])
    p = proxies(["--policy", str(pol), "--client", f"a:{TOKEN_A}",
                 "--resolve", "site-a.test=127.0.0.1"])
    target = f"site-a.test:{echo_server.port}"
    assert connect(p.port, target, A).status == 403

    def status_within(deadline_s: float, want: int) -> bool:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            r = connect(p.port, target, A)
            if r.sock:
                r.tunnel.close()
            if r.status == want:
                return True
            time.sleep(0.05)
        return False

    write_policy(pol, ports=(80, 443, echo_server.port), private_allow=["127.0.0.1/32"],
                 allow_always=["site-a.test"])
    assert status_within(1.5, 200)

    pol.write_text("mode: enforce\nallow_always: [\n  - broken\n")  # invalid YAML
    time.sleep(1.0)
    assert status_within(0.5, 200)  # last good policy still applies
    err = p.stderr()
    assert "keeping the last good policy" in err and str(pol) in err

    write_policy(pol, ports=(80, 443, echo_server.port), private_allow=["127.0.0.1/32"])
    assert status_within(1.5, 403)


# --- bad input ----------------------------------------------------------------------------------------
def _raw(port: int, data: bytes, close: bool = False) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        s.sendall(data)
    if close:
        s.close()
    return s


BAD_INPUTS = {
    "garbage": b"\x00\x01garbage that is not http\r\n\r\n",
    "connect-without-port": b"CONNECT site-a.test HTTP/1.1\r\nHost: site-a.test\r\n\r\n",
    "long-header-line": b"GET http://site-a.test/ HTTP/1.1\r\nX-Long: " + b"a" * 200_000 + b"\r\n\r\n",
    "many-headers": b"GET http://site-a.test/ HTTP/1.1\r\n" + b"".join(
        b"X-H%d: v\r\n" % i for i in range(10_000)) + b"\r\n",
    "tls-to-proxy-port": b"\x16\x03\x01\x00\x10" + b"\x00" * 16,
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_refused_and_others_are_still_served(guard, echo_server, name):
    s = _raw(guard.port, BAD_INPUTS[name])
    s.settimeout(10)
    status, _, _ = read_head(s)
    assert status in (0, 400, 431), status  # an error answer or a closed connection
    assert wait_closed(s)
    s.close()
    r = connect(guard.port, f"site-a.test:{echo_server.port}", A)
    assert r.status == 200
    r.tunnel.sendall(b"still here")
    assert r.tunnel.recv(100) == b"still here"
    r.tunnel.close()
    assert guard.proc.poll() is None


def test_client_closing_mid_handshake_does_not_hurt_others(guard, echo_server):
    hello = client_hello("site-a.test")
    for _ in range(20):
        r = connect(guard.port, f"site-a.test:{echo_server.port}", A)
        r.tunnel.sendall(hello[: len(hello) // 2])
        r.tunnel.close()
        _raw(guard.port, b"CONNECT site-a.test:443 HTTP/1.1\r\nHo", close=True)
    r = connect(guard.port, f"site-a.test:{echo_server.port}", A)
    assert r.status == 200
    r.tunnel.sendall(b"ok")
    assert r.tunnel.recv(10) == b"ok"
    r.tunnel.close()
    assert echo_server.received == b"ok"  # the half ClientHellos never reached the server


def test_slow_client_is_timed_out_without_blocking_others(proxies, site_policy, echo_server):
    p = proxies(["--allow", "site-a.test", "--policy", str(site_policy), "--client",
                 f"a:{TOKEN_A}", "--resolve", "site-a.test=127.0.0.1", "--head-timeout", "1"])
    slow = _raw(p.port, b"CONNECT site-a.test:443 HTTP/1.1\r\nX-Slow: ")
    silent_tunnel = connect(p.port, f"site-a.test:{echo_server.port}", A)  # never sends a byte
    r = connect(p.port, f"site-a.test:{echo_server.port}", A)
    assert r.status == 200
    r.tunnel.sendall(b"x")
    assert r.tunnel.recv(10) == b"x"
    r.tunnel.close()
    start = time.monotonic()
    assert wait_closed(slow, timeout=5)
    assert wait_closed(silent_tunnel.tunnel, timeout=5)
    assert time.monotonic() - start < 5
    slow.close()
    silent_tunnel.tunnel.close()


def test_memory_stays_bounded_under_oversized_heads(guard):
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process(guard.proc.pid)
    before = proc.memory_info().rss
    junk = b"GET http://site-a.test/ HTTP/1.1\r\nX: " + b"a" * (1 << 20)
    for _ in range(30):  # 30 MB of header bytes in total
        s = socket.create_connection(("127.0.0.1", guard.port), timeout=10)
        try:
            s.sendall(junk)
        except OSError:
            pass  # the guard closed it early: fine
        s.close()
    time.sleep(0.5)
    grown = proc.memory_info().rss - before
    assert grown < 20 * 1024 * 1024, grown
