"""Who may reach the console and at which address (issue 46; listen.py checks the options).

The console binds where `--console` says (the port recorded in the home when none is given)
and its links use `--console-url` when set. A request must name it: its Host one of its own
listener's names or the public URL's, an Origin one of those with the console's scheme. With
a trusted proxy, only it and this machine may connect, and only its X-Forwarded-Proto (was the
browser on TLS?) and X-Forwarded-For (who is the person?) count. HSTS only for a public https
name, never an address or localhost (it would pin every port of that host).
"""
from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from sfguard.policy import join_host_port
from sfguard.supervisor.console.listen import (
    WILDCARDS,
    ConsoleConfig,
    is_loopback,
    peer_allowed,
    remember_port,
    remembered_port,
)

log = logging.getLogger("sfguard.console")

DEFAULT_PORT = {"http": 80, "https": 443}
HSTS = "max-age=31536000"


class Reach:
    def __init__(self, cfg: ConsoleConfig):
        self.cfg = cfg
        self.host, self.port = cfg.host, cfg.port or 0
        self.public = cfg.public()               # (scheme, host, port) of --console-url
        self.moved_from: int | None = None       # the recorded port, when it was taken
        self.base_url = ""

    # -- listening -------------------------------------------------------------------------
    async def listen(self, runner: web.AppRunner, home: Path | None) -> str:
        """Bind; without a port given, the one recorded in the home (a free one when there is
        none or it is taken), recorded for the next start. The URL links use."""
        remembered = self.cfg.port is None and home is not None
        port = (remembered_port(home) or 0) if remembered and home else self.port
        ctx = self.cfg.ssl_context()
        try:
            await web.TCPSite(runner, self.host, port, ssl_context=ctx).start()
        except OSError as exc:
            if not remembered or port == 0:
                raise
            log.warning("console: its port %s is taken (%s); listening on another one",
                        port, exc.strerror or exc)
            self.moved_from = port
            await web.TCPSite(runner, self.host, 0, ssl_context=ctx).start()
        self.port = runner.addresses[0][1]        # the bound port (0 = a free one)
        if remembered and home:
            remember_port(home, self.port)
        public = self.public_host()
        self.base_url = (f"{self.public[0]}://{public}" if self.public and public
                         else f"{self.cfg.scheme}://{join_host_port(self.host, self.port)}")
        return self.base_url

    def describe(self) -> str:
        """The banner's words: the URL, where it listens, how."""
        how = ("TLS" if self.cfg.tls else
               f"plain HTTP behind the trusted proxy {self.cfg.trusted_proxy}" if self.cfg.trusted_proxy
               else "plain HTTP")
        moved = f"; port {self.moved_from} was taken" if self.moved_from else ""
        return f"{self.base_url} (listening on {join_host_port(self.host, self.port)}, {how}{moved})"

    # -- names ---------------------------------------------------------------------------------
    def local_hosts(self) -> set[str]:
        """Host headers that name this listener itself (never a wildcard address)."""
        out = set() if self.host in WILDCARDS else {join_host_port(self.host, self.port)}
        if is_loopback(self.host) or self.host in WILDCARDS:
            out |= {f"127.0.0.1:{self.port}", f"localhost:{self.port}", f"[::1]:{self.port}"}
        return out

    def public_host(self) -> str | None:
        """The Host a browser sends for --console-url (no default port), or None."""
        if self.public is None:
            return None
        scheme, host, port = self.public
        return join_host_port(host, None if port == DEFAULT_PORT[scheme] else port)

    def hosts(self) -> set[str]:
        public = self.public_host()
        return self.local_hosts() | ({public} if public else set())

    def origins(self) -> set[str]:
        out = {f"{self.cfg.scheme}://{h}" for h in self.local_hosts()}
        if self.public is not None:
            out.add(f"{self.public[0]}://{self.public_host()}")
        return out

    # -- one request ---------------------------------------------------------------------------
    def peer_ok(self, request: web.Request) -> bool:
        return peer_allowed(request.remote, self.cfg)

    def host_ok(self, request: web.Request) -> bool:
        return not self.base_url or request.host.lower() in self.hosts()

    def same_origin(self, request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        return origin is not None and origin.lower() in self.origins()

    def secure(self, request: web.Request) -> bool:
        """The browser reached the console over TLS: its own, or the trusted proxy's (the only
        peer whose X-Forwarded-Proto counts)."""
        if request.secure:
            return True
        fwd = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
        return fwd == "https" and request.remote == self.cfg.trusted_proxy

    def client(self, request: web.Request) -> str:
        """The person's address: the peer, or what the trusted proxy says it saw (the last
        X-Forwarded-For entry, the one it added)."""
        fwd = request.headers.get("X-Forwarded-For", "")
        if fwd and request.remote == self.cfg.trusted_proxy:
            return fwd.split(",")[-1].strip()[:64]
        return request.remote or "?"

    def hsts(self, request: web.Request) -> bool:
        if self.public is None or self.public[0] != "https" or not self.secure(request):
            return False
        host = self.public[1]
        is_address = host.replace(".", "").isdigit() or ":" in host
        return request.host.lower() == self.public_host() and not is_loopback(host) and not is_address
