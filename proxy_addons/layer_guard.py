"""LayerGuard addon: chooses every protocol layer itself, so TLS is never intercepted.

mitmproxy asks the `next_layer` hook what protocol comes next. The guard answers:

1. A new client connection (regular proxy mode): an HTTP/1 proxy layer with a bounded
   request head (`BoundedHttpLayer`). A client that starts with TLS (a "secure web proxy"
   client) is closed: the guard speaks plain HTTP to its clients only.
2. Inside an allowed CONNECT tunnel, from the client's first bytes:
   - a TLS ClientHello: its SNI, when present, must equal the CONNECT host after
     normalisation; then the tunnel becomes raw TCP passthrough (no CA, no decryption;
     HTTP/2 and WebSocket inside simply flow). A mismatch is a `sni_mismatch` denial: the
     decision is logged and the connection is closed before any server connection is opened.
   - plain HTTP (e.g. `ws://` tunnelled by a browser): its Host header must name the CONNECT
     host (`host_header_mismatch` otherwise), then raw passthrough.
   - anything else: raw passthrough to the checked address.
3. Anything else (e.g. an HTTP upgrade on a plain proxied request): closed.

The SNI is judged here rather than in `tls_clienthello` because no TLS layer is ever built:
mitmproxy's TLS layers would need a certificate authority to intercept, and the guard has none
(the TlsConfig addon is not loaded), so a TLS layer could only fail.
"""
from __future__ import annotations

import logging
import re

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers import TCPLayer
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import parse_client_hello

import policy

from .layers import BoundedHttpLayer, CloseLayer
from .state import GuardState

logger = logging.getLogger("sfguard.proxy.layers")

#: Most bytes waited for before a tunnel's first message (ClientHello / request head) is judged.
MAX_FIRST_MESSAGE = 64 * 1024
_HTTP_METHOD = re.compile(rb"^[A-Z]{3,10} ")
_HTTP_REQUEST_LINE = re.compile(rb"^[A-Z]{3,10} [^ \r\n]+ HTTP/1\.[01]\r?\n")
_HOST_LINE = re.compile(rb"\r\nhost:[ \t]*([^\r\n]*?)[ \t]*\r\n", re.IGNORECASE)


class LayerGuard:
    # It takes the place of mitmproxy's NextLayer addon (and keeps mitmproxy from warning
    # that no "nextlayer" addon is loaded).
    name = "nextlayer"

    def __init__(self, state: GuardState) -> None:
        self.s = state

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        if nextlayer.layer is not None:
            return
        context = nextlayer.context
        data = nextlayer.data_client()
        if context.server.address is None and len(context.layers) == 1 \
                and isinstance(context.layers[0], modes.HttpProxy):
            if not data:
                return  # wait for the first bytes
            if data[:1] == b"\x16":
                logger.info("closed a client that spoke TLS to the proxy port")
                nextlayer.layer = CloseLayer(context)
            else:
                nextlayer.layer = BoundedHttpLayer(context, HTTPMode.regular, self.s.max_head_bytes)
            return

        conn = self.s.conns.get(context.client.id)
        if conn is None or conn.tunnel is None or context.server.address is None \
                or conn.tunnel != self._key(context.server.address):
            logger.info("closed a connection with no checked tunnel")
            nextlayer.layer = CloseLayer(context)
            return
        if not data:
            return
        host, port = conn.tunnel
        target = conn.targets[conn.tunnel]
        if starts_like_tls_record(data):
            try:
                hello = parse_client_hello(data)
            except ValueError:
                hello = None
                named, ok = "an unreadable ClientHello", False
            else:
                if hello is None:
                    if len(data) > MAX_FIRST_MESSAGE:
                        nextlayer.layer = CloseLayer(context)
                    return  # wait for the rest of the ClientHello
                if hello.sni is None:
                    named, ok = "", True
                else:
                    named, ok = hello.sni, self._same_host(hello.sni, host)
            if not ok:
                if not self._refuse(conn, target, "sni_mismatch",
                                    f"The guard closed a tunnel to {host}:{port}: its TLS "
                                    f"ClientHello names a different server "
                                    f"({self._shown(named)})."):
                    nextlayer.layer = CloseLayer(context)
                    return
        elif _HTTP_METHOD.match(data) and (b"\n" not in data or _HTTP_REQUEST_LINE.match(data)):
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_FIRST_MESSAGE:
                    nextlayer.layer = CloseLayer(context)
                return  # wait for the whole request line and head
            m = _HOST_LINE.search(data[: end + 2])
            if m is not None:
                value = m.group(1).decode("latin-1")
                try:
                    same = policy.split_host_port(value, default_port=port) == (host, port)
                except policy.MalformedHost:
                    same = False
                if not same and not self._refuse(
                        conn, target, "host_header_mismatch",
                        f"The guard closed a tunnel to {host}:{port}: the request inside "
                        f"names a different host ({self._shown(value)})."):
                    nextlayer.layer = CloseLayer(context)
                    return
        conn.head_done = True  # the head-read timeout no longer applies
        nextlayer.layer = TCPLayer(context, ignore=True)

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _key(address) -> tuple[str, int] | None:
        try:
            return policy.normalize_host(str(address[0])), int(address[1])
        except policy.MalformedHost:
            return None

    @staticmethod
    def _same_host(sni: str, host: str) -> bool:
        try:
            return policy.normalize_host(sni) == host
        except policy.MalformedHost:
            return False

    @staticmethod
    def _shown(text: str) -> str:
        return text[:100].encode("ascii", "backslashreplace").decode("ascii")

    def _refuse(self, conn, target, reason: str, explanation: str) -> bool:
        """Ask policy to refuse; log it; True when the result still allows (report mode)."""
        d = self.s.policy.refuse(target.decision, reason, explanation)
        self.s.log_decision(d, client=conn.client, method="TLS" if reason == "sni_mismatch" else "TUNNEL",
                            addr=target.address)
        return d.allowed
