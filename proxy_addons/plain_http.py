"""`PlainHttpLayer`: the guard's layer for plain-HTTP proxy connections (protocol plumbing).

A client connection whose first request is not a CONNECT (`GET http://host/ HTTP/1.1`, the
way browsers send http:// URLs to a proxy) is served by this one flat layer instead of
mitmproxy's HTTP layer stack (HttpLayer, HttpStream, Http1Server, Http1Client, an asyncio task
per hook and a pass of each hook's completion through the stack). Measured, that machinery was
most of the run proxy's CPU per plain request (docs/proxy.md, Performance). The decision is
not made here: each request raises mitmproxy's `requestheaders` hook with an `HTTPFlow`, so
`ConnectGuard.requestheaders` authenticates, decides, checks addresses and logs exactly as
before, and `AddressGuard.server_connect` still refuses any unchecked destination. Parsing and
framing are mitmproxy's and h11's (`http1.read_request_head` / `read_response_head`,
`expected_http_body_size`, `validate_headers`, h11's body readers), the same code its own HTTP/1
layers use (the request head through request_head.py, which remembers mitmproxy's checks of an
authority); this layer only sequences them:

    read a request head (bounded: bytes and header lines, 431 and a decision-log line over it;
      a lone CR, a bare LF, obs-fold or NUL in it: 400 and a decision-log line, request_head.py)
      -> parse and validate (400 and closed if malformed: smuggling checks included)
      -> requestheaders hook (the guard decides; a denial's answer is sent and the connection
         closed; nothing reached any server)
      -> the request, in origin form, to the checked address (a server connection per address,
         reused while both sides keep the connection alive), its body re-framed as it arrives
      -> the response head (bounded; validated), then its body, relayed as it arrives
      -> the next request (requests are served one at a time, in order).

A response `101 Switching Protocols` closes both connections (browsers tunnel WebSockets
with CONNECT; the guard relays no upgraded plain connection). A CONNECT after plain requests
on the same connection is refused (400, closed): a tunnel starts on a connection of its own.
"""
from __future__ import annotations

from collections.abc import Callable

import h11
from h11._readers import ChunkedReader, ContentLengthReader, Http10Reader
from h11._receivebuffer import ReceiveBuffer
from mitmproxy import hooks, http
from mitmproxy.connection import Address, ConnectionState, Server
from mitmproxy.net.http import http1, url
from mitmproxy.net.http.validate import validate_headers
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook

from sfguard.proxy_addons.dispatch import Rest, SfguardRestHook
from sfguard.proxy_addons.layers import HEAD_TOO_LARGE
from sfguard.proxy_addons.request_head import head_fault, read_request_head, refusal_answer

#: Largest response head relayed (a server sending more is cut off: 502).
MAX_RESPONSE_HEAD = 256 * 1024
#: Most bytes a client may send ahead while its previous request is still being answered.
MAX_AHEAD = 1024 * 1024
#: Idle server connections kept per client connection for reuse.
MAX_IDLE_SERVERS = 4

BodyReader = ChunkedReader | ContentLengthReader | Http10Reader


def _reader(size: int | None) -> BodyReader:
    if size is None:
        return ChunkedReader()
    if size == -1:
        return Http10Reader()
    return ContentLengthReader(size)


def _move_body(reader: BodyReader, buf: ReceiveBuffer, chunked: bool, out: list[bytes],
               eof: bool = False) -> bool:
    """Move the part of a body that `buf` holds to `out`, framed afresh (chunks rewritten:
    extensions and trailers are not forwarded). True once the body is complete; `eof`: the
    sender closed. Raises h11.ProtocolError for a malformed or truncated body."""
    while True:
        ev = reader.read_eof() if eof and not buf else reader(buf)
        if ev is None:
            return False
        if isinstance(ev, h11.Data):
            if ev.data:
                out.append(b"%x\r\n%s\r\n" % (len(ev.data), bytes(ev.data)) if chunked else bytes(ev.data))
        else:  # EndOfMessage
            if chunked:
                out.append(b"0\r\n\r\n")
            return True


def _answer(status: int, reason: str, text: str) -> bytes:
    """A small plain-text answer of the guard's own, ending the connection."""
    body = ("sfguard: " + text.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "replace")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class PlainHttpLayer(layer.Layer):
    """Serves a plain-HTTP proxy connection (see the module docstring)."""

    def __init__(self, context: Context, max_head_bytes: int, max_header_count: int,
                 on_refuse: Callable[[str], None] | None = None,
                 run_hook: Callable[[hooks.Hook], Rest | None] | None = None) -> None:
        super().__init__(context)
        self.run_hook = run_hook  # dispatch.CachedAddonManager.run_inline, if the master has it
        self.max_head_bytes = max_head_bytes
        self.max_lines = max_header_count + 2  # the request line and the empty line end a head
        self.on_refuse = on_refuse
        self.cbuf = ReceiveBuffer()        # from the client, not yet consumed
        self.sbuf = ReceiveBuffer()        # from the current server, not yet consumed
        self.closed = False
        self.lines = 0                     # line ends in `cbuf` (counted as bytes arrive)
        # the request being served (None between requests)
        self.flow: http.HTTPFlow | None = None
        self.request_reader: BodyReader | None = None   # None: the request body is complete
        self.server: Server | None = None
        self.response: http.Response | None = None
        self.response_size: int | None = 0
        self.response_reader: BodyReader | None = None  # None: no response head yet
        self.idle: dict[Address, Server] = {}

    # -- events -------------------------------------------------------------------------------
    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.closed or isinstance(event, events.Start):
            return
        if isinstance(event, events.DataReceived):
            if event.connection is self.context.client:
                self.cbuf += event.data
                self.lines += event.data.count(b"\n")
                yield from self._client_data()
            elif event.connection is self.server:
                self.sbuf += event.data
                yield from self._server_data(eof=False)
            else:  # an idle server spoke out of turn: drop it
                yield from self._drop_idle(event.connection)
        elif isinstance(event, events.ConnectionClosed):
            if event.connection is self.context.client:
                yield from self._close()
            elif event.connection is self.server:
                yield from self._server_data(eof=True)
            else:
                yield from self._drop_idle(event.connection)

    # -- the client's side ----------------------------------------------------------------------
    def _client_data(self) -> layer.CommandGenerator[None]:
        while not self.closed:
            if self.flow is None:
                before = len(self.cbuf)
                lines = self.cbuf.maybe_extract_lines()
                if lines is None:  # bounded as it arrives: a trickled head costs linear time
                    if len(self.cbuf) > self.max_head_bytes:
                        yield from self._head_refused("request_head_too_large")
                    elif self.lines > self.max_lines:
                        yield from self._head_refused("too_many_headers")
                    return
                taken = before - len(self.cbuf)
                head = [bytes(x) for x in lines]
                if sum(len(x) + 2 for x in head) + 2 > self.max_head_bytes:  # with the CRLFs
                    yield from self._head_refused("request_head_too_large")
                    return
                if len(head) + 1 > self.max_lines:
                    yield from self._head_refused("too_many_headers")
                    return
                if not head:  # an empty line before a request line (RFC 9112 2.2: skipped)
                    if taken != 2:
                        yield from self._head_refused("head_bare_lf")
                        return
                    continue
                fault = head_fault(head, taken)  # lone CR, bare LF, obs-fold, NUL: 400
                if fault is not None:
                    yield from self._head_refused(fault)
                    return
                yield from self._start_request(head)
            elif self.request_reader is not None:
                yield from self._request_body()
                if self.request_reader is not None:
                    return  # wait for more of the body
            else:
                if len(self.cbuf) > MAX_AHEAD:
                    yield from self._close()
                return  # the next request waits until this one is answered

    def _start_request(self, head: list[bytes]) -> layer.CommandGenerator[None]:
        client = self.context.client
        try:
            request = read_request_head(head)
            if request.method.upper() == "CONNECT":
                raise ValueError("a CONNECT must be the first request on its connection")
            if request.scheme not in ("http", "https", ""):
                raise ValueError(f"invalid request scheme {request.scheme!r}")
            validate_headers(request)  # mitmproxy's request-smuggling checks
            if not request.host:  # origin form: the Host header names the destination
                host, port = url.parse_authority(request.host_header or "", check=True)
                request.data.host, request.data.port = host, port or 80
                request.scheme = "http"
            size = http1.expected_http_body_size(request)
        except ValueError as exc:
            yield from self._fail(400, "Bad Request", f"malformed request: {exc}")
            return
        if size == -1:  # a request's body can't be read until the end of the connection
            yield from self._fail(400, "Bad Request", "malformed request: unframed body")
            return
        flow = http.HTTPFlow(client, self.context.server)
        flow.request = request
        flow.live = True
        request.authority = ""  # origin form towards the server
        self.flow = flow
        # ConnectGuard: credentials, decision, addresses, log. Run at once where the addon manager
        # can (dispatch.run_inline); a hook that must wait (DNS) is finished as a task.
        if self.run_hook is None:
            yield HttpRequestHeadersHook(flow)
        else:
            rest = self.run_hook(HttpRequestHeadersHook(flow))
            if rest is not None:
                yield SfguardRestHook(rest)
        if flow.error is not None:          # killed (e.g. the proxy is still starting)
            yield from self._close()
            return
        if flow.response is not None:       # the guard answered (denial, credentials, 400)
            yield commands.SendData(client, http1.assemble_response(flow.response))
            if size != 0 or http1.connection_close(flow.response.http_version, flow.response.headers) \
                    or http1.connection_close(request.http_version, request.headers):
                yield from self._close()
            else:
                self._next_request()
            return
        if size != 0 and request.headers.get("expect", "").lower() == "100-continue":
            request.headers.pop("expect")
            yield commands.SendData(client, b"HTTP/1.1 100 Continue\r\n\r\n")
        address = (request.data.host, request.port)
        server = self.idle.pop(address, None)
        if server is None or not (server.state & ConnectionState.CAN_WRITE):
            server = Server(address=address)
            err = yield commands.OpenConnection(server)  # AddressGuard checks the address
            if err:
                yield from self._fail(502, "Bad Gateway", f"cannot connect to the site: {err}")
                return
        self.server = server
        self.sbuf = ReceiveBuffer()
        self.response, self.response_reader = None, None
        yield commands.SendData(server, http1.assemble_request_head(request))
        self.request_reader = _reader(size) if size != 0 else None

    def _request_body(self) -> layer.CommandGenerator[None]:
        if self.flow is None or self.server is None or self.request_reader is None:
            raise RuntimeError("a request body without its request")
        out: list[bytes] = []
        try:
            if _move_body(self.request_reader, self.cbuf, isinstance(self.request_reader, ChunkedReader), out):
                self.request_reader = None
        except h11.ProtocolError as exc:
            yield from self._fail(400, "Bad Request", f"malformed request body: {exc}")
            return
        if out and self.server.state & ConnectionState.CAN_WRITE:
            yield commands.SendData(self.server, b"".join(out))

    # -- the server's side ----------------------------------------------------------------------
    def _server_data(self, eof: bool) -> layer.CommandGenerator[None]:
        flow, server, client = self.flow, self.server, self.context.client
        if flow is None or server is None:
            if server is not None:
                yield from self._drop_server(server)
            return
        out: list[bytes] = []
        while self.response_reader is None:  # the response head (after any 1xx heads)
            lines = self.sbuf.maybe_extract_lines()
            if lines is None:
                if eof or len(self.sbuf) > MAX_RESPONSE_HEAD:
                    yield from self._send(out)
                    why = "the site closed the connection" if eof else "the site's response head is too large"
                    yield from self._fail(502, "Bad Gateway", why, started=bool(out))
                return
            head = [bytes(x) for x in lines]
            if sum(len(x) + 2 for x in head) > MAX_RESPONSE_HEAD:
                yield from self._send(out)
                yield from self._fail(502, "Bad Gateway", "the site's response head is too large",
                                      started=bool(out))
                return
            try:
                response = http1.read_response_head(head)
                validate_headers(response)
                size = http1.expected_http_body_size(flow.request, response)
            except ValueError as exc:
                yield from self._send(out)
                yield from self._fail(502, "Bad Gateway", f"malformed response from the site: {exc}",
                                      started=bool(out))
                return
            if response.status_code == 101:
                # an upgraded plain connection is never relayed (browsers tunnel WebSockets)
                yield from self._close()
                return
            out.append(http1.assemble_response_head(response))
            if 100 <= response.status_code < 200:
                continue  # an interim answer (100 Continue, 103): the real one follows
            self.response, self.response_size = response, size
            self.response_reader = _reader(size)
        answer = self.response
        if answer is None:
            raise RuntimeError("a response body without its head")
        try:  # chunked: framed in chunks (never for HEAD, 204, 304)
            done = _move_body(self.response_reader, self.sbuf, self.response_size is None, out, eof)
        except h11.ProtocolError:
            yield from self._send(out)
            yield from self._close()  # a truncated or malformed body: the client sees the cut
            return
        yield from self._send(out)
        if not done:
            if eof:
                yield from self._close()
            return
        # The exchange is complete: keep both connections for the next request when we can.
        request = flow.request
        keep = not (self.response_size == -1 or eof or self.request_reader is not None
                    or http1.connection_close(request.http_version, request.headers)
                    or http1.connection_close(answer.http_version, answer.headers))
        if not keep:
            yield from self._close()
            return
        self._next_request()
        if self.sbuf:  # the server sent more than its response: don't trust it again
            yield from self._drop_server(server)
        elif server.address is not None:
            old = self.idle.pop(server.address, None)
            if old is not None:
                yield from self._drop_server(old)
            self.idle[server.address] = server
            while len(self.idle) > MAX_IDLE_SERVERS:
                yield from self._drop_server(self.idle.pop(next(iter(self.idle))))
        if self.cbuf and client.state & ConnectionState.CAN_READ:
            yield from self._client_data()

    # -- helpers --------------------------------------------------------------------------------
    def _next_request(self) -> None:
        """The exchange is over: what the client sent ahead starts the next request head."""
        self.flow, self.server, self.response, self.response_reader = None, None, None, None
        self.lines = bytes(self.cbuf).count(b"\n") if self.cbuf else 0

    def _send(self, out: list[bytes]) -> layer.CommandGenerator[None]:
        if out and self.context.client.state & ConnectionState.CAN_WRITE:
            yield commands.SendData(self.context.client, b"".join(out))
        out.clear()

    def _head_refused(self, reason: str) -> layer.CommandGenerator[None]:
        """A head over the limits (431) or malformed (400, request_head.head_fault): answered,
        logged (`on_refuse`), closed."""
        if self.on_refuse is not None:
            self.on_refuse(reason)
        answer = HEAD_TOO_LARGE if reason in ("request_head_too_large", "too_many_headers") \
            else refusal_answer(reason)
        yield commands.SendData(self.context.client, answer)
        yield from self._close()

    def _fail(self, status: int, reason: str, text: str, started: bool = False) -> layer.CommandGenerator[None]:
        """Answer with an error of the guard's own (unless a response was already begun) and
        close."""
        if not started and self.response is None and self.context.client.state & ConnectionState.CAN_WRITE:
            yield commands.SendData(self.context.client, _answer(status, reason, text))
        yield from self._close()

    def _drop_server(self, server: Server) -> layer.CommandGenerator[None]:
        if server.state is not ConnectionState.CLOSED:
            yield commands.CloseConnection(server)

    def _drop_idle(self, connection: object) -> layer.CommandGenerator[None]:
        for address, server in list(self.idle.items()):
            if server is connection:
                del self.idle[address]
                yield from self._drop_server(server)

    def _close(self) -> layer.CommandGenerator[None]:
        """The one way out: every server connection and the client connection closed."""
        if self.closed:
            return
        self.closed = True
        servers = list(self.idle.values()) + ([self.server] if self.server is not None else [])
        self.idle.clear()
        for server in servers:
            yield from self._drop_server(server)
        if self.context.client.state is not ConnectionState.CLOSED:
            yield commands.CloseConnection(self.context.client)
