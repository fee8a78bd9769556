"""`TunnelHttpLayer`: every HTTP/1 request inside a plain-HTTP CONNECT tunnel judged.

A tunnel whose first message is an HTTP/1 request (a browser's `ws://` through CONNECT, or a
stage's shell speaking HTTP through the tunnel) is plain text: every request in it can be read,
so every request is judged, not only the first (a later request could name any Host or target,
and a server that routes by them would serve another host). `judge_request` is the one judge,
used by LayerGuard for the first message and by this layer for every request after it; it is
request_head's check of a plain proxied request, for the tunnel's host:

    the head's framing (lone CR, bare LF, obs-fold, NUL), mitmproxy's parser and smuggling checks
    (`validate_headers`, `expected_http_body_size`), exactly one Host on HTTP/1.1 naming the
    tunnel's host and port, an absolute-form target naming them too, no CONNECT, and no
    `Upgrade` other than `websocket`, on the tunnel's first request only.

Each request goes to the server re-assembled (mitmproxy's `assemble_request_head`) with its body
re-framed as it arrives (plain_http's h11 readers), so the server reads exactly what was judged.
The server's bytes are relayed as they come. After the first request asked for a WebSocket
upgrade, the client's next bytes wait for the server's status line: `101` makes the tunnel raw
passthrough both ways (WebSocket frames); any other answer keeps every later request judged.
A refusal is answered `400` with `X-Sfguard-Decision: deny; reason=CODE`, logged through
`refuse(code, explanation)` and both connections are closed.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import h11
from h11._readers import ChunkedReader
from h11._receivebuffer import ReceiveBuffer
from mitmproxy import http
from mitmproxy.net.http import http1
from mitmproxy.net.http.validate import validate_headers
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context

from sfguard import policy
from sfguard.proxy_addons.plain_http import MAX_AHEAD, BodyReader, _move_body, _reader
from sfguard.proxy_addons.request_head import EXPLAIN, head_fault, host_fault, read_request_head, refusal_answer

#: Most bytes of a server's first line awaited after an upgrade request.
MAX_STATUS_LINE = 8 * 1024
_SWITCHED = re.compile(rb"HTTP/1\.[01] 101[ \r]")

#: (reason code, explanation) of a refused request, or None.
Refusal = tuple[str, str]


def judge_request(lines: list[bytes], taken: int, host: str, port: int,
                  first: bool) -> tuple[Refusal | None, http.Request | None, int | None]:
    """Judge one request head inside a tunnel to (normalised `host`, `port`): `lines` and
    `taken` as request_head.head_fault takes them. Returns (refusal, None, 0) or (None, the
    parsed request, its body size as `expected_http_body_size` gives it: None for chunks)."""
    where = policy.join_host_port(host, port)

    def refused(code: str, why: str) -> tuple[Refusal, None, int]:
        return (code, f"The guard refused a request inside the tunnel to {where}: {why}."), None, 0

    code = head_fault(lines, taken)
    if code is not None:
        return refused(code, EXPLAIN[code])
    try:
        request = read_request_head(lines)
        validate_headers(request)
        size = http1.expected_http_body_size(request)
    except ValueError as exc:
        return refused("request_malformed", f"malformed request ({exc})")
    if size == -1:
        return refused("request_malformed", "a request body must have a length")
    if request.method.upper() == "CONNECT":
        return refused("tunnel_protocol_refused", "a CONNECT inside a tunnel")
    hosts = [v.decode("utf-8", "surrogateescape") for k, v in request.headers.fields if k.lower() == b"host"]
    code = host_fault(hosts, request.http_version, host, port, port)
    if code is None and request.authority:  # absolute form: its authority must name the tunnel
        try:
            same = (policy.normalize_host(request.host), request.port) == (host, port)
        except policy.MalformedHost:
            same = False
        if not same:
            code = "host_header_mismatch"
    if code is not None:
        return refused(code, EXPLAIN[code])
    upgrade = request.headers.get("upgrade")
    if upgrade is not None and (not first or upgrade.strip().lower() != "websocket"):
        return refused("tunnel_upgrade_refused",
                       "only the first request of a tunnel may ask for a WebSocket upgrade")
    return None, request, size


class TunnelHttpLayer(layer.Layer):
    """Relays a plain-HTTP tunnel, judging every request (see the module docstring)."""

    def __init__(self, context: Context, host: str, port: int, max_head_bytes: int,
                 max_header_count: int, refuse: Callable[[str, str], None]) -> None:
        super().__init__(context)
        self.host, self.port = host, port
        self.max_head_bytes = max_head_bytes
        self.max_lines = max_header_count + 2
        self.refuse = refuse
        self.cbuf = ReceiveBuffer()
        self.reader: BodyReader | None = None  # the current request's body, until complete
        self.requests = 0
        self.upgrading = False   # the first request asked to upgrade: wait for the status line
        self.status = b""        # the server's first bytes while upgrading
        self.raw = False         # upgraded (101): bytes pass as they are
        self.closed = False

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.closed:
            return
        client, server = self.context.client, self.context.server
        if isinstance(event, events.Start):
            if not server.connected:
                err = yield commands.OpenConnection(server)  # AddressGuard checks the address
                if err:
                    yield from self._close()
            return
        if isinstance(event, events.DataReceived):
            if event.connection is client:
                if self.raw:
                    yield commands.SendData(server, event.data)
                else:
                    self.cbuf += event.data
                    yield from self._client_data()
            elif event.connection is server:
                yield commands.SendData(client, event.data)
                if self.upgrading:
                    yield from self._status(event.data)
        elif isinstance(event, events.ConnectionClosed):
            yield from self._close()

    def _status(self, data: bytes) -> layer.CommandGenerator[None]:
        self.status += data
        if b"\n" not in self.status and len(self.status) < MAX_STATUS_LINE:
            return
        self.upgrading = False
        if _SWITCHED.match(self.status):
            self.raw = True
            rest = bytes(self.cbuf)
            self.cbuf = ReceiveBuffer()
            if rest:
                yield commands.SendData(self.context.server, rest)
        else:
            yield from self._client_data()

    def _client_data(self) -> layer.CommandGenerator[None]:
        while not self.closed and not self.raw:
            if self.upgrading:
                if len(self.cbuf) > MAX_AHEAD:
                    yield from self._close()
                return
            if self.reader is not None:
                out: list[bytes] = []
                try:
                    done = _move_body(self.reader, self.cbuf, isinstance(self.reader, ChunkedReader), out)
                except h11.ProtocolError as exc:
                    yield from self._refused(("request_malformed",
                                              f"The guard refused a request body inside the tunnel "
                                              f"to {policy.join_host_port(self.host, self.port)}: {exc}."))
                    return
                if out:
                    yield commands.SendData(self.context.server, b"".join(out))
                if not done:
                    return
                self.reader = None
                continue
            before = len(self.cbuf)
            lines = self.cbuf.maybe_extract_lines()
            if lines is None:
                if len(self.cbuf) > self.max_head_bytes:
                    yield from self._refused(("request_head_too_large", "The guard refused a request "
                                              "head inside a tunnel: it is over the size limit."))
                return
            taken = before - len(self.cbuf)
            if taken > self.max_head_bytes or len(lines) + 1 > self.max_lines:
                yield from self._refused(("request_head_too_large", "The guard refused a request "
                                          "head inside a tunnel: it is over the limits."))
                return
            if not lines:
                if taken != 2:
                    yield from self._refused(("head_bare_lf", EXPLAIN["head_bare_lf"]))
                    return
                continue  # an empty line between requests (RFC 9112 2.2)
            refusal, request, size = judge_request([bytes(x) for x in lines], taken, self.host,
                                                   self.port, first=self.requests == 0)
            if refusal is not None or request is None:
                yield from self._refused(refusal or ("request_malformed", "malformed request"))
                return
            self.requests += 1
            yield commands.SendData(self.context.server, http1.assemble_request_head(request))
            if size != 0:  # None: chunked
                self.reader = _reader(size)
            if "upgrade" in request.headers:
                self.upgrading = True

    def _refused(self, refusal: Refusal) -> layer.CommandGenerator[None]:
        code, explanation = refusal
        self.refuse(code, explanation)
        yield commands.SendData(self.context.client, refusal_answer(code, explanation))
        yield from self._close()

    def _close(self) -> layer.CommandGenerator[None]:
        if self.closed:
            return
        self.closed = True
        for conn in (self.context.server, self.context.client):
            if conn.connected:
                yield commands.CloseConnection(conn)
