"""ConnectionGuard addon: per-connection bookkeeping and the head-read timeout.

mitmproxy closes a connection only after 10 minutes without any traffic, so a client that
trickles a request head byte by byte could hold a connection forever. The guard gives each new
connection `head_timeout` seconds to complete its first request head (and, for a CONNECT
tunnel, its first message inside the tunnel); after that it is closed. Other clients are not
affected. The per-connection state is dropped when the client disconnects. It also signals
`GuardState.running` once mitmproxy's servers listen.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from mitmproxy import addonmanager, connection

from sfguard.proxy_addons.state import GuardState

if TYPE_CHECKING:  # the module is imported after _lean_import.install() by server.py only
    from mitmproxy.addons.proxyserver import Proxyserver

logger = logging.getLogger("sfguard.proxy.connections")


class ConnectionGuard:
    def __init__(self, state: GuardState) -> None:
        self.s = state
        self._proxyserver: Proxyserver | None = None

    def load(self, loader: addonmanager.Loader) -> None:
        from mitmproxy import ctx
        self._proxyserver = ctx.master.addons.get("proxyserver")

    def running(self) -> None:
        self.s.running.set()  # the proxy servers are up: GuardProxy.start() may return

    def client_connected(self, client: connection.Client) -> None:
        conn = self.s.conn(client.id)
        loop = asyncio.get_running_loop()
        conn.timer = loop.call_later(self.s.head_timeout, self._expire, client.id)

    def client_disconnected(self, client: connection.Client) -> None:
        conn = self.s.conns.pop(client.id, None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()
        if conn is not None:
            for key in conn.paced:   # the connections it counted against a site's pace
                self.s.pacer.caps.release(key)

    def _expire(self, client_id: str) -> None:
        conn = self.s.conns.get(client_id)
        if conn is None or conn.head_done:
            return
        if conn.waiting:   # held by the pace (bounded): the head timeout starts again after it
            conn.timer = asyncio.get_running_loop().call_later(self.s.head_timeout, self._expire, client_id)
            return
        handler = self._proxyserver.connections.get(client_id) if self._proxyserver else None
        if handler is None:
            return
        io = handler.transports.get(handler.client)
        if io is not None and io.handler is not None:
            logger.info("closed a connection that did not finish its request head in %.0f s",
                        self.s.head_timeout)
            io.handler.cancel("sfguard: request head timeout")
