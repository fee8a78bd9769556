"""Two small mitmproxy layers the guard uses (protocol plumbing, no policy).

- `BoundedHttpLayer`: mitmproxy's HTTP layer with a bound on the size of a request head
  (request line plus headers). mitmproxy itself buffers a head until it is complete, with no
  limit; over-long header lines or thousands of headers would grow memory without end. Over
  the bound the client gets `431` and the connection is closed.
- `CloseLayer`: closes the client connection at once (used to kill a connection, e.g. a TLS
  ClientHello whose SNI does not match the CONNECT host). Nothing reaches any server.
"""
from __future__ import annotations

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import HttpLayer
from mitmproxy.proxy.layers.http._http1 import Http1Server

_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\nConnection: close\r\nContent-Length: 49\r\n\r\n"
    b"sfguard: request head too large, connection shut\n"
)


class BoundedHttpLayer(HttpLayer):
    """HttpLayer that refuses request heads larger than `max_head_bytes`."""

    def __init__(self, context, mode, max_head_bytes: int) -> None:
        super().__init__(context, mode)
        self.max_head_bytes = max_head_bytes
        self._refused = False

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self._refused:
            return
        if isinstance(event, events.DataReceived) and event.connection is self.context.client:
            conn = self.connections.get(self.context.client)
            if (isinstance(conn, Http1Server) and conn.state == conn.read_headers
                    and len(conn.buf) + len(event.data) > self.max_head_bytes):
                self._refused = True
                yield commands.SendData(self.context.client, _HEAD_TOO_LARGE)
                yield commands.CloseConnection(self.context.client)
                return
        yield from super()._handle_event(event)


class CloseLayer(layer.Layer):
    """Closes the client connection and ignores everything after."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)
