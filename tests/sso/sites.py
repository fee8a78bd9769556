"""The two origins of the SSO tests: a real OpenID Connect provider (idp.mjs, npm
oidc-provider) on idp.test and a small relying-party app on app.test that signs in through it
(authorization code with PKCE, redirects both ways). Both over HTTPS with certificates from a
test authority (tests/tls_site.py); the app exchanges the code with the provider directly on
loopback (server to server, not through the guard, as a real app would)."""
from __future__ import annotations

import base64
import hashlib
import http.server
import json
import secrets
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.conftest import free_port
from tests.tls_site import Authority, issue

ROOT = Path(__file__).resolve().parents[2]


class App:
    """The relying party: /login starts the flow, /cb finishes it, /account needs a session."""

    def __init__(self, ca: Authority, where: Path, idp_port: int):
        cert, key = issue(ca, "app.test", where)
        self.sessions: dict[str, str] = {}
        self.pending: dict[str, str] = {}
        self.secret = secrets.token_hex(16)
        self.idp_port = idp_port
        self.idp_ctx = ssl.create_default_context(cadata=ca.pem().decode())
        app = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def redirect(self, to: str, cookie: str | None = None) -> None:
                self.send_response(302)
                self.send_header("Location", to)
                if cookie:
                    self.send_header("Set-Cookie", cookie)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(url.query))
                if url.path == "/login":
                    state, verifier = secrets.token_urlsafe(16), secrets.token_urlsafe(48)
                    app.pending[state] = verifier
                    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
                    self.redirect(f"{app.issuer}/auth?" + urllib.parse.urlencode({
                        "client_id": "app", "response_type": "code", "scope": "openid", "state": state,
                        "redirect_uri": app.redirect_uri, "code_challenge": challenge.decode(),
                        "code_challenge_method": "S256"}))
                    return
                if url.path == "/cb":
                    verifier = app.pending.pop(q.get("state", ""), None)
                    sub = app.exchange(q.get("code", ""), verifier) if verifier else None
                    if sub is None:
                        self.send_error(403, "sign-in failed")
                        return
                    sid = secrets.token_urlsafe(24)
                    app.sessions[sid] = sub
                    self.redirect("/account", f"app_session={sid}; Secure; HttpOnly; SameSite=Lax; Path=/; "
                                              "Max-Age=3600")
                    return
                if url.path == "/account":
                    cookies = dict(c.strip().split("=", 1)
                                   for c in self.headers.get("Cookie", "").split(";") if "=" in c)
                    sub = app.sessions.get(cookies.get("app_session", ""))
                    if sub is None:
                        self.redirect("/login")
                        return
                    body = (f"<html><head><title>app account</title></head><body><p id=who>signed in as {sub}</p>"
                            "</body></html>")
                    data = body.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html; charset=utf-8")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_error(404)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.origin = f"https://app.test:{self.port}"
        self.redirect_uri = f"{self.origin}/cb"
        self.issuer = f"https://idp.test:{idp_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def exchange(self, code: str, verifier: str) -> str | None:
        """The code for tokens at the provider's token endpoint, then the user from userinfo."""
        base = f"https://127.0.0.1:{self.idp_port}"
        data = urllib.parse.urlencode({"grant_type": "authorization_code", "code": code, "client_id": "app",
                                       "client_secret": self.secret, "redirect_uri": self.redirect_uri,
                                       "code_verifier": verifier}).encode()
        try:
            req = urllib.request.Request(f"{base}/token", data=data, headers={"Host": f"idp.test:{self.idp_port}"})
            with urllib.request.urlopen(req, context=self.idp_ctx, timeout=10) as r:
                tokens = json.load(r)
            req = urllib.request.Request(f"{base}/me", headers={"Authorization": f"Bearer {tokens['access_token']}",
                                                                "Host": f"idp.test:{self.idp_port}"})
            with urllib.request.urlopen(req, context=self.idp_ctx, timeout=10) as r:
                return str(json.load(r)["sub"])
        except (OSError, ValueError, KeyError):
            return None

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class SsoSites:
    """The provider (a node process) and the app; `close()` stops both."""

    def __init__(self, ca: Authority, where: Path):
        self.idp_port = free_port()
        self.app = App(ca, where, self.idp_port)
        cert, key = issue(ca, "idp.test", where)
        self.idp_origin = self.app.issuer
        self.idp = subprocess.Popen(["node", str(Path(__file__).with_name("idp.mjs")), str(self.idp_port), str(cert),
                                     str(key), self.app.issuer, self.app.redirect_uri, self.app.secret],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.idp.stdout is not None
        line = self.idp.stdout.readline().decode().strip()
        if line != "ready":
            self.idp.kill()
            raise AssertionError(f"the OpenID provider did not start: {line} {self.idp.stderr.read().decode()[-2000:]}")
        self.app.thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.app.port), 0.5).close()
                break
            except OSError:
                time.sleep(0.05)

    def close(self) -> None:
        self.app.close()
        self.idp.terminate()
        self.idp.wait(10)
