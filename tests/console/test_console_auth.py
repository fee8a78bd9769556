"""The console's doors, against a real `sfguard start`: no page or endpoint without a session,
a one-time link works once and not after it expired, cross-origin and CSRF-less POSTs and a
foreign Host are refused, and every page is served with a strict CSP and no inline script."""
from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest

from tests.console.conftest import ROOT, link
from tests.daemon.conftest import Daemon

PAGES = ["/", "/decisions", "/profiles", "/audit"]


def req(base: str, method: str, path: str, *, cookie: str | None = None, origin: str | None = None,
        host: str | None = None, body: str | None = None, accept: str = "text/html"):
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    headers = {"Accept": accept}
    if cookie:
        headers["Cookie"] = cookie
    if origin:
        headers["Origin"] = origin
    if host:
        headers["Host"] = host
    if body is not None:
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    data = r.read().decode(errors="replace")
    conn.close()
    return r.status, r.headers, data


def sign_in(base: str, url: str) -> tuple[int, str | None, str]:
    """Use a login link; (status, 'name=value' cookie or None, Set-Cookie header)."""
    u = urlsplit(url)
    status, headers, _ = req(base, "GET", f"{u.path}?{u.query}")
    sc = headers.get("Set-Cookie") or ""
    return status, (sc.split(";", 1)[0] if sc else None), sc


@pytest.mark.parametrize("method,path,accept", [("GET", p, "text/html") for p in PAGES] + [
    ("GET", "/events?page=overview", "text/event-stream"),
    ("GET", "/live/0123456789abcdef", "text/html"),
    ("GET", "/live/0123456789abcdef/ws", "text/html"),
])
def test_nothing_without_a_session(shared_guard, method, path, accept):
    status, headers, body = req(shared_guard.console, method, path, accept=accept)
    assert status == 401, (path, status)
    assert "sfguard console" in body
    assert "default-src 'none'" in headers["Content-Security-Policy"]


def test_a_link_works_once_gives_a_strict_cookie_and_then_is_refused(shared_guard):
    guard = shared_guard
    url = link(guard)
    status, cookie, sc = sign_in(guard.console, url)
    assert status == 200 and cookie
    low = sc.lower()
    assert "httponly" in low and "samesite=strict" in low and "max-age=" in low and "path=/" in low
    for page in PAGES:
        st, headers, body = req(guard.console, "GET", page, cookie=cookie)
        assert st == 200, page
        csp = headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert headers["X-Frame-Options"] == "DENY" and headers["Cache-Control"] == "no-store"
        # no inline script and nothing from another origin: every script has a local src
        assert not re.search(r"<script(?![^>]*\bsrc=\"/static/)", body), page
        assert not re.search(r"(src|href)=\"(https?:)?//", body), page
        assert "<a href=\"/decisions\"" in body
    # the same link again: refused, no cookie
    status, again, _ = sign_in(guard.console, url)
    assert status == 401 and again is None
    # a made-up token: refused
    assert sign_in(guard.console, f"{guard.console}/login?t=not-a-token")[0] == 401


def test_an_expired_link_is_refused(shared_guard):
    guard = shared_guard
    url = link(guard, ttl=1)
    time.sleep(1.5)
    status, cookie, _ = sign_in(guard.console, url)
    assert status == 401 and cookie is None


def test_cross_origin_and_csrf_less_posts_and_foreign_hosts_are_refused(shared_guard):
    guard = shared_guard
    _, cookie, _ = sign_in(guard.console, link(guard))
    _, _, page = req(guard.console, "GET", "/", cookie=cookie)
    csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
    own = guard.console
    cases = [
        (None, f"csrf={csrf}", 403),                      # no Origin
        ("http://evil.test", f"csrf={csrf}", 403),        # another origin
        ("null", f"csrf={csrf}", 403),
        (own, "", 403),                                   # no CSRF token
        (own, "csrf=wrong", 403),
    ]
    for origin, body, want in cases:
        status, _, _ = req(own, "POST", "/logout", cookie=cookie, origin=origin, body=body)
        assert status == want, (origin, body, status)
        assert req(own, "GET", "/", cookie=cookie)[0] == 200   # still signed in
    # a page asked for under another Host name (DNS rebinding) is refused
    assert req(own, "GET", "/", cookie=cookie, host="evil.test:80")[0] == 421
    # the right origin and token: signed out, the cookie is dead
    status, _, _ = req(own, "POST", "/logout", cookie=cookie, origin=own, body=f"csrf={csrf}")
    assert status == 200
    assert req(own, "GET", "/", cookie=cookie)[0] == 401


def test_cli_prints_a_link_and_status_shows_the_console(shared_guard):
    guard = shared_guard
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "console", "--home", str(guard.home)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    url = r.stdout.splitlines()[0]
    assert url.startswith(guard.console + "/login?t=")
    assert sign_in(guard.console, url)[0] == 200
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "status", "--home", str(guard.home)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert f"console {guard.console}" in r.stdout
    # the link is not in the guard's log
    assert url.split("t=")[1] not in guard.log.read_text()


def test_console_off_and_non_loopback_need_flags(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(tmp_path / "h1"),
                        "--console", "0.0.0.0:0"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "--console-public" in r.stderr
    d = Daemon((tmp_path / "h2").absolute(), env, tmp_path / "d.log")
    d.start("--no-console")
    try:
        assert "console on" not in d.banner
        status, body = d.call("POST", "/v1/console/link", {})
        assert status == 409 and body["error"]["code"] == "console_off"
        assert d.call("GET", "/v1/status")[1]["console"] is None
    finally:
        d.stop()
