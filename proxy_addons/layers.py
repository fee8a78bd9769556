"""Two small mitmproxy layers the guard uses (protocol plumbing, no policy).

- `BoundedHttpLayer`: mitmproxy's HTTP layer for a connection that starts with CONNECT, with
  bounds on the request head: its size in bytes and its number of lines. mitmproxy itself
  buffers a head until it is complete, with no limit; over-long header lines or thousands of
  headers would grow memory and parsing time without end. Over a bound the client gets `431`,
  the connection is closed and `on_refuse(reason)` is called (the guard writes a decision-log
  line). Lines are counted as they arrive, so a head trickled byte by byte costs linear time.
  A complete head is checked for a lone CR, a bare LF, obs-fold and NUL
  (request_head.raw_head_fault): `400` with the decision header, `on_refuse(reason)`, closed.
  It also completes hooks that no addon handles (`skip_hook(name)` true, e.g.
  `http_connected`) at once, inside the same event, instead of handing them to the connection
  handler, which runs each hook as an asyncio task and then passes its completion through the
  whole layer stack again, for nothing. Hooks that addons do handle (`http_connect`, the
  tunnel's `next_layer`) are run at once too where the addon manager can (`run_hook`,
  dispatch.run_inline); one that must wait (DNS) is finished by the connection handler
  (`SfguardRestHook`), and that completion is passed on as the hook's own.
  Once the tunnel's first message was judged and its relay (mitmproxy's `TCPLayer`, set as
  `tunnel` by LayerGuard) runs, the tunnel's bytes and closes are handed to that relay
  directly instead of through HttpLayer, Http1Server, HttpStream and NextLayer, which pass
  them on unchanged (measured with callgrind: 19% fewer instructions per relayed MB, 3% per
  tunnel; docs/proxy.md).
  (Plain-HTTP connections are served by `plain_http.PlainHttpLayer`, with the same bounds and
  answer.)
- `CloseLayer`: closes the client connection at once (used to kill a connection, e.g. a TLS
  ClientHello whose SNI does not match the CONNECT host). Nothing reaches any server.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from mitmproxy import hooks
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import HttpLayer, TCPLayer
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.http._http1 import Http1Server

from sfguard.proxy_addons.dispatch import Rest, SfguardRestHook
from sfguard.proxy_addons.request_head import raw_head_fault, refusal_answer

#: The empty line that ends a head, as h11's ReceiveBuffer finds it.
_BLANK_LINE = re.compile(rb"\n\r?\n")
HEAD_BODY = b"sfguard: request head too large (too many bytes or headers), connection shut\n"
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
    b"X-Sfguard-Decision: deny; reason=request_head_too_large\r\n"
    b"Content-Length: " + str(len(HEAD_BODY)).encode() + b"\r\n\r\n" + HEAD_BODY
)


class BoundedHttpLayer(HttpLayer):
    """HttpLayer that refuses request heads over `max_head_bytes` or `max_header_count`
    header lines."""

    def __init__(self, context: Context, mode: HTTPMode, max_head_bytes: int, max_header_count: int = 128,
                 on_refuse: Callable[[str], None] | None = None,
                 skip_hook: Callable[[str], bool] | None = None,
                 run_hook: Callable[[hooks.Hook], Rest | None] | None = None) -> None:
        super().__init__(context, mode)
        self.skip_hook = skip_hook
        self.run_hook = run_hook
        self._rests: dict[SfguardRestHook, commands.StartHook] = {}  # a hook's rest -> the hook
        self.max_head_bytes = max_head_bytes
        self.max_lines = max_header_count + 2  # the request line and the empty line end it
        self.on_refuse = on_refuse
        self._refused = False
        self._lines = 0       # line ends in the connection's buffer (plus the new data)
        self._seen = 0        # buffer length after the last event we counted
        self.tunnel: TCPLayer | None = None  # the judged tunnel's relay (set by LayerGuard)

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self._refused:
            return
        if self.tunnel is not None and self._to_tunnel(self.tunnel, event):
            yield from self.tunnel.handle_event(event)
            return
        if isinstance(event, events.DataReceived) and event.connection is self.context.client:
            conn = self.connections.get(self.context.client)
            if isinstance(conn, Http1Server) and conn.state == conn.read_headers:
                buffered = len(conn.buf)
                if buffered != self._seen:  # a head was taken out since: count afresh
                    self._lines = bytes(conn.buf).count(b"\n") if buffered else 0
                self._lines += event.data.count(b"\n")
                self._seen = buffered + len(event.data)
                reason = None
                if self._seen > self.max_head_bytes:
                    reason = "request_head_too_large"
                elif self._lines > self.max_lines:
                    reason = "too_many_headers"
                else:  # a complete head: request_head's framing checks (lone CR, bare LF, ...)
                    data = bytes(conn.buf) + event.data if buffered else event.data
                    blank = _BLANK_LINE.search(data)
                    if blank is not None:
                        reason = raw_head_fault(data[:blank.end()])
                if reason is not None:
                    self._refused = True
                    if self.on_refuse is not None:
                        self.on_refuse(reason)
                    answer = HEAD_TOO_LARGE if reason in ("request_head_too_large", "too_many_headers") \
                        else refusal_answer(reason)
                    yield commands.SendData(self.context.client, answer)
                    yield commands.CloseConnection(self.context.client)
                    return
        if isinstance(event, events.HookCompleted) and isinstance(event.command, SfguardRestHook):
            hook = self._rests.pop(event.command, None)
            if hook is not None:  # the rest of a hook run inline finished: the hook did
                event = events.HookCompleted(hook)
        if self.skip_hook is None:
            yield from super()._handle_event(event)
            return
        # Hooks nobody handles are completed here, after the event that raised them was
        # processed (as the connection handler would, a moment later); handled ones are run
        # here when they can be. A blocking command arrives with `blocking` set to the layer it
        # pauses; that layer resumes on completion.
        todo = [event]
        while todo:
            for command in super()._handle_event(todo.pop(0)):
                if not (isinstance(command, commands.StartHook) and isinstance(command.blocking, layer.Layer)):
                    yield command
                elif self.skip_hook(command.name):
                    todo.append(events.HookCompleted(command))
                elif self.run_hook is None:
                    yield command
                else:
                    rest = self.run_hook(command)
                    if rest is None:
                        todo.append(events.HookCompleted(command))
                    else:  # finished by the connection handler; its completion comes back here
                        wait = SfguardRestHook(rest)
                        wait.blocking = self
                        self._rests[wait] = command
                        yield wait

    def _to_tunnel(self, tunnel: TCPLayer, event: events.Event) -> bool:
        """True for the bytes and closes of a judged tunnel whose relay runs (its server
        connection open, no command pending): they go to the relay directly. On mitmproxy's way
        they pass HttpLayer, Http1Server's passthrough state, HttpStream's passthrough and a
        NextLayer, which only turn them into HTTP events and back."""
        return (isinstance(event, (events.DataReceived, events.ConnectionClosed))
                and (event.connection is self.context.client or event.connection is tunnel.context.server)
                and tunnel._handle_event == tunnel.relay_messages and not tunnel._paused)


class CloseLayer(layer.Layer):
    """Closes the client connection (after sending `answer`, if given) and ignores everything
    after."""

    def __init__(self, context: Context, answer: bytes | None = None) -> None:
        super().__init__(context)
        self.answer = answer

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            if self.answer:
                yield commands.SendData(self.context.client, self.answer)
            yield commands.CloseConnection(self.context.client)
