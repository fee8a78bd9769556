"""LayerGuard addon: chooses every protocol layer itself, so TLS is never intercepted.

It takes the place of mitmproxy's NextLayer addon: mitmproxy asks its `next_layer` hook what
protocol comes next, and the guard answers:

1. A new client connection (regular proxy mode): a CONNECT gets `layers.BoundedHttpLayer` (the
   request head bounded), any other first request `plain_http.PlainHttpLayer`; a client that
   starts with TLS is closed (the guard speaks plain HTTP to its clients only).
2. Inside an allowed CONNECT tunnel, the client's first message is read whole (at most
   `MAX_FIRST_MESSAGE` bytes, within the head-read timeout) before anything is decided, and
   before the server connection opens. First byte 0x16: the ClientHello
   (`client_hello.read_client_hello`) must name the CONNECT host (`sni_mismatch`, `sni_missing`,
   `tls_hello_invalid`), then raw passthrough. An upper-case letter: the whole first line; an
   HTTP/1 request is judged by `tunnel_http.judge_request` and the tunnel served by
   `tunnel_http.TunnelHttpLayer` (a first line that mentions `HTTP/` but is not a clean request
   line: `tunnel_protocol_refused`; a line that does not mention it passes). Anything else:
   raw passthrough to the checked address.
   Every refusal is logged and closes the connection, in every policy mode.
3. Anything else (e.g. an HTTP upgrade on a plain proxied request): closed.

The rules in full: docs/proxy.md, "What it checks, in order" (5). Why the guard chooses the
layers and judges the SNI here: docs/decisions/0030-proxy-chooses-its-layers.md.
"""
from __future__ import annotations

import enum
import ipaddress
import logging
import re
from collections.abc import Callable
from typing import Final, Literal, TypeAlias

from h11._receivebuffer import ReceiveBuffer
from mitmproxy import addonmanager, hooks
from mitmproxy.connection import Address
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers import TCPLayer, modes
from mitmproxy.proxy.layers.http import HTTPMode

from sfguard import policy
from sfguard.proxy_addons import dispatch
from sfguard.proxy_addons.client_hello import NEED_MORE, BadHello, could_be_tls, read_client_hello
from sfguard.proxy_addons.layers import BoundedHttpLayer, CloseLayer
from sfguard.proxy_addons.plain_http import PlainHttpLayer
from sfguard.proxy_addons.request_head import refusal_answer
from sfguard.proxy_addons.state import ConnState, GuardState, Target
from sfguard.proxy_addons.tunnel_http import TunnelHttpLayer, judge_request

logger = logging.getLogger("sfguard.proxy.layers")

#: Most bytes waited for before a tunnel's first message (ClientHello / request head) is judged.
MAX_FIRST_MESSAGE = 64 * 1024
#: A prefix of an HTTP/1 request line: a method in capitals, then (once there) a space.
_HTTP_REQUEST_LINE = re.compile(rb"^[A-Z]{3,10} [^ \r\n]+ HTTP/1\.[01]\r\n")
#: How a CONNECT request starts; any other first request is served by `PlainHttpLayer`.
_CONNECT = b"CONNECT "
#: The empty line that ends a head, as h11's ReceiveBuffer finds it.
_BLANK_LINE = re.compile(rb"\n\r?\n")


class _Pass(enum.Enum):
    PASS = "pass"
    HTTP = "http"


#: The first message may go through.
_PASS: Final = _Pass.PASS
#: The first message is an HTTP/1 request that passed: every request after it is judged too.
_HTTP: Final = _Pass.HTTP
#: (reason, method, explanation) of a tunnel the guard closes.
Refusal: TypeAlias = tuple[str, str, str]
#: What a judge says of a first message: pass, refuse, or None to wait for more bytes.
Verdict: TypeAlias = Refusal | Literal[_Pass.PASS, _Pass.HTTP] | None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class LayerGuard:
    # It takes the place of mitmproxy's NextLayer addon (and keeps mitmproxy from warning
    # that no "nextlayer" addon is loaded).
    name = "nextlayer"

    def __init__(self, state: GuardState) -> None:
        self.s = state
        self._skip_hook: Callable[[str], bool] | None = None
        self._run_hook: Callable[[hooks.Hook], dispatch.Rest | None] | None = None

    def load(self, loader: addonmanager.Loader) -> None:
        from mitmproxy import ctx
        if isinstance(ctx.master.addons, dispatch.CachedAddonManager):
            self._skip_hook = ctx.master.addons.unhandled
            self._run_hook = ctx.master.addons.run_inline

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        if nextlayer.layer is not None:
            return
        context = nextlayer.context
        data: bytes = nextlayer.data_client()
        if context.server.address is None and len(context.layers) == 1 \
                and isinstance(context.layers[0], modes.HttpProxy):
            if not data:
                return  # wait for the first bytes
            if data[:1] == b"\x16":
                logger.info("closed a client that spoke TLS to the proxy port")
                nextlayer.layer = CloseLayer(context)
            elif not data.startswith(_CONNECT):
                if _CONNECT.startswith(data):
                    return  # maybe a CONNECT: wait for the next bytes (the head timeout bounds it)
                nextlayer.layer = PlainHttpLayer(
                    context, self.s.max_head_bytes, self.s.max_header_count,
                    on_refuse=self._head_refused,
                    run_hook=self._run_hook)
            else:
                nextlayer.layer = BoundedHttpLayer(
                    context, HTTPMode.regular, self.s.max_head_bytes, self.s.max_header_count,
                    on_refuse=self._head_refused, skip_hook=self._skip_hook,
                    run_hook=self._run_hook)
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
        verdict: Verdict
        if could_be_tls(data):
            verdict = self._judge_tls(data, host, port)
        elif data[:1].isupper():
            verdict = self._judge_http(data, host, port)
        else:
            verdict = _PASS  # another protocol (the port was allowed explicitly): raw bytes
        if verdict is None:
            if len(data) > MAX_FIRST_MESSAGE:
                verdict = ("first_message_too_large", "TUNNEL",
                           f"The guard closed a tunnel to {policy.join_host_port(host, port)}: its "
                           f"first message was not complete within {MAX_FIRST_MESSAGE} bytes.")
            else:
                return  # wait for the rest (the head-read timeout bounds the wait)
        if verdict is _HTTP:  # plain text: every request in it is judged (tunnel_http)
            conn.head_done = True

            def refuse(reason: str, explanation: str) -> None:
                self._refuse(conn, target, reason, "TUNNEL", explanation)

            nextlayer.layer = TunnelHttpLayer(context, host, port, self.s.max_head_bytes,
                                              self.s.max_header_count, refuse)
            return
        if verdict is not _PASS:
            reason, method, explanation = verdict
            self._refuse(conn, target, reason, method, explanation)
            answer = None
            if method == "TUNNEL" and reason != "first_message_too_large":  # an HTTP request: 400
                answer = refusal_answer(reason, explanation)
            nextlayer.layer = CloseLayer(context, answer)
            return
        conn.head_done = True  # the head-read timeout no longer applies
        tcp = TCPLayer(context, ignore=True)
        nextlayer.layer = tcp
        for outer in context.layers:  # the CONNECT's HTTP layer hands the relay's events over
            if isinstance(outer, BoundedHttpLayer):
                outer.tunnel = tcp

    def _head_refused(self, reason: str) -> None:
        """A CONNECT or plain-HTTP request head over the limits (answered 431 and closed) or
        malformed (request_head.head_fault: 400). The client is not known yet (its credentials
        are in the refused head)."""
        logger.info("refused a request head (%s)", reason)
        self.s.decision_log.write(run=self.s.run, client=None, method="HTTP", host=None, port=None,
                                  decision="deny", reason=reason, rule=None, addr=None)

    # -- the first message of a tunnel -------------------------------------------------------
    def _judge_tls(self, data: bytes, host: str, port: int) -> Verdict:
        """None: wait; _PASS; or (reason, method, explanation) to refuse."""
        hello = read_client_hello(data)
        if hello is NEED_MORE:
            return None
        where = policy.join_host_port(host, port)
        if isinstance(hello, BadHello):
            return ("tls_hello_invalid", "TLS",
                    f"The guard closed a tunnel to {where}: its TLS ClientHello is not valid "
                    f"({hello.reason}).")
        names = hello.server_names
        if not hello.has_sni_extension:
            if hello.encrypted:
                return ("sni_mismatch", "TLS",
                        f"The guard closed a tunnel to {where}: an encrypted ClientHello "
                        "needs an outer server name equal to the CONNECT host.")
            if _is_ip(host):
                return _PASS  # clients send no SNI for an IP address (RFC 6066)
            return ("sni_missing", "TLS",
                    f"The guard closed a tunnel to {where}: its TLS ClientHello names no "
                    "server; the guard needs the name to match the CONNECT host.")
        if len(names) != 1 or names[0][0] != 0:
            shown = ", ".join(f"type {t}: {self._shown(n.decode('latin-1'))}" for t, n in names[:4])
            return ("sni_mismatch", "TLS",
                    f"The guard closed a tunnel to {where}: its TLS ClientHello must name exactly "
                    f"one host_name ({len(names)} given: {shown}).")
        name = names[0][1]
        if not self._same_host(name, host):
            return ("sni_mismatch", "TLS",
                    f"The guard closed a tunnel to {where}: its TLS ClientHello names a "
                    f"different server ({self._shown(name.decode('latin-1'))}).")
        return _PASS

    def _judge_http(self, data: bytes, host: str, port: int) -> Verdict:
        """None: wait; _PASS; or a refusal. An HTTP/1 request inside must name the CONNECT
        host in at most one Host header. A first line that mentions HTTP/ but is not a clean
        request line is refused (a server might read it as a request the guard did not
        check); a text protocol whose first line does not (Redis' `PING`) passes."""
        where = policy.join_host_port(host, port)
        line_end = data.find(b"\n")
        if line_end < 0:
            # The rule below reads the whole first line: any prefix can still become a line
            # that mentions HTTP/ (`Get`, then ` / HTTP/1.1`), so nothing passes before it.
            if len(data) > self.s.max_head_bytes:
                return ("request_head_too_large", "TUNNEL",
                        f"The guard closed a tunnel to {where}: its first line is over "
                        f"{self.s.max_head_bytes} bytes.")
            return None
        if not _HTTP_REQUEST_LINE.match(data):
            if b"HTTP/" in data[:line_end].upper():
                return ("tunnel_protocol_refused", "TUNNEL",
                        f"The guard closed a tunnel to {where}: its first line is not a "
                        "well-formed HTTP/1 request line.")
            return _PASS
        blank = _BLANK_LINE.search(data)
        head = data if blank is None else data[:blank.end()]
        lines = head.count(b"\n")
        if lines > self.s.max_header_count + 2 or len(head) > self.s.max_head_bytes:
            return ("request_head_too_large", "TUNNEL",
                    f"The guard closed a tunnel to {where}: the request head inside is over "
                    f"{self.s.max_header_count} headers or {self.s.max_head_bytes} bytes.")
        if blank is None:
            return None
        buf = ReceiveBuffer()
        buf += head
        extracted = buf.maybe_extract_lines() or []
        refusal, _, _ = judge_request([bytes(x) for x in extracted], len(head), host, port, first=True)
        if refusal is not None:
            return refusal[0], "TUNNEL", refusal[1]
        return _HTTP

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _key(address: Address) -> tuple[str, int] | None:
        try:
            return policy.normalize_host(str(address[0])), int(address[1])
        except policy.MalformedHost:
            return None

    @staticmethod
    def _same_host(sni: bytes, host: str) -> bool:
        try:
            text = sni.decode("ascii")
        except UnicodeDecodeError:
            return False  # a host_name is ASCII (A-labels) on the wire
        if not text or text[0] == "[" or ":" in text:
            return False  # a host_name is a DNS name, never an IP literal in brackets
        try:
            return policy.normalize_host(text) == host
        except policy.MalformedHost:
            return False

    @staticmethod
    def _shown(text: str) -> str:
        return text[:100].encode("ascii", "backslashreplace").decode("ascii")

    def _refuse(self, conn: ConnState, target: Target, reason: str, method: str, explanation: str) -> None:
        """Record the refusal (enforced in every mode; the caller closes the connection)."""
        d = self.s.policy.refuse(target.decision, reason, explanation)
        self.s.log_decision(d, client=conn.client, method=method, addr=target.address)
