"""A fixture site for the write gate's attack tests: one handler served over plain HTTP and over
HTTPS (a certificate from a test authority the guard is given with --ca-file), for every host
name the tests resolve to 127.0.0.1. It records every request it receives (scheme, host,
method, path as sent, the headers that matter) and serves a page with a logged-in session
cookie, forms, frames and a ping link to send writes from."""
from __future__ import annotations

import http.server
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.tls_site import Authority, issue, make_ca

PAGE = """<!doctype html><html><head><title>write site</title></head><body>
<h1>write site</h1>
<form name=login method=post action="/w/login/form">
 <input name=user value="op"><input type=password name=f_secret value="hunter2-pw">
 <input name=pw value="pw-value-1"><input name=mfa value="mfa-424242"><input name=credentials value="cred-9">
 <input name=shipping_address value="1 Main St"><input name=author value="ann">
 <button type=submit>send</button>
</form>
<a id=ping ping="/w/ping/ping" href="#pinged">ping</a>
<iframe name=inner src="/frame"></iframe>
</body></html>"""
FRAME = """<!doctype html><html><body><form name=f method=post action="/w/iframe/form">
<input name=msg value="from a frame"></form>
<script>if (location.search) document.forms.f.action = '/w/iframe/' + location.search.slice(1);
addEventListener('message', () => document.forms.f.submit());</script></body></html>"""


@dataclass(frozen=True)
class Got:
    scheme: str
    host: str
    method: str
    path: str
    cookie: str
    override: str


class WriteSite:
    """`http_port` and `https_port` serve the same site; `got` is every request received."""

    def __init__(self, folder: Path, hosts: tuple[str, ...]):
        self.got: list[Got] = []
        self.lock = threading.Lock()
        #: more pages by path (a test's own)
        self.pages: dict[str, str] = {}
        self.ca: Authority = make_ca("sfguard write-gate test authority")
        self.ca_file = self.ca.write(folder / "ca.pem")
        cert, key = issue(self.ca, hosts[0], folder, extra_names=hosts[1:])
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
                host = (self.headers.get("Host") or "").rsplit(":", 1)[0].lower()
                with outer.lock:
                    outer.got.append(Got(scheme, host, self.command, self.path, self.headers.get("Cookie") or "",
                                         self.headers.get("X-HTTP-Method-Override") or ""))
                path = self.path.split("?")[0]
                body = (PAGE if path == "/page" else FRAME if path == "/frame" else outer.pages.get(path)
                        or "<!doctype html><title>ok</title><p>written</p>").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Cache-Control", "no-store")
                self.send_header("Access-Control-Allow-Origin", "*")
                if path == "/page":
                    self.send_header("Set-Cookie", "sid=logged-in; Path=/; HttpOnly; "
                                     + ("SameSite=None; Secure" if scheme == "https" else "SameSite=Lax"))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

            def log_message(self, *args) -> None:
                pass

        self.servers = []
        for tls in (False, True):
            srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            srv.daemon_threads = True
            if tls:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.load_cert_chain(cert, key)
                srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
            self.servers.append(srv)
        self.http_port = self.servers[0].server_address[1]
        self.https_port = self.servers[1].server_address[1]

    def port(self, scheme: str) -> int:
        return self.https_port if scheme == "https" else self.http_port

    def paths(self, prefix: str, method: str | None = None) -> list[str]:
        """The paths received that start with `prefix` (writes only unless `method` is given)."""
        with self.lock:
            return [g.path for g in self.got if g.path.startswith(prefix)
                    and (g.method == method if method else g.method != "GET")]

    def close(self) -> None:
        for srv in self.servers:
            srv.shutdown()
            srv.server_close()
