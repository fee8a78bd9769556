"""`PlainConnection`: runs one plain-HTTP proxy connection's `PlainHttpLayer` on asyncio protocols.

mitmproxy's connection handler reads each socket in a task of its own through an asyncio
stream, and passes every read through a lock, its command loop and a drain of every writer.
Measured on plain HTTP (docs/proxy.md, Performance) that machinery, not the guard's parsing or
decisions, was the largest part of the run proxy's CPU per request left. The front door
(listener.py) hands a connection whose first request is not a CONNECT to this class instead:
the same `PlainHttpLayer` (the same parsing, framing, limits and answers), driven from the
sockets' protocol callbacks, with the same hooks run through the master's addon manager:

- `client_connected` when it starts, `client_disconnected` when it ends (ConnectionGuard: the
  head-read timeout and the per-connection state);
- the layer's `requestheaders` (ConnectGuard: credentials, decision, address check, decision
  log), inline as before, and any hook the layer raises (the rest of one that had to wait) as
  a task, whose completion is passed back to the layer like mitmproxy does;
- `server_connect` before every server connection (AddressGuard: the checked address only;
  a refused destination is never connected), then `server_connected`, and
  `server_disconnected` after it.

What mitmproxy's handler does besides is kept: a layer's commands run in order (data written,
connections opened and closed), a blocking command pauses the layer until its completion
event, reading pauses while the other side's write buffer is full (backpressure), and a
connection idle for `IDLE_TIMEOUT` seconds (no event, no hook running) is closed.
`close(reason)` is the one way out: every server connection and the client connection closed,
hook tasks cancelled, `client_disconnected` run once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mitmproxy import connection, flow, options
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import commands, events, server_hooks
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.mode_specs import ProxyMode

from sfguard.proxy_addons.plain_http import PlainHttpLayer

if TYPE_CHECKING:
    from sfguard.proxy_addons.dispatch import CachedAddonManager

logger = logging.getLogger("sfguard.proxy.plain")

#: Seconds without traffic after which a connection is closed (mitmproxy's TCP_TIMEOUT).
IDLE_TIMEOUT = 600.0


class _ServerSide(asyncio.Protocol):
    """The socket of one server connection of a `PlainConnection`."""

    def __init__(self, owner: PlainConnection, server: Server) -> None:
        self.owner, self.server = owner, server
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport

    def data_received(self, data: bytes) -> None:
        self.owner.event(events.DataReceived(self.server, data))

    def eof_received(self) -> bool:
        self.owner.peer_closed(self.server)
        return True  # the layer decides when to close our side

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.lost(self.server)

    def pause_writing(self) -> None:
        self.owner.pause_reading(self.owner.transport)

    def resume_writing(self) -> None:
        self.owner.resume_reading(self.owner.transport)


class PlainConnection(asyncio.Protocol):
    """One plain-HTTP client connection (see the module docstring). Created by the front door
    with the connection's transport and its first bytes; it takes the transport over."""

    def __init__(self, transport: asyncio.Transport, first: bytes, *, addons: CachedAddonManager,
                 opts: options.Options, mode: ProxyMode, max_head_bytes: int, max_header_count: int,
                 on_refuse: Callable[[str], None], on_close: Callable[[PlainConnection], None]) -> None:
        self.transport = transport
        self.addons = addons
        self.on_close = on_close
        self.loop = asyncio.get_running_loop()
        self.client = connection.Client(
            peername=transport.get_extra_info("peername"),
            sockname=transport.get_extra_info("sockname"),
            timestamp_start=time.time(), proxy_mode=mode, state=ConnectionState.OPEN)
        self.servers: dict[Server, _ServerSide] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self.last_event = self.loop.time()
        self.layer = PlainHttpLayer(Context(self.client, opts), max_head_bytes, max_header_count,
                                    on_refuse=on_refuse, run_hook=addons.run_inline)
        transport.set_protocol(self)
        self.watchdog = self.loop.call_later(IDLE_TIMEOUT, self._idle_check)
        self._hook(server_hooks.ClientConnectedHook(self.client), self._started, first)

    @property
    def id(self) -> str:
        return self.client.id

    # -- the client's socket ------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self.event(events.DataReceived(self.client, data))

    def eof_received(self) -> bool:
        self.peer_closed(self.client)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost(self.client)

    def pause_writing(self) -> None:
        for side in self.servers.values():
            self.pause_reading(side.transport)

    def resume_writing(self) -> None:
        for side in self.servers.values():
            self.resume_reading(side.transport)

    # -- events into the layer, commands out ----------------------------------------------------
    def _started(self, first: bytes) -> None:
        if self.client.error:
            self.close("client_connected refused it")
            return
        self.event(events.Start())
        self.event(events.DataReceived(self.client, first))

    def event(self, ev: events.Event) -> None:
        if self.closed:
            return
        self.last_event = self.loop.time()
        try:
            for command in self.layer.handle_event(ev):
                self._run(command)
        except Exception:
            logger.exception("plain-HTTP connection failed; closing it")
            self.close("error")

    def _run(self, command: commands.Command) -> None:
        if isinstance(command, commands.SendData):
            transport = self._transport(command.connection)
            if transport is not None and not transport.is_closing():
                transport.write(command.data)
        elif isinstance(command, commands.CloseConnection):
            self._close_connection(command.connection,
                                   isinstance(command, commands.CloseTcpConnection) and command.half_close)
        elif isinstance(command, commands.OpenConnection):
            self._spawn(self._open(command))
        elif isinstance(command, commands.StartHook):  # the rest of a hook that had to wait
            self._spawn(self._layer_hook(command))
        elif isinstance(command, commands.Log):
            logger.log(command.level, "%s", command.message)
        else:
            raise RuntimeError(f"unexpected command from the plain-HTTP layer: {type(command).__name__}")

    async def _layer_hook(self, command: commands.StartHook) -> None:
        """A hook the layer raised, run as mitmproxy's handler runs it (`handle_lifecycle`,
        then an intercepted flow's wait); its completion goes back to the layer."""
        (data,) = command.args()
        await self.addons.handle_lifecycle(command)
        if isinstance(data, flow.Flow):
            await data.wait_for_resume()
        if command.blocking:
            self.event(events.HookCompleted(command))

    def _transport(self, conn: connection.Connection) -> asyncio.Transport | None:
        if conn is self.client:
            return self.transport
        side = self.servers.get(conn)  # type: ignore[call-overload]  # a Server here
        return side.transport if side is not None else None

    def _close_connection(self, conn: connection.Connection, half: bool) -> None:
        if conn is self.client and not half:
            self.close("closed by the layer")
            return
        transport = self._transport(conn)
        if half and transport is not None and conn.state & ConnectionState.CAN_WRITE:
            conn.state &= ~ConnectionState.CAN_WRITE
            if not transport.is_closing():
                transport.write_eof()
            return
        conn.state = ConnectionState.CLOSED
        if transport is not None:
            transport.close()

    # -- hooks ---------------------------------------------------------------------------------
    def _hook(self, hook: commands.StartHook, then: Callable[[Any], None], arg: Any) -> None:
        """Run `hook` inline through the addon manager; if a handler must wait, finish it in a
        task; then call `then(arg)` (only while the connection is open)."""
        data = hook.args()[0]
        rest = self.addons.run_inline(hook)
        if rest is None and not (isinstance(data, flow.Flow) and data.intercepted):
            then(arg)
            return

        async def finish() -> None:
            if rest is not None:
                await rest
            if isinstance(data, flow.Flow):
                await data.wait_for_resume()
            if not self.closed:
                then(arg)
        self._spawn(finish())

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("plain-HTTP connection task failed; closing the connection",
                         exc_info=task.exception())
            self.close("error")

    # -- server connections --------------------------------------------------------------------
    async def _open(self, command: commands.OpenConnection) -> None:
        server = command.connection
        if not isinstance(server, Server) or server.address is None:
            self.event(events.OpenConnectionCompleted(command, "no destination"))
            return
        data = server_hooks.ServerConnectionHookData(client=self.client, server=server)
        rest = self.addons.run_inline(server_hooks.ServerConnectHook(data))
        if rest is not None:
            await rest
        if server.error:
            self._run_hook_quietly(server_hooks.ServerConnectErrorHook(data))
            self.event(events.OpenConnectionCompleted(command, f"Connection killed: {server.error}"))
            return
        server.timestamp_start = time.time()
        side = _ServerSide(self, server)
        try:
            await self.loop.create_connection(lambda: side, server.address[0], server.address[1])
        except OSError as exc:
            server.error = str(exc) or type(exc).__name__
            self._run_hook_quietly(server_hooks.ServerConnectErrorHook(data))
            self.event(events.OpenConnectionCompleted(command, server.error))
            return
        if self.closed or side.transport is None:
            if side.transport is not None:
                side.transport.close()
            return
        if side.transport.is_closing():  # gone again before it could be used
            self.event(events.OpenConnectionCompleted(command, "the site closed the connection"))
            return
        server.timestamp_tcp_setup = time.time()
        server.state = ConnectionState.OPEN
        server.peername = side.transport.get_extra_info("peername")
        server.sockname = side.transport.get_extra_info("sockname")
        self.servers[server] = side
        self._run_hook_quietly(server_hooks.ServerConnectedHook(data))
        self.event(events.OpenConnectionCompleted(command, None))

    def _run_hook_quietly(self, hook: commands.StartHook) -> None:
        """A hook whose completion the layer does not wait for."""
        rest = self.addons.run_inline(hook)
        if rest is not None:
            self._spawn(rest)

    # -- the sockets' ends ---------------------------------------------------------------------
    def peer_closed(self, conn: connection.Connection) -> None:
        """The peer sent EOF: that connection can no longer be read."""
        conn.state &= ~ConnectionState.CAN_READ
        self.event(events.ConnectionClosed(conn))

    def lost(self, conn: connection.Connection) -> None:
        if conn is self.client:
            self.close("client gone")
            return
        side = self.servers.pop(conn, None)  # type: ignore[call-overload]  # a Server here
        if side is None:
            return
        was_readable = conn.state & ConnectionState.CAN_READ
        conn.state = ConnectionState.CLOSED
        conn.timestamp_end = time.time()
        if was_readable and not self.closed:
            self.event(events.ConnectionClosed(conn))
        self._run_hook_quietly(server_hooks.ServerDisconnectedHook(
            server_hooks.ServerConnectionHookData(client=self.client, server=conn)))  # type: ignore[arg-type]

    @staticmethod
    def pause_reading(transport: asyncio.BaseTransport | None) -> None:
        if isinstance(transport, asyncio.ReadTransport) and not transport.is_closing() \
                and transport.is_reading():
            transport.pause_reading()

    @staticmethod
    def resume_reading(transport: asyncio.BaseTransport | None) -> None:
        if isinstance(transport, asyncio.ReadTransport) and not transport.is_closing() \
                and not transport.is_reading():
            transport.resume_reading()

    def _idle_check(self) -> None:
        if self.closed:
            return
        idle = self.loop.time() - self.last_event
        if idle >= IDLE_TIMEOUT and not self.tasks:
            logger.info("closed a plain-HTTP connection idle for %.0f s", idle)
            self.close("idle")
            return
        self.watchdog = self.loop.call_later(max(1.0, IDLE_TIMEOUT - idle), self._idle_check)

    def close(self, reason: str) -> None:
        """The one way out (see the module docstring). `reason` goes to the debug log only."""
        if self.closed:
            return
        self.closed = True
        logger.debug("plain-HTTP connection closed: %s", reason)
        self.watchdog.cancel()
        for task in list(self.tasks):
            task.cancel()
        for server, side in list(self.servers.items()):
            server.state = ConnectionState.CLOSED
            if side.transport is not None:
                side.transport.close()
        self.client.state = ConnectionState.CLOSED
        self.transport.close()
        self.client.timestamp_end = time.time()
        rest = self.addons.run_inline(server_hooks.ClientDisconnectedHook(self.client))
        if rest is not None:
            self.loop.create_task(rest)
        self.on_close(self)
