"""State shared by the guard addons of one proxy, and the small helpers they share.

The addons ask `policy` and enforce; everything they need to remember between hooks lives
here: the clients, the active site policy, the resolver, the decision log, and per client
connection what was decided (`ConnState`), so that the server connection goes exactly to the
address that was checked.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass, field

from mitmproxy import http

from sfguard.policy import Decision, SitePolicy
from sfguard.proxy_addons.clients import Client, ClientRegistry
from sfguard.proxy_addons.decision_log import DecisionLog
from sfguard.proxy_addons.pacing import Pacer, Refusal
from sfguard.proxy_addons.policy_watch import PolicyStatus

logger = logging.getLogger("sfguard.proxy")

DECISION_HEADER = "X-Sfguard-Decision"
#: Seconds allowed for a DNS lookup.
RESOLVE_TIMEOUT = 5.0


@dataclass
class Target:
    """An allowed destination of one client connection: the decision and the checked address."""

    decision: Decision
    address: str


@dataclass
class LastAllowed:
    """The last allowed plain-HTTP request of a client connection: what its decision depended
    on (compared before the decision and address are used again) and the result."""

    client: Client
    policy: SitePolicy
    host: str
    port: int
    host_header: str | None
    decision: Decision
    address: str


@dataclass
class ConnState:
    """What the guard knows about one client connection."""

    client: Client | None = None
    # CONNECT tunnel: the (normalised host, port) it was opened for, and its target.
    tunnel: tuple[str, int] | None = None
    # Allowed destinations keyed by (normalised host, port); server_connect only uses these.
    targets: dict[tuple[str, int], Target] = field(default_factory=dict)
    # Set once the first request head was read (the head-read timeout stops applying).
    head_done: bool = False
    # Plain HTTP: the last allowed request (ConnectGuard.requestheaders uses it again).
    last_allowed: LastAllowed | None = None
    timer: asyncio.TimerHandle | None = None
    # Pacing: the connection counters this connection holds open (released when it closes),
    # and True while a request of it waits for the pace (the head timeout waits with it).
    paced: list[str] = field(default_factory=list)
    waiting: bool = False


class Resolver:
    """DNS with `--resolve HOST=IP` overrides (like curl's). Returns every address."""

    def __init__(self, overrides: dict[str, list[str]] | None = None) -> None:
        self.overrides = dict(overrides or {})

    async def resolve(self, host: str, port: int) -> list[str]:
        """Addresses for a normalised host; an IP literal is its own address. Raises OSError."""
        # an IPv4 literal ends in a digit and an IPv6 one holds a colon: a name that does
        # neither is not parsed as an address (a failed parse costs an exception per connection)
        if ":" in host or host[-1:].isdigit():
            try:
                return [str(ipaddress.ip_address(host))]
            except ValueError:
                pass
        if host in self.overrides:
            return list(self.overrides[host])
        loop = asyncio.get_running_loop()
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP),
            RESOLVE_TIMEOUT,
        )
        seen: list[str] = []
        for _family, _type, _proto, _canon, sockaddr in infos:
            addr = str(sockaddr[0]).split("%", 1)[0]
            if addr not in seen:
                seen.append(addr)
        if not seen:
            raise OSError("no address")
        return seen


class GuardState:
    """Everything the guard addons share. One per proxy."""

    def __init__(self, registry: ClientRegistry, policy_status: PolicyStatus,
                 resolver: Resolver, decision_log: DecisionLog, run: str | None = None,
                 head_timeout: float = 10.0, max_head_bytes: int = 64 * 1024,
                 max_header_count: int = 128, pacer: Pacer | None = None) -> None:
        self.registry = registry
        self.policy_status = policy_status
        self.resolver = resolver
        self.decision_log = decision_log
        self.run = run
        self.head_timeout = head_timeout
        self.max_head_bytes = max_head_bytes
        self.max_header_count = max_header_count
        self.conns: dict[str, ConnState] = {}
        self.pacer = pacer if pacer is not None else Pacer()   # proxy_addons/pacing.py
        self.running = asyncio.Event()  # set once mitmproxy's servers listen

    @property
    def policy(self) -> SitePolicy:
        return self.policy_status.policy

    def conn(self, client_id: str) -> ConnState:
        state = self.conns.get(client_id)
        if state is None:
            state = self.conns[client_id] = ConnState()
        return state

    def log_decision(self, d: Decision, *, client: Client | None, method: str,
                     addr: str | None = None) -> bool:
        """Record a decision: one line, or a count for quiet denials. False when the line
        could not be written: an allowed request must then be refused (`unrecorded`)."""
        run = client.run if client and client.run else self.run
        name = client.name if client else None
        host = d.normalized_host if d.normalized_host is not None else d.host
        if d.quiet and not d.allowed:
            self.decision_log.count_quiet(run=run, client=name, host=host)
            return True
        return self.decision_log.write(run=run, client=name, method=method, host=host, port=d.port,
                                       decision=d.decision, reason=d.reason, rule=d.rule, addr=addr)

    def unrecorded(self, d: Decision, *, client: Client | None, method: str) -> Decision:
        """The denial of an allowed request whose decision could not be recorded (fail closed:
        every request that passes is in the log)."""
        denied = self.policy.refuse(
            d, "decision_log_unwritable",
            "The guard refused this request because it could not record its decision (the "
            "decision log cannot be written: is the guard's disk full?). Try again later.")
        self.log_decision(denied, client=client, method=method)
        return denied

    async def check_addresses(self, d: Decision) -> tuple[Decision, str | None]:
        """Resolve an allowed decision's host and check every address.

        Returns the final decision and the address to connect to (None when denied or when
        the name does not resolve). All addresses must pass; the first one is used.
        """
        host = d.normalized_host
        if host is None or d.port is None:   # an allowed decision always has both
            raise RuntimeError("an allowed decision without host or port")
        try:
            addrs = await self.resolver.resolve(host, d.port)
        except (TimeoutError, OSError, UnicodeError):
            denied = self.policy.refuse(
                d, "resolve_failed", f"The guard could not resolve {host}, so it did not connect.")
            return denied, None
        result = d
        for addr in addrs:
            checked = self.policy.check_address(d, addr)
            if not checked.allowed:
                return checked, None
            if checked.reason != d.reason:
                result = checked  # report mode: carries would_deny:private_address
        return result, addrs[0]


def deny_response(d: Decision) -> http.Response:
    """The 403 answer for a denial: decision header and a one-line explanation."""
    body = (d.explanation.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8")
    return http.Response.make(403, body, {
        "Content-Type": "text/plain; charset=utf-8",
        DECISION_HEADER: f"deny; reason={d.reason}",
        "Connection": "close",
    })


def pace_response(refusal: Refusal) -> http.Response:
    """The answer over the pace or a budget: 429 (503 when the counters cannot be used), the
    decision header, `Retry-After` when a time is known, and a line for the page and the agent."""
    headers = {"Content-Type": "text/plain; charset=utf-8",
               DECISION_HEADER: f"deny; reason={refusal.reason}", "Connection": "close"}
    if refusal.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(refusal.retry_after + 0.999)))
    body = (refusal.explanation.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8")
    return http.Response.make(refusal.status, body, headers)


def auth_required_response() -> http.Response:
    """The 407 answer for missing or wrong proxy credentials."""
    return http.Response.make(
        407,
        b"sfguard: this proxy needs your own NAME:TOKEN proxy credentials.\n",
        {
            "Content-Type": "text/plain; charset=utf-8",
            "Proxy-Authenticate": 'Basic realm="sfguard"',
            DECISION_HEADER: "deny; reason=proxy_auth_required",
            "Connection": "close",
        },
    )
