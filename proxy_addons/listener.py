"""`GuardListener`: the guard proxy's listening socket, and the first byte of every connection.

The guard listens itself (mitmproxy's proxy server is configured not to) so that it can choose,
on a connection's first byte, who serves it:

- a capital letter other than `C` (`GET`, `POST`, `HEAD`, ...: a plain-HTTP request, the way a
  browser sends an http:// URL to a proxy): `plain_conn.PlainConnection`, which runs the guard's
  `PlainHttpLayer` on the socket's protocol callbacks;
- anything else (`CONNECT`, and every other start: TLS, `COPY`, junk): mitmproxy's connection
  handler for regular proxy mode (`RegularInstance.handle_stream`, exactly as mitmproxy's own
  listener hands it a connection), where LayerGuard chooses the layers as before.

Either way the first bytes are passed on unchanged, so what each path does with them (limits,
answers, decision-log lines) is what it did before the split. A connection that sends nothing
is closed after the head-read timeout; the time it took to send its first byte counts against
that timeout (ConnectionGuard reads the accept time from `GuardState.accepted`).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from mitmproxy import options
from mitmproxy.proxy import mode_servers, mode_specs

from sfguard.proxy_addons.plain_conn import PlainConnection
from sfguard.proxy_addons.state import GuardState

if TYPE_CHECKING:
    from mitmproxy.addons.proxyserver import Proxyserver

    from sfguard.proxy_addons.dispatch import CachedAddonManager

logger = logging.getLogger("sfguard.proxy.listener")

#: asyncio's default stream buffer limit (what `asyncio.start_server` gives mitmproxy).
STREAM_LIMIT = 2 ** 16


def serves_plain(first: bytes) -> bool:
    """True for a first byte that starts a plain-HTTP request the guard serves itself."""
    return b"A" <= first[:1] <= b"Z" and first[:1] != b"C"


class _FrontDoor(asyncio.Protocol):
    """A new connection until its first bytes arrive."""

    def __init__(self, listener: GuardListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        if peer is not None:
            self.listener.state.accepted[tuple(peer)] = loop.time()
        self.timer = loop.call_later(self.listener.state.head_timeout, self._expire)
        self.listener.waiting.add(self)

    def data_received(self, data: bytes) -> None:
        self._done()
        if self.transport is not None:
            self.listener.route(self.transport, data)

    def eof_received(self) -> bool:
        self._drop()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop()

    def _expire(self) -> None:
        logger.info("closed a connection that did not finish its request head in %.0f s",
                    self.listener.state.head_timeout)
        self._drop()

    def _done(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.listener.waiting.discard(self)

    def _drop(self) -> None:
        self._done()
        if self.transport is not None:
            peer = self.transport.get_extra_info("peername")
            if peer is not None:
                self.listener.state.accepted.pop(tuple(peer), None)
            self.transport.close()


class GuardListener:
    """Accepts the proxy's connections and hands each to its handler (module docstring)."""

    def __init__(self, state: GuardState, addons: CachedAddonManager, opts: options.Options,
                 proxyserver: Proxyserver) -> None:
        self.state = state
        self.addons = addons
        self.opts = opts
        self.mode = mode_specs.ProxyMode.parse("regular")
        self.instance = mode_servers.RegularInstance(self.mode, proxyserver)
        self.server: asyncio.Server | None = None
        self.plain: dict[str, PlainConnection] = {}
        self.waiting: set[_FrontDoor] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen; returns the bound (host, port). Raises OSError."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _FrontDoor(self), host, port)
        sockname = self.server.sockets[0].getsockname()
        return str(sockname[0]), int(sockname[1])

    @property
    def open_connections(self) -> int:
        return len(self.plain)

    def route(self, transport: asyncio.Transport, first: bytes) -> None:
        peer = transport.get_extra_info("peername")
        if serves_plain(first):
            conn = PlainConnection(
                transport, first, addons=self.addons, opts=self.opts, mode=self.mode,
                max_head_bytes=self.state.max_head_bytes, max_header_count=self.state.max_header_count,
                on_refuse=self.state.head_refused, on_close=self._closed)
            if not conn.closed:
                self.plain[conn.id] = conn
            return
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        reader.feed_data(first)
        task = loop.create_task(self.instance.handle_stream(reader, writer))
        self.tasks.add(task)
        task.add_done_callback(lambda done: self._handled(done, peer))

    def _handled(self, task: asyncio.Task[None], peer: object) -> None:
        self.tasks.discard(task)
        self._forget(peer)

    def _forget(self, peer: object) -> None:
        """Drop the accept time of a connection that ended (ConnectionGuard takes it when the
        connection starts; this covers one that ended before)."""
        if isinstance(peer, tuple):
            self.state.accepted.pop(peer, None)

    def _closed(self, conn: PlainConnection) -> None:
        self.plain.pop(conn.id, None)
        self._forget(conn.client.peername)

    def close_plain(self, client_id: str, reason: str) -> bool:
        """Close one plain-HTTP connection the guard serves itself; False if there is none."""
        conn = self.plain.get(client_id)
        if conn is None:
            return False
        conn.close(reason)
        return True

    def stop_listening(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def close_all(self, reason: str) -> None:
        """Every connection not yet routed and every plain-HTTP connection closed (mitmproxy's
        handlers are closed by their owner, GuardProxy.stop)."""
        for door in list(self.waiting):
            door._drop()
        for conn in list(self.plain.values()):
            conn.close(reason)
