"""Reaching the console from elsewhere (issue 46), against a real `sfguard start` with the fake
browser: its port kept across restarts; TLS served by the console itself at its public URL
(a name only the test's client resolves, to 127.0.0.1; a certificate from an authority made
here), with Python's client and with a real Chromium (its own resolver rule); a reverse
proxy named as trusted, whose forwarded headers count and no one else's; the options that
would expose it refused; named sign-in links (`sfguard console --as NAME`) and
what the audit records for them."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from sfguard.supervisor.console.auth import ConsoleAuth
from sfguard.supervisor.console.listen import ConsoleConfig, ConsoleError, console_config, peer_allowed
from sfguard.supervisor.console.server import CONSOLE_COOKIE
from sfguard.supervisor.console.viewer import Viewer
from tests.conftest import free_port
from tests.console.conftest import ARTIFACTS, PHONE, ROOT, assert_fits_a_phone, connect, console_url, link, phone_fit
from tests.tls_site import issue, make_ca


def get(base: str, path: str, *, cookie: str | None = None, host: str | None = None,
        origin: str | None = None, source: str | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, str]:
    conn = connect(base, source=source)
    h = dict(headers or {})
    if cookie:
        h["Cookie"] = cookie
    if host:
        h["Host"] = host
    if origin:
        h["Origin"] = origin
    try:
        conn.request("GET", path, headers=h)
        r = conn.getresponse()
        return r.status, r.headers, r.read().decode(errors="replace")
    finally:
        conn.close()


def sfguard(d, *args: str) -> subprocess.CompletedProcess:
    env = dict(d.env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(d.home)],
                          capture_output=True, text=True, env=env, timeout=60)


def sign_in(base: str, url: str, **kw) -> tuple[str, str]:
    """Use a link: ('name=value' of the cookie, the whole Set-Cookie header)."""
    u = urlsplit(url)
    status, headers, body = get(base, f"{u.path}?{u.query}", **kw)
    assert status == 200, (status, body[:300])
    sc = headers.get("Set-Cookie") or ""
    assert sc.startswith(f"{CONSOLE_COOKIE}="), sc
    return sc.split(";", 1)[0], sc


# -- 1. the port stays ---------------------------------------------------------------------------
def test_the_console_keeps_its_port_across_restarts(fake_guard):
    d = fake_guard()                                   # --console's default: 127.0.0.1, no port
    first = urlsplit(d.console).port
    record = d.home / "console.json"
    assert json.loads(record.read_text()) == {"port": first}
    assert record.stat().st_mode & 0o777 == 0o600
    d.stop()
    d.start()
    assert urlsplit(console_url(d.banner)).port == first
    d.stop()
    with socket.socket() as squatter:                  # someone else took the port meanwhile
        # (as a server does: the guard's own closed connections may still be in TIME_WAIT)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", first))
        squatter.listen()
        d.start()
    now = urlsplit(console_url(d.banner)).port
    assert now != first and f"port {first} was taken" in d.banner, d.banner
    assert json.loads(record.read_text()) == {"port": now}
    d.console = console_url(d.banner)
    assert get(d.console, "/")[0] == 401               # it answers there


# -- 2. TLS at the public URL ----------------------------------------------------------------------
def test_over_tls_at_its_public_url_a_named_link_signs_in_and_the_approvals_page_answers(shared_tls):
    d = shared_tls
    port = urlsplit(d.console).port
    assert re.search(rf"console on https://console\.test:{port} \(listening on 127\.0\.0\.1:{port}, TLS\)",
                     d.banner), d.banner
    r = sfguard(d, "console", "--as", "alice")
    assert r.returncode == 0, r.stderr
    url = r.stdout.splitlines()[0]
    assert url.startswith(f"https://console.test:{port}/login?t="), url
    assert "for alice" in r.stdout
    cookie, sc = sign_in(d.console, url)
    flags = {f.strip().lower() for f in sc.split(";")[1:]}
    assert {"httponly", "samesite=strict", "secure", "path=/"} <= flags, sc
    status, headers, page = get(d.console, "/approvals", cookie=cookie)
    assert status == 200 and "<h1>Approvals</h1>" in page and "signed in as alice" in page
    assert headers["Strict-Transport-Security"] == "max-age=31536000"
    # the link is spent; the token is not in the guard's log
    assert get(d.console, urlsplit(url).path + "?" + urlsplit(url).query)[0] == 401
    assert url.split("t=")[1] not in d.log.read_text()
    status = sfguard(d, "status", "--json")
    assert json.loads(status.stdout)["console"]["url"] == d.console


def test_over_tls_a_client_that_does_not_trust_it_or_speaks_plain_http_gets_nothing(shared_tls):
    d = shared_tls
    port = urlsplit(d.console).port
    untrusting = http.client.HTTPSConnection("127.0.0.1", port, timeout=10,
                                             context=ssl.create_default_context())
    with pytest.raises(ssl.SSLCertVerificationError):
        untrusting.request("GET", "/")
    untrusting.close()
    with pytest.raises((http.client.HTTPException, OSError)):
        get(f"http://console.test:{port}", "/")


ORIGINS = [
    # (Host header, Origin header, what the console answers a signed-in GET of /)
    ("{public}", "https://{public}", 200),
    ("127.0.0.1:{port}", "https://127.0.0.1:{port}", 200),     # its own listener, over TLS
    ("{public}", None, 200),
    ("evil.test:{port}", None, 421),                            # DNS rebinding
    ("0.0.0.0:{port}", None, 421),
    ("{public}", "http://{public}", 403),                       # the same name in clear
    ("{public}", "https://console.test", 403),                  # another port
    ("{public}", "https://evil.test", 403),
    ("{public}", "null", 403),
]


@pytest.mark.parametrize("host,origin,want", ORIGINS)
def test_over_tls_hosts_and_origins_other_than_its_own_are_refused(shared_tls, host, origin, want):
    d = shared_tls
    port = urlsplit(d.console).port
    public = f"console.test:{port}"
    cookie, _ = sign_in(d.console, link(d))

    def fill(v: str | None) -> str | None:
        return None if v is None else v.format(public=public, port=port)
    status, _, body = get(d.console, "/", cookie=cookie, host=fill(host), origin=fill(origin))
    assert status == want, body[:200]


@pytest.mark.browser
def test_a_real_browser_signs_in_over_tls_at_the_public_url_and_signs_out(shared_tls):
    """Chromium on a phone-sized screen, told (its own resolver rule) that console.test is
    127.0.0.1 and given the test certificate's key as trusted: the named link signs in, the
    Secure cookie goes with the next pages, the approvals page answers, and Sign out (a POST
    with the page's CSRF token and Chromium's own Origin header) ends the session."""
    d = shared_tls
    leaf = x509.load_pem_x509_certificate(Path(d.key_file).with_suffix(".crt").read_bytes())
    spki = leaf.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    flags = ("--host-resolver-rules=MAP console.test 127.0.0.1",
             "--ignore-certificate-errors-spki-list=" + base64.b64encode(hashlib.sha256(spki).digest()).decode())
    url = json.loads(sfguard(d, "console", "--as", "bob", "--json").stdout)["url"]
    assert url.startswith(d.console + "/login?t=")

    async def person() -> dict:
        async with Viewer(width=PHONE[0], height=PHONE[1], mobile=True, extra_args=flags) as v:
            await v.goto(url)
            await v.wait_for("location.pathname === '/'", 20, "the overview after sign-in")
            await v.goto(d.console + "/approvals")
            await v.wait_for("document.getElementById('no-pending') !== null", 20, "the approvals page")
            seen = {"where": await v.eval("location.href"), "secure": await v.eval("window.isSecureContext"),
                    "text": await v.eval("document.body.innerText"), "fit": await phone_fit(v)}
            await v.screenshot(ARTIFACTS / "phone-approvals-tls.png")
            await v.click_selector("form.logout button")
            await v.wait_for("document.body.innerText.includes('Signed out')", 20, "the signed-out page")
            await v.goto(d.console + "/approvals")
            seen["after"] = await v.eval("document.body.innerText")
            return seen

    seen = asyncio.run(person())
    assert seen["where"] == d.console + "/approvals" and seen["secure"] is True
    assert "signed in as bob" in seen["text"]
    assert_fits_a_phone(seen["fit"])
    assert "Not signed in" in seen["after"]
    assert re.search(r"console: session s-[0-9a-f]{8} signed in as bob from 127\.0\.0\.1", d.log.read_text())


# -- 3. a trusted reverse proxy ---------------------------------------------------------------------
def test_only_the_trusted_proxys_forwarded_headers_count(fake_guard):
    port = free_port()
    d = fake_guard("--console", f"127.0.0.1:{port}", "--console-url", "https://console.test",
                   "--console-trusted-proxy", "127.0.0.2")
    assert d.console == "https://console.test"
    assert "plain HTTP behind the trusted proxy 127.0.0.2" in d.banner
    local = f"http://127.0.0.1:{port}"
    forwarded = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9, 198.51.100.7"}
    url = link(d)
    assert url.startswith("https://console.test/login?t=")
    # through the proxy (peer 127.0.0.2): the browser used https, the person is 198.51.100.7
    _, sc = sign_in(local, url, host="console.test", source="127.0.0.2", headers=forwarded)
    assert "secure" in sc.lower()
    status, headers, _ = get(local, "/", cookie=sc.split(";")[0], host="console.test",
                             origin="https://console.test", source="127.0.0.2", headers=forwarded)
    assert status == 200 and headers.get("Strict-Transport-Security")
    # the same headers from any other peer are not believed
    _, sc = sign_in(local, link(d), host="console.test", source="127.0.0.1", headers=forwarded)
    assert "secure" not in sc.lower()
    log = d.log.read_text()
    assert "from 198.51.100.7" in log and "from 127.0.0.1" in log and "from 203.0.113.9" not in log


@pytest.mark.parametrize("peer,ok", [
    ("10.0.0.5", True),             # the proxy
    ("::ffff:10.0.0.5", True),      # the proxy over a dual-stack socket
    ("127.0.0.1", True),            # this machine
    ("::1", True),
    ("10.0.0.6", False),            # anyone else on the network
    ("192.168.1.20", False),
    ("", False),
    (None, False),
])
def test_with_a_trusted_proxy_only_it_and_this_machine_may_connect(peer, ok):
    cfg = ConsoleConfig(host="0.0.0.0", port=8443, trusted_proxy="10.0.0.5")
    assert peer_allowed(peer, cfg) is ok
    assert peer_allowed(peer, ConsoleConfig()) is True        # no proxy named: no such rule


# -- 4. what is refused before the guard starts ------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("certs")
    ca = make_ca("refusals CA")
    cert, key = issue(ca, "console.test", tmp)
    loose = tmp / "loose.key"
    loose.write_bytes(key.read_bytes())
    loose.chmod(0o644)
    locked = tmp / "locked.key"
    k = serialization.load_pem_private_key(key.read_bytes(), None)
    locked.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.BestAvailableEncryption(b"pass phrase")))
    locked.chmod(0o600)
    junk = tmp / "junk.pem"
    junk.write_text("not a certificate\n")
    return {"cert": cert, "key": key, "loose": loose, "locked": locked, "junk": junk}


REFUSED = [
    # (console_config arguments, words of the refusal)
    ({"listen": "0.0.0.0:8443"}, "--console-public"),
    ({"listen": "192.168.1.5:8443", "public": True}, "cross the network in clear"),
    ({"listen": "0.0.0.0:8443", "public": True, "plain_http": True}, "--console-url"),
    ({"listen": "0.0.0.0:8443", "public": True, "tls_cert": "cert", "tls_key": "key"}, "--console-url"),
    ({"listen": "example.com:80"}, "not an IP address"),
    ({"listen": "127.0.0.1:70000"}, "port from 0 to 65535"),
    ({"listen": "127.0.0.1", "tls_cert": "cert"}, "go together"),
    ({"listen": "127.0.0.1", "tls_cert": "cert", "tls_key": "loose", "url": "https://console.test"},
     "chmod 600"),
    ({"listen": "127.0.0.1", "tls_cert": "cert", "tls_key": "locked", "url": "https://console.test"},
     "encrypted"),
    ({"listen": "127.0.0.1", "tls_cert": "junk", "tls_key": "key"}, "cannot be used"),
    ({"listen": "127.0.0.1", "tls_cert": "cert", "tls_key": "key", "url": "https://other.test"},
     "browsers would refuse it"),
    ({"listen": "127.0.0.1", "tls_cert": "cert", "tls_key": "key", "url": "http://console.test"},
     "https://"),
    ({"listen": "127.0.0.1", "url": "https://console.test"}, "--console-trusted-proxy"),
    ({"listen": "127.0.0.1", "url": "https://console.test/guard", "trusted_proxy": "127.0.0.1"}, "no path"),
    ({"listen": "127.0.0.1", "url": "ftp://console.test"}, "http(s)://"),
    ({"listen": "127.0.0.1", "trusted_proxy": "10.0.0.5"}, "cannot reach"),
    ({"listen": "127.0.0.1", "trusted_proxy": "proxy.lan"}, "IP address"),
]


@pytest.mark.parametrize("kwargs,words", REFUSED, ids=[w for _, w in REFUSED])
def test_a_console_that_would_be_exposed_or_not_work_is_refused(certs, kwargs, words):
    args = {k: str(certs[v]) if k in ("tls_cert", "tls_key") else v for k, v in kwargs.items()}
    listen = args.pop("listen")
    with pytest.raises(ConsoleError, match=re.escape(words)) as err:
        console_config(listen, **args)
    text = str(err.value)
    for secret_file in ("key", "locked", "loose"):
        body = certs[secret_file].read_text().splitlines()[1]
        assert body not in text


ACCEPTED = [
    ({"listen": "127.0.0.1"}, ("127.0.0.1", None, "http")),
    ({"listen": "8080"}, ("127.0.0.1", 8080, "http")),
    ({"listen": "[::1]:9000"}, ("::1", 9000, "http")),
    ({"listen": "0.0.0.0:8443", "public": True, "tls_cert": "cert", "tls_key": "key",
      "url": "https://console.test:8443"}, ("0.0.0.0", 8443, "https")),
    ({"listen": "127.0.0.1:8080", "url": "https://console.test", "trusted_proxy": "127.0.0.1"},
     ("127.0.0.1", 8080, "http")),
    ({"listen": "10.1.2.3:8080", "public": True, "plain_http": True}, ("10.1.2.3", 8080, "http")),
]


@pytest.mark.parametrize("kwargs,want", ACCEPTED)
def test_what_is_accepted(certs, kwargs, want):
    args = {k: str(certs[v]) if k in ("tls_cert", "tls_key") else v for k, v in kwargs.items()}
    cfg = console_config(args.pop("listen"), **args)
    assert (cfg.host, cfg.port, cfg.scheme) == want
    assert bool(cfg.warnings) == ("plain_http" in kwargs)     # plain HTTP on the network: said


@pytest.mark.parametrize("kwargs,words", [
    ({"listen": "0.0.0.0", "url": "https://console.test:8443"}, "fixed port"),
    ({"listen": "0.0.0.0:9443", "url": "https://console.test:8443"}, "port forward"),
    ({"listen": "10.1.2.3:8080", "plain_http": True}, "in clear"),
])
def test_what_is_started_with_a_warning(certs, kwargs, words):
    args = {"public": True, "tls_cert": str(certs["cert"]), "tls_key": str(certs["key"]), **kwargs}
    if args.get("plain_http"):
        del args["tls_cert"], args["tls_key"]
    cfg = console_config(args.pop("listen"), **args)
    assert any(words in w for w in cfg.warnings), cfg.warnings


def test_sfguard_start_refuses_a_public_console_without_tls(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(tmp_path / "h"),
                        "--console", "0.0.0.0:0", "--console-public"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "--console-tls-cert" in r.stderr and "--console-plain-http" in r.stderr


# -- 5. named sign-in links --------------------------------------------------------------------------
def test_a_named_link_decides_as_its_person_and_names_are_checked_at_the_edge(fake_guard):
    from tests.console.test_console_scope import csrf_of, open_handoff, request
    d = fake_guard()
    for bad in ("Alice", "s-1234abcd", "a b", "x" * 33, "-x", "", "alice;rm"):
        r = sfguard(d, "console", "--as", bad)
        assert r.returncode == 2 and "--as" in r.stderr, (bad, r.returncode, r.stderr)
    status, body = d.call("POST", "/v1/console/link", {"person": "Bob"})
    assert status == 400 and body["error"]["field"] == "person", body
    r = sfguard(d, "console", "--as", "alice", "--json")
    assert r.returncode == 0, r.stderr
    cookie, _ = sign_in(d.console, json.loads(r.stdout)["url"])
    csrf = csrf_of(request(d.console, "GET", "/", cookie=cookie)[1])
    h = open_handoff(d, "named-1", "acct")
    assert request(d.console, "POST", f"/live/{h['hid']}/cancel", cookie=cookie, origin=d.console,
                   body=f"csrf={csrf}")[0] == 200
    unnamed, _ = sign_in(d.console, link(d))
    assert "signed in as" not in request(d.console, "GET", "/", cookie=unnamed)[1]
    assert d.stop() == 0
    r = sfguard(d, "audit", "show", "--json")
    records = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    signed_in = [x["fields"] for x in records if x["event"] == "console_signed_in"]
    assert [f.get("person") for f in signed_in] == ["alice", None], signed_in
    assert re.fullmatch(r"s-[0-9a-f]{8}", signed_in[0]["by"])
    closed = [x["fields"] for x in records if x["event"] == "handoff_closed"]
    assert closed and closed[0]["by"] == "console:alice" and closed[0]["outcome"] == "cancelled", closed


def test_a_session_decides_as_its_person_else_as_its_id():
    auth = ConsoleAuth()
    _, named = auth.redeem(auth.new_link("console", person="alice"), "console")
    _, plain = auth.redeem(auth.new_link("console"), "console")
    assert named.decider == "console:alice"
    assert plain.decider == f"console:{plain.public_id}" and plain.person is None
    for scope, person in (("live:0123456789abcdef", "alice"), ("console", "s-0123abcd"), ("console", "Al")):
        with pytest.raises(ValueError):
            auth.new_link(scope, person=person)
