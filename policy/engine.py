"""Decisions: may this host be reached, and why.

Order (docs/design.md 4.1), first answer wins:

1. malformed host                      -> deny  malformed_host
2. port not allowed                    -> deny  port_not_allowed
   (allowed: the policy's `ports`, default 80 and 443, or a pattern with that explicit port in
   the run's allow list or allow_always that matches the host)
3. host matches `block`                -> deny  blocked_by_policy
4. host matches the run's allow list   -> allow allowed_by_run
   host matches `allow_always`         -> allow allowed_by_policy
5. anything else                       -> deny  not_allowed

A special-purpose address (loopback, private, link-local, CGNAT, ULA, ...) is the security
reviewer's to open, never a run's: an IP literal host in such a range is denied in step 3
(`reviewer_only_address`) unless the policy's `private_networks.allow` covers it, whatever the
allow lists say; after DNS the proxy calls `check_address` for every resolved address of a name
and applies the same rule (`private_address`). Link-local addresses, which hold the cloud
metadata services, and the other metadata addresses (`METADATA_ADDRESSES`) are covered only by
an entry that is that very address, never by a wider range. `run_pattern_refusal` says the same
about a run's IP and CIDR patterns before a run (`sfguard validate`, the stage API). The proxy
refuses SNI or Host header mismatches itself through `refuse`. `mode: report` relaxes only
the allow and block lists: a `not_allowed` or `blocked_by_policy` denial becomes decision
"allow" with reason "would_deny:<code>" (in one place, `_finish`). Every other check
(malformed host, port, private and special addresses, SNI and Host agreement, credentials,
request limits) denies in every mode; `check_address` judges a would-deny host's addresses too
(only private_networks.allow exempts one). Writes: writes.py; pace: pace.py; recording: recording.py.
"""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypedDict

from sfguard.policy.errors import MalformedHost
from sfguard.policy.hosts import join_host_port, normalize_host_ex, printable_host
from sfguard.policy.index import Match, RuleSet, suffixes
from sfguard.policy.pace import PaceRules
from sfguard.policy.patterns import Pattern, PatternError, parse_pattern
from sfguard.policy.recording import RecordingRules
from sfguard.policy.writes import WriteRules

DEFAULT_PORTS = frozenset({80, 443})
#: The only reasons that report mode turns into "would_deny": the allow and block lists.
REPORT_RELAXES = frozenset({"not_allowed", "blocked_by_policy"})
#: A special-purpose IP literal (or IP/CIDR pattern) that only private_networks.allow can open.
REVIEWER_ONLY = "reviewer_only_address"
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class DecisionRecord(TypedDict):
    """`Decision.as_dict()`: the shape of `sfguard policy explain --json`."""

    host: str
    port: int | None
    normalized_host: str | None
    decision: str
    reason: str
    rule: str | None
    allowed_by_ip: bool
    quiet: bool
    explanation: str
    mode: str


class PolicySummary(TypedDict):
    """`SitePolicy.summary()`: what `sfguard policy validate --json` and status show."""

    source: str
    mode: str
    ports: list[int]
    tab_quota: int
    allow_always: int
    block: int
    quiet: int
    private_networks: list[str]
    writes: int                 # entries of the `writes` section (policy/writes.py)
    pace: int                   # entries of the `pace` section (policy/pace.py)


@dataclass(frozen=True)
class Decision:
    """One answer of the policy, with what is needed to explain and log it (no secrets)."""

    host: str                  # as asked (control characters escaped, user info redacted)
    port: int | None
    normalized_host: str | None  # None when malformed
    decision: str              # "allow" | "deny"
    reason: str                # reason code; "would_deny:<code>" in report mode
    rule: str | None           # "sites.yaml:12 *.example.com" | "--allow *.example.com" | None
    allowed_by_ip: bool        # the allowing pattern was an IP literal or CIDR
    quiet: bool                # a denial not worth logging one by one
    explanation: str           # one readable sentence
    network: str | None = None  # for allowed_by_ip: the network of the allowing pattern
    mode: str = "enforce"

    @property
    def allowed(self) -> bool:
        return self.decision == "allow"

    @property
    def would_deny(self) -> bool:
        """True in report mode when enforce mode would have denied."""
        return self.reason.startswith("would_deny:")

    def as_dict(self) -> DecisionRecord:
        """The fields as a JSON-ready dict (the shape of `sfguard policy explain --json`)."""
        return {"host": self.host, "port": self.port, "normalized_host": self.normalized_host,
                "decision": self.decision, "reason": self.reason, "rule": self.rule,
                "allowed_by_ip": self.allowed_by_ip, "quiet": self.quiet,
                "explanation": self.explanation, "mode": self.mode}


#: Cloud metadata services (instance credentials): AWS, GCP, Azure, Oracle (169.254.169.254),
#: AWS over IPv6 (fd00:ec2::254), Alibaba (100.100.100.200). Like every link-local address they
#: are opened only by a private_networks.allow entry that is that very address.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200"))

#: The link-local blocks: like the metadata addresses, opened only address by address.
LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))

# Special-purpose address ranges, most specific first. Addresses that embed an IPv4 address
# (IPv4-mapped, NAT64, 6to4) are also judged by that IPv4 address.
_SPECIAL_RANGES: list[tuple[IPNetwork, str]] = [
    (ipaddress.ip_network(n), label) for n, label in [
        ("169.254.169.254/32", "link-local (cloud metadata)"),
        ("fd00:ec2::254/128", "unique local (cloud metadata)"),
        ("100.100.100.200/32", "carrier-grade NAT (cloud metadata)"),
        ("0.0.0.0/8", "unspecified ('this network')"),
        ("10.0.0.0/8", "private (RFC 1918)"),
        ("100.64.0.0/10", "carrier-grade NAT (RFC 6598)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private (RFC 1918)"),
        ("192.0.0.0/24", "IETF protocol assignment"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private (RFC 1918)"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::/96", "IPv4-compatible (deprecated)"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/32", "Teredo tunnel"),
        ("2001:db8::/32", "documentation"),
        ("2001::/23", "IETF protocol assignment"),
        ("fc00::/7", "unique local (ULA)"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
    ]
]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")

def special_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The kind of special-purpose range `addr` is in ("loopback", "private (RFC 1918)", ...),
    or None for an ordinary global address."""
    if isinstance(addr, ipaddress.IPv6Address):
        inner = _embedded_ipv4(addr)
        if inner is not None:
            label = special_address(inner)
            if label:
                return f"{label}, embedded in IPv6"
            if addr.ipv4_mapped is not None:
                return None
    for net, label in _SPECIAL_RANGES:
        if addr.version == net.version and addr in net:
            return label
    if not addr.is_global:
        return "special-purpose"
    return None


@functools.lru_cache(maxsize=1024)
def _read_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, str | None]:
    """A resolved address (an IPv4-mapped IPv6 address as its IPv4 address) and its
    special-purpose label (None: an ordinary global address). Read once per text: the same
    few addresses come back for every connection of a run. Raises ValueError."""
    if "%" in text:
        raise ValueError("zone id")
    addr = ipaddress.ip_address(text)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr, special_address(addr)


def exempting_network(net: IPNetwork) -> bool:
    """True when the range `net` lies wholly inside one special-purpose block (``127.0.0.1``,
    ``10.0.0.0/8``, ``fd00::/8``): such a range is not a catch-all, however wide
    (policy.patterns), and a run's pattern for it needs the reviewer's consent
    (`SitePolicy.run_pattern_refusal`). A range that spans public space or several blocks
    (``0.0.0.0/1``, ``8.0.0.0/5``) is not."""
    return _special_in(net) is not None


def exact_only(label: str) -> bool:
    """True for the kinds only an exact-address entry opens: link-local and cloud metadata."""
    return "link-local" in label or "metadata" in label


def _special_in(net: IPNetwork) -> tuple[IPNetwork, str] | None:
    """The special-purpose block that wholly holds `net` (see exempting_network), or None."""
    for block, label in _SPECIAL_RANGES:
        if block.version == net.version and net.subnet_of(block):  # type: ignore[arg-type]
            return block, label
    return None


class SitePolicy:
    """A loaded site policy. Build with `policy.load_policy` / `policy.parse_policy`."""
    recording: RecordingRules = RecordingRules()   # policy/recording.py (what run records keep)

    def __init__(self, *, source: str, mode: str = "enforce", ports: Iterable[int] = DEFAULT_PORTS,
                 tab_quota: int = 8, block: RuleSet | None = None,
                 allow_always: RuleSet | None = None, quiet: RuleSet | None = None,
                 private_networks: Iterable[str] = (), version: int = 1,
                 private_lines: Iterable[int] = (), writes: WriteRules | None = None,
                 pace: PaceRules | None = None):
        if mode not in ("enforce", "report"):
            raise ValueError("mode is 'enforce' or 'report'")
        self.source = source
        self.version = version
        self.mode = mode
        self.ports = frozenset(ports)
        self.tab_quota = tab_quota
        label = source.replace("\\", "/").rsplit("/", 1)[-1] or source
        self.block = block if block is not None else RuleSet(label)
        self.allow_always = allow_always if allow_always is not None else RuleSet(label)
        self.quiet = quiet if quiet is not None else RuleSet(label)
        self.private_networks = tuple(ipaddress.ip_network(n) for n in private_networks)
        self.writes = writes if writes is not None else WriteRules()   # policy/writes.py
        self.pace = pace if pace is not None else PaceRules()          # policy/pace.py
        lines = list(private_lines)
        #: the source line of each private_networks.allow entry (0: unknown)
        self.private_lines = tuple(lines[i] if i < len(lines) else 0
                                   for i in range(len(self.private_networks)))

    def __repr__(self) -> str:
        return (f"SitePolicy(source={self.source!r}, mode={self.mode!r}, ports={sorted(self.ports)}, block="
                f"{len(self.block)}, allow_always={len(self.allow_always)}, quiet={len(self.quiet)})")

    def summary(self) -> PolicySummary:
        return {"source": self.source, "mode": self.mode, "ports": sorted(self.ports),
                "tab_quota": self.tab_quota, "allow_always": len(self.allow_always),
                "block": len(self.block), "quiet": len(self.quiet), "writes": len(self.writes),
                "pace": len(self.pace), "private_networks": [str(n) for n in self.private_networks]}

    # -- the one place where mode is applied ------------------------------------------------
    def _finish(self, host: str, port: int | None, normalized: str | None, allow: bool,
                reason: str, rule: str | None, explanation: str, is_ip: bool = False,
                match: Match | None = None, parents: list[str] | None = None) -> Decision:
        quiet = False
        if not allow:
            if normalized is not None and len(self.quiet):
                quiet = self.quiet.match(normalized, is_ip, port, parents=parents) is not None
            if self.mode == "report" and reason in REPORT_RELAXES:
                return _make(host, port, normalized, "allow", "would_deny:" + reason, rule, False,
                             quiet, "report mode, would deny: " + explanation, None, self.mode)
            return _make(host, port, normalized, "deny", reason, rule, False, quiet, explanation,
                         None, self.mode)
        network = match.network if match is not None else None
        return _make(host, port, normalized, "allow", reason, rule, network is not None, False,
                     explanation, network, self.mode)

    # -- first stage: the host ----------------------------------------------------------------
    def decide(self, host: str, port: int | None, allow: RuleSet | None = None) -> Decision:
        """Decide for a host (no port in it) and port; `allow` is the run's allow_domains."""
        try:
            normalized, is_ip = normalize_host_ex(host)
        except MalformedHost as exc:
            shown = printable_host(host)
            return self._finish(shown, port, None, False, "malformed_host", None,
                                f"'{shown}' is not a valid host: {exc.reason}.")
        if port is not None and (port.__class__ is not int or not 1 <= port <= 65535):
            return self._finish(host, None, normalized, False, "port_not_allowed", None,
                                f"port {port!r} is not a valid port.", is_ip)
        parents = None if is_ip else suffixes(normalized)

        port_match: Match | None = None
        port_reason = ""
        if port is not None and port not in self.ports:
            if allow is not None:
                port_match = allow.match(normalized, is_ip, port, True, parents)
                port_reason = "allowed_by_run"
            if port_match is None:
                port_match = self.allow_always.match(normalized, is_ip, port, True, parents)
                port_reason = "allowed_by_policy"
            if port_match is None:
                ports = ", ".join(str(p) for p in sorted(self.ports)) or "none"
                return self._finish(
                    host, port, normalized, False, "port_not_allowed", None,
                    (f"port {port} is not allowed for {normalized} (allowed ports: {ports}; "
                     f"a pattern such as {join_host_port(normalized, port)} allows one more)."), is_ip, None, parents)

        blocked = self.block.match(normalized, is_ip, port, False, parents)
        if blocked is not None:
            why = f": {blocked.reason.rstrip('.')}" if blocked.reason else ""
            return self._finish(
                host, port, normalized, False, "blocked_by_policy", blocked.rule,
                (f"{normalized} is blocked by the site policy{why}. "
                 "A run's allow_domains cannot override the block list."), is_ip, None, parents)

        if is_ip:
            refused = self._reviewer_only(host, port, normalized, parents)
            if refused is not None:
                return refused
        if port_match is not None:
            return self._allowed(host, port, normalized, port_reason, port_match)
        if allow is not None:
            found = allow.match(normalized, is_ip, port, False, parents)
            if found is not None:
                return self._allowed(host, port, normalized, "allowed_by_run", found)
        found = self.allow_always.match(normalized, is_ip, port, False, parents)
        if found is not None:
            return self._allowed(host, port, normalized, "allowed_by_policy", found)
        return self._finish(
            host, port, normalized, False, "not_allowed", None,
            (f"{normalized} is not in this run's allow_domains nor in the site policy's "
             "allow_always; ask the pipeline owner to add it to allow_domains."), is_ip, None, parents)

    def _allowed(self, host: str, port: int | None, normalized: str, reason: str,
                 match: Match) -> Decision:
        where = "this run's allow_domains" if reason == "allowed_by_run" else "the site policy's allow_always"
        return self._finish(host, port, normalized, True, reason, match.rule,
                            f"{normalized} is allowed by {where} ({match.pattern}).", False, match)

    # -- second stage: the resolved address ---------------------------------------------------
    def check_address(self, decision: Decision,
                      address: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> Decision:
        """Judge one resolved address of an allowed host. Returns `decision` unchanged when the
        address is fine (or the decision is already a denial or a report-mode would-deny), or a
        private_address denial (in every mode). A report-mode would-deny decision is checked
        like an allowed one. Pure: no DNS here."""
        if not decision.allowed:
            return decision
        text = (address if isinstance(address, str) else str(address)).strip("[]")
        try:
            addr, label = _read_address(text)
        except ValueError:
            return self.refuse(decision, "invalid_address",
                               f"{decision.normalized_host} resolved to something that is not an IP address.")
        if label is None:
            return decision
        if self.consents(addr, label) is not None:
            return decision
        return self.refuse(
            decision, "private_address",
            (f"{decision.normalized_host} resolves to {addr}, a {label} address; "
             + self._who_can(addr, label)))

    # -- special-purpose addresses: the reviewer's consent ----------------------------------
    def consents(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address,
                 label: str) -> str | None:
        """The private_networks.allow entry that opens the special address `addr` (of kind
        `label`), as its rule text, or None. Link-local and cloud metadata addresses only by an
        entry that is that very address. The one rule for IP literals, resolved addresses and
        a run's IP patterns."""
        exact = exact_only(label)
        for i, net in enumerate(self.private_networks):
            if addr.version != net.version or addr not in net:
                continue
            if exact and net.num_addresses != 1:
                continue
            return self._private_rule(i)
        return None

    def _private_rule(self, i: int) -> str:
        line = self.private_lines[i]
        label = self.source.replace("\\", "/").rsplit("/", 1)[-1] or self.source
        net = self.private_networks[i]
        text = str(net.network_address) if net.num_addresses == 1 else str(net)
        return f"{label}:{line} {text}" if line else f"{label} private_networks.allow {text}"

    def _wider_entry(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        """A private_networks.allow range that holds `addr` but may not open it (too wide)."""
        for i, net in enumerate(self.private_networks):
            if addr.version == net.version and addr in net:
                return self._private_rule(i)
        return None

    def _who_can(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address | IPNetwork,
                 label: str) -> str:
        """The end of every special-address refusal: the run cannot, the reviewer can, where."""
        text = (f"a run's allow_domains cannot open it; only the security reviewer can, by "
                f"listing it in private_networks.allow of {self.source}")
        if exact_only(label):
            one = addr.network_address if isinstance(addr, IPNetwork) else addr
            wider = self._wider_entry(one)
            text += (f" as the exact address {one} (a link-local or cloud metadata address is "
                     "never opened by a range")
            text += f"; {wider} is a range)." if wider else ")."
        else:
            text += "."
        return text

    def _reviewer_only(self, host: str, port: int | None, normalized: str,
                       parents: list[str] | None) -> Decision | None:
        """decide()'s step for an IP literal host: a special address that the policy does not
        open is denied before any allow list is looked at."""
        try:
            addr, label = _read_address(normalized)
        except ValueError:
            return None
        if label is None or self.consents(addr, label) is not None:
            return None
        return self._finish(host, port, normalized, False, REVIEWER_ONLY, self._wider_entry(addr),
                            f"{normalized} is a {label} address: " + self._who_can(addr, label),
                            True, None, parents)

    def run_pattern_refusal(self, pattern: Pattern) -> str | None:
        """Why a run may not name this allow_domains pattern (None: it may). An IP pattern of a
        special address, or a CIDR pattern wholly inside a special-purpose block, needs the
        reviewer's consent (`consents`; a CIDR: one private_networks.allow entry holding all
        of it, and never a link-local or metadata range). A CIDR that only overlaps special
        space is fine: those addresses are refused at connect time. Pure."""
        net = pattern.network
        if net is None:
            return None
        if net.num_addresses == 1:
            addr, label = _read_address(str(net.network_address))
            if label is None or self.consents(addr, label) is not None:
                return None
            return f"{addr} is a {label} address: " + self._who_can(addr, label)
        found = _special_in(net)
        if found is None:
            return None
        _block, label = found
        if exact_only(label):
            return (f"{net} is a {label} range: a run's allow_domains cannot open it, and "
                    "private_networks.allow opens a link-local or cloud metadata address only as "
                    f"that exact address (the security reviewer's, in {self.source}).")
        for other in self.private_networks:
            if other.version == net.version and net.subnet_of(other):  # type: ignore[arg-type]
                return None   # (a metadata address inside stays refused: `consents`)
        return f"{net} is a {label} range: " + self._who_can(net, label)

    def allow_domains_refusals(self, domains: Iterable[str]) -> list[tuple[int, str]]:
        """(index, message) of each allow_domains entry `run_pattern_refusal` refuses; the words
        of `sfguard validate` and the stage API. Invalid patterns are left to the schema."""
        out: list[tuple[int, str]] = []
        for i, text in enumerate(domains):
            try:
                why = self.run_pattern_refusal(parse_pattern(text, allow_list=True))
            except PatternError:
                continue
            if why is not None:
                out.append((i, f"{text!r}: {why} [{REVIEWER_ONLY}]"))
        return out

    def refuse(self, decision: Decision, reason: str, explanation: str) -> Decision:
        """A denial for a check the proxy makes itself (sni_mismatch, host_header_mismatch, ...)
        about the host of `decision`. Enforced in every mode (report mode relaxes only the lists)."""
        normalized = decision.normalized_host
        is_ip = False
        if normalized is not None:
            is_ip = ":" in normalized or normalized.replace(".", "").isdigit()
        return self._finish(decision.host, decision.port, normalized, False, reason, None,
                            explanation, is_ip)


_new, _set = object.__new__, object.__setattr__


def _make(host: str, port: int | None, normalized_host: str | None, decision: str, reason: str,
          rule: str | None, allowed_by_ip: bool, quiet: bool, explanation: str, network: str | None,
          mode: str) -> Decision:
    """A Decision without the frozen dataclass __init__ (one object.__setattr__ per field was
    the largest cost of a decision); the same object with the same fields."""
    _set(d := _new(Decision), "__dict__", {
        "host": host, "port": port, "normalized_host": normalized_host, "decision": decision,
        "reason": reason, "rule": rule, "allowed_by_ip": allowed_by_ip, "quiet": quiet,
        "explanation": explanation, "network": network, "mode": mode})
    return d


def replace(decision: Decision, **changes: Any) -> Decision:
    """A copy of `decision` with some fields changed."""
    return dataclasses.replace(decision, **changes)
