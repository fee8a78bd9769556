"""ConnectGuard addon: identifies the client and asks `policy` about each request.

Hooks:
- `http_connect` (CONNECT host:port): credentials, `policy.decide`, then DNS and
  `policy.check_address` for every address. Allowed: the checked address is remembered for
  `AddressGuard`; denied: 403 with the decision header and a one-line explanation.
- `requestheaders` (plain HTTP, absolute-form URL; raised by `PlainHttpLayer` for each request,
  and by mitmproxy's own HTTP layers where those run): the same, after request_head's checks of
  the parsed head, which hold on any layer stack: no CR, LF or NUL left in a field (a lone CR
  or an obs-fold mitmproxy's parser kept), exactly one Host on HTTP/1.1, naming the same host
  and port as the URL (`host_header_mismatch`); each refusal is `400` with the decision header
  and a decision-log line. `http_connect` makes the same checks of a CONNECT head (its Host, when
  sent, must name the CONNECT authority). The client's `Proxy-Authorization` header is removed before the
  request goes anywhere. An allowed request's target host is set to the checked address, where
  `PlainHttpLayer` sends it. On a kept-alive connection the last allowed request's decision and
  address are used again (and logged again) while nothing they rest on changed
  (`ConnState.last_allowed`: the same client and policy objects, URL host, port, Host header).
"""
from __future__ import annotations

import asyncio
import logging

from mitmproxy import http

from sfguard import policy
from sfguard.policy.pace import DELAY_LOGGED, NO_PACE, HostPace
from sfguard.policy.writes import SHELL_REFUSAL, shell_verdict
from sfguard.proxy_addons.clients import Client
from sfguard.proxy_addons.pacing import Refusal, is_navigation
from sfguard.proxy_addons.request_head import EXPLAIN, field_fault, host_fault
from sfguard.proxy_addons.state import (
    DECISION_HEADER,
    GuardState,
    LastAllowed,
    Target,
    auth_required_response,
    deny_response,
    pace_response,
)

logger = logging.getLogger("sfguard.proxy.connect")
#: the reason a browser's request is refused before the guard put it under its rules
BROWSER_NOT_READY = "browser_not_ready"


class ConnectGuard:
    def __init__(self, state: GuardState) -> None:
        self.s = state

    def _authenticate(self, flow: http.HTTPFlow, value: str | None) -> Client | None:
        if not self.s.registry.loaded:
            # A run proxy (re)started before the guard sent its clients. A 407 to a browser's
            # good credential would make Chromium drop it from its auth cache, and the guard's
            # pipe answers challenges only at first (cdp_pipe: Fetch only while needed): the
            # connection is closed instead, as while the proxy was down.
            self.s.decision_log.write(
                run=self.s.run, client=None, method=flow.request.method,
                host=flow.request.host, port=flow.request.port, decision="deny",
                reason="proxy_starting", rule=None, addr=None)
            flow.kill()
            return None
        client = self.s.registry.authenticate(value, flow.client_conn.proxy_mode.custom_listen_port)
        if client is None:
            flow.response = auth_required_response()
            if value is not None:
                # Wrong credentials: worth a line (never the name claimed or the token).
                self.s.decision_log.write(
                    run=self.s.run, client=None, method=flow.request.method,
                    host=flow.request.host, port=flow.request.port, decision="deny",
                    reason="proxy_auth_failed", rule=None, addr=None)
        return client

    async def _decide(self, flow: http.HTTPFlow, client: Client, host: str,
                      port: int) -> tuple[policy.Decision, str, tuple[str, int]] | None:
        """Decide, check addresses, answer denials; return (decision, address, (normalised
        host, port)) or None."""
        site = self.s.policy
        d = site.decide(host, port, client.allow)
        if client.held:
            d = site.refuse(d, BROWSER_NOT_READY, "the guard has not yet put this browser under its rules "
                            "(write gate, extension): nothing leaves it before that")
        elif d.allowed and client.writes is not None and d.normalized_host is not None:
            refusal = shell_verdict(site.writes, client.writes, d.normalized_host, d.port)
            if refusal is not None:
                d = site.refuse(d, SHELL_REFUSAL, refusal.explanation)
        addr = None
        if d.allowed:
            d, addr = await self.s.check_addresses(d)
        method = flow.request.method
        if not d.allowed:
            self.s.log_decision(d, client=client, method=method)
            flow.response = deny_response(d)
            return None
        if addr is None:  # report mode let an unresolvable name pass: nothing to connect to
            self.s.log_decision(d, client=client, method=method)
            flow.response = http.Response.make(
                502, f"sfguard: {d.normalized_host} did not resolve.\n".encode(),
                {"Content-Type": "text/plain; charset=utf-8", "Connection": "close"})
            return None
        if not await self._pace(flow, client, d):
            return None
        if not self.s.log_decision(d, client=client, method=method, addr=addr):
            flow.response = deny_response(self.s.unrecorded(d, client=client, method=method))
            return None
        host_key, port_key = d.normalized_host, d.port
        if host_key is None or port_key is None:   # checked by check_addresses
            raise RuntimeError("an allowed decision without host or port")
        return d, addr, (host_key, port_key)

    async def _pace(self, flow: http.HTTPFlow, client: Client, d: policy.Decision) -> bool:
        """The site's pace and the client's stage budgets (proxy_addons/pacing.py) for one
        allowed request: True to send it (after any wait), False when refused (answered 429,
        logged). A CONNECT is a request and an open connection; a plain request is a request, a
        page load when it is a navigation, and holds one connection per site while its client
        connection lasts."""
        site, host = self.s.policy, d.normalized_host
        pace = site.pace.pace(host, d.port) if site.pace.entries and host is not None else NO_PACE
        if not pace and not client.budgets:
            return True
        conn = self.s.conn(flow.client_conn.id)
        request, who, pacer = flow.request, client.who, self.s.pacer
        connect = request.method.upper() == "CONNECT"
        caps = tuple(c for c in pace.connections if c.key(who) not in conn.paced)
        if caps:
            conn.waiting = True
            try:
                held, refused = await pacer.open_connection(who, HostPace(connections=caps, entries=pace.entries))
            finally:
                conn.waiting = False
            if refused is not None:
                return self._pace_refused(flow, client, d, refused)
            conn.paced += held
        counts_loads = bool(pace.page_loads) or any(
            b.budget.page_loads is not None or b.budget.page_loads_per_minute is not None for b in client.budgets)
        page_load = counts_loads and not connect and is_navigation(request.headers.fields)
        verdict = await pacer.admit(who, client.budgets, pace, page_load=page_load)
        if verdict.refusal is not None:
            return self._pace_refused(flow, client, d, verdict.refusal)
        if verdict.wait > 0:
            if verdict.wait >= DELAY_LOGGED and verdict.limit is not None:
                self.s.decision_log.write(
                    run=client.run or self.s.run, client=client.name, method=request.method, host=host,
                    port=d.port, decision="delay", reason=verdict.limit.reason, rule=verdict.limit.rule,
                    addr=None, extra={"wait_ms": int(verdict.wait * 1000)})
            conn.waiting = True
            try:
                await asyncio.sleep(verdict.wait)
            finally:
                conn.waiting = False
        return True

    def _pace_refused(self, flow: http.HTTPFlow, client: Client, d: policy.Decision,
                      refused: Refusal) -> bool:
        extra: dict[str, object] = {}
        if refused.retry_after is not None:
            extra["retry_after_s"] = round(refused.retry_after, 1)
        self.s.decision_log.write(
            run=client.run or self.s.run, client=client.name, method=flow.request.method,
            host=d.normalized_host, port=d.port, decision="deny", reason=refused.reason, rule=refused.rule,
            addr=None, extra=extra)
        flow.response = pace_response(refused)
        return False

    def _head_refused(self, flow: http.HTTPFlow, client: Client | None,
                      hosts: list[str], default_port: int) -> bool:
        """request_head's checks of a parsed head (any layer stack): on a fault answer 400 with
        the decision header, log it and return True."""
        request = flow.request
        code = field_fault(request.headers.fields)
        if code is None:
            try:
                host = policy.normalize_host(request.host)
            except policy.MalformedHost:
                host = None  # the decision refuses a malformed host; a missing Host still counts
            if host is not None or len(hosts) != 1:
                code = host_fault(hosts, request.http_version, host or "", request.port, default_port)
        if code is None:
            return False
        self.s.decision_log.write(
            run=client.run if client and client.run else self.s.run,
            client=client.name if client else None, method=request.method,
            host=request.host, port=request.port, decision="deny", reason=code, rule=None,
            addr=None)
        flow.response = http.Response.make(
            400, f"sfguard: the guard refused this request: {EXPLAIN[code]}.\n".encode(),
            {"Content-Type": "text/plain; charset=utf-8", DECISION_HEADER: f"deny; reason={code}",
             "Connection": "close"})
        return True

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        # The head-read timeout stays armed until the tunnel's first message was judged.
        conn = self.s.conn(flow.client_conn.id)
        client = self._authenticate(flow, flow.request.headers.get("Proxy-Authorization"))
        if client is None:
            return
        conn.client = client
        hosts = [v.decode("utf-8", "surrogateescape") for k, v in flow.request.headers.fields
                 if k.lower() == b"host"]
        if self._head_refused(flow, client, hosts, flow.request.port):
            return
        result = await self._decide(flow, client, flow.request.host, flow.request.port)
        if result is None:
            return
        d, addr, key = result
        conn.tunnel = key
        conn.targets[key] = Target(d, addr)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        conn = self.s.conn(flow.client_conn.id)
        conn.head_done = True
        request = flow.request
        # The credential is for the guard only: never forward it.
        auth_value, hosts = _take_credential(request)
        host_header = ", ".join(hosts) if hosts else None
        client = self._authenticate(flow, auth_value)
        if client is None:
            return
        conn.client = client
        if request.scheme != "http":
            flow.response = http.Response.make(
                400, b"sfguard: only http:// URLs can be sent as plain proxy requests; "
                     b"use CONNECT for https.\n",
                {"Content-Type": "text/plain; charset=utf-8", "Connection": "close"})
            return
        # (a kept-alive connection's decision is used again below only for one same Host line)
        if (len(hosts) != 1 or field_fault(request.headers.fields) is not None) \
                and self._head_refused(flow, client, hosts, 80):
            return
        # A kept-alive connection asks for the same destination again and again: the decision
        # and checked address of its last allowed request are used again (and logged again)
        # while nothing they depend on changed: the same client (a changed allowlist or token
        # is a new Client object), the same site policy object (a reload is a new one), the same
        # URL host and port and Host header. The address is the one checked for this connection
        # (as a kept-alive server connection would be).
        site = self.s.policy
        host, port = request.host, request.port
        last = conn.last_allowed
        if last is not None and last.client is client and last.policy is site \
                and last.host == host and last.port == port and last.host_header == host_header:
            d, addr = last.decision, last.address
            if not await self._pace(flow, client, d):
                conn.last_allowed = None
                return
            if not self.s.log_decision(d, client=client, method=request.method, addr=addr):
                conn.last_allowed = None
                flow.response = deny_response(self.s.unrecorded(d, client=client, method=request.method))
                return
        else:
            if self._head_refused(flow, client, hosts, 80):  # one Host, naming the URL's host
                return
            result = await self._decide(flow, client, host, port)
            if result is None:
                return
            d, addr, key = result
            target = Target(d, addr)
            conn.targets[key] = target
            conn.targets[(addr, key[1])] = target
            conn.last_allowed = LastAllowed(client, site, host, port, host_header, d, addr)
        # Connect to the checked address: set the request's target host to it (the Host header
        # is left as it is). Server connections are reused per address and mitmproxy counts
        # them per address (at most 5 open at once), so the address must not change later.
        request.data.host = addr


def _take_credential(request: http.Request) -> tuple[str | None, list[str]]:
    """Remove every Proxy-Authorization header from `request`, in one pass over its head, and
    return that header's value (repeated headers joined with ", ", as mitmproxy's `Headers.get`
    joins them; None when absent) and the values of its Host lines."""
    auth: list[bytes] = []
    host: list[bytes] = []
    kept = []
    for field in request.headers.fields:
        name = field[0].lower()
        if name == b"proxy-authorization":
            auth.append(field[1])
            continue
        if name == b"host":
            host.append(field[1])
        kept.append(field)
    if auth:
        request.headers.fields = tuple(kept)
    return _joined(auth), [v.decode("utf-8", "surrogateescape") for v in host]


def _joined(values: list[bytes]) -> str | None:
    if not values:
        return None
    return ", ".join(v.decode("utf-8", "surrogateescape") for v in values)
