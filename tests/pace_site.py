"""A fixture site that counts what it receives, per second (issue 49's proof of pacing).

`PaceSite()` serves HTTP/1.1 on 127.0.0.1 (a free port) from a thread, `PaceSite(tls=(crt, key))`
HTTPS: every request is recorded with its arrival time (time.monotonic(), the site's own clock),
path and `Sec-Fetch-Dest`. Pages are small HTML documents (`/page/N` links to `/page/N+1` and
loads one image), `/img/N.png` a tiny image, `/loop/N` a page that reloads itself at once,
forever. Tests read `site.times()` and judge the pace by the site's own counter:
`most_in(times, window)` is the most requests that arrived within any `window` seconds.
"""
from __future__ import annotations

import bisect
import ssl
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")


class PaceSite:
    def __init__(self, tls: tuple[Path, Path] | None = None) -> None:
        """`tls`: (certificate chain, key) files to serve HTTPS instead (tests/tls_site.py issue)."""
        self.lock = threading.Lock()
        self.log: list[tuple[float, str, str | None]] = []   # (arrival, path, Sec-Fetch-Dest)
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                with site.lock:
                    site.log.append((time.monotonic(), self.path, self.headers.get("Sec-Fetch-Dest")))
                if self.path.startswith("/img/"):
                    body, ctype = PNG, "image/png"
                elif self.path.startswith("/loop/"):   # a page that reloads itself at once, forever
                    body = b"<!doctype html><title>loop</title><script>location.reload()</script>"
                    ctype = "text/html; charset=utf-8"
                else:
                    n = self.path.rsplit("/", 1)[-1]
                    nxt = int(n) + 1 if n.isdigit() else 1
                    body = (f"<!doctype html><title>page {n}</title><h1 id=h>page {n}</h1>"
                            f"<img src=/img/{n}.png><a id=next href=/page/{nxt}>next</a>").encode()
                    ctype = "text/html; charset=utf-8"
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def times(self, prefix: str = "/", dest: str | None = None) -> list[float]:
        """Arrival times of the requests whose path starts with `prefix` (and, with `dest`,
        whose Sec-Fetch-Dest is that)."""
        with self.lock:
            return sorted(t for t, path, d in self.log if path.startswith(prefix) and (dest is None or d == dest))

    def clear(self) -> None:
        with self.lock:
            self.log.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def most_in(times: Iterable[float], window: float) -> int:
    """The most arrivals within any `window` seconds (a closed window, start to start+window)."""
    ts = sorted(times)
    best = 0
    for i, t in enumerate(ts):
        best = max(best, bisect.bisect_right(ts, t + window) - i)
    return best


def per_second(times: Iterable[float]) -> list[int]:
    """Arrivals in each whole second from the first one (what a site's own counter shows)."""
    ts = sorted(times)
    if not ts:
        return []
    out = [0] * (int(ts[-1] - ts[0]) + 1)
    for t in ts:
        out[int(t - ts[0])] += 1
    return out
