"""Host patterns and the rule index that matches hosts against them.

Pattern forms (docs/design.md 4.1), each with an optional ``:PORT`` suffix that restricts it to that
port (IPv6 with a port needs brackets: ``[::1]:8080``, ``[fd00::/8]:8080``):

==================  =========================================================================
``example.com``     exactly that host
``*.example.com``   example.com AND every subdomain (as agent-browser's own allowlist)
``192.0.2.10``      that IPv4 address (canonical dotted form only)
``2001:db8::1``     that IPv6 address; ``::ffff:a.b.c.d`` is read as the IPv4 a.b.c.d
``10.0.0.0/8``      every address in the CIDR range (host bits must be zero)
==================  =========================================================================

Where a pattern allows (allow lists, ``allow_always``, ``private_networks.allow``) an IP range
wider than ``/8`` (IPv4) or ``/32`` (IPv6) is refused as a catch-all, like ``*`` alone, unless
it lies inside one special-purpose block (``fd00::/8`` inside the ULA block ``fc00::/7``).
Anything else is an error with a hint: ``*`` alone, a wildcard that is not the whole leftmost
label (``a*.b.com``, ``a.*.com``), ``.example.com`` (write ``*.example.com``), a wildcard over a
public suffix (``*.com``, ``*.co.uk``), empty labels, URLs, malformed hosts.

Public suffixes come from the list bundled with the ``publicsuffix2`` package (installed with
mitmproxy; read from disk, never fetched); a small built-in list is used if it is missing.
Suffixes of the list's ICANN section (``com``, ``co.uk``) are refused under a wildcard
everywhere. Suffixes of its PRIVATE section (``github.io``, ``googleapis.com``) are refused under
a wildcard in allow lists only: allowing every GitHub Pages site is never what a reviewer means,
while blocking or quieting all of them is safe.

`RuleSet` is the index. Lookup walks the labels of the host (``a.b.example.com``,
``b.example.com``, ``example.com``, ``com``) with one or two dict look-ups each, and an IP
address with one look-up per distinct CIDR prefix length in the set, so the cost does not grow
with the number of rules.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from sfguard.policy.errors import MalformedHost, PolicyError, PolicyIssue
from sfguard.policy.hosts import join_host_port, normalize_host_ex, parse_port, split_host_port_raw

#: Shortest CIDR prefix accepted where a pattern allows (allow_domains, --allow, allow_always,
#: private_networks.allow); a wider range is refused like a bare `*`.
CATCH_ALL_V4 = 8
CATCH_ALL_V6 = 32


class PatternError(ValueError):
    """A pattern that cannot be used; `hint` says what to write instead."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class Pattern:
    """A parsed pattern. kind: "name" | "wild" | "ip" | "cidr"; `key` is the canonical host
    (for "wild": the domain after ``*.``), IP, or CIDR text; `port` None means any port."""

    kind: str
    key: str
    port: int | None = None

    @property
    def text(self) -> str:
        return pattern_text(self.kind, self.key, self.port)

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
        if self.kind in ("ip", "cidr"):
            return ipaddress.ip_network(self.key)
        return None

    def __str__(self) -> str:
        return self.text


def pattern_text(kind: str, key: str, port: int | None) -> str:
    """The canonical spelling of a pattern."""
    return join_host_port("*." + key if kind == "wild" else key, port)


# ---------------------------------------------------------------------------------------------
# Public suffixes

_BUILTIN_SUFFIXES = {
    # Used only when publicsuffix2's bundled list cannot be read. Every single label is a public
    # suffix anyway (the list's default rule), so these are the common multi-label ones.
    "co.uk": "icann", "org.uk": "icann", "ac.uk": "icann", "gov.uk": "icann", "com.au": "icann",
    "net.au": "icann", "org.au": "icann", "co.jp": "icann", "ne.jp": "icann", "or.jp": "icann",
    "com.br": "icann", "com.cn": "icann", "net.cn": "icann", "org.cn": "icann", "co.in": "icann",
    "co.nz": "icann", "co.za": "icann", "com.mx": "icann", "com.tr": "icann", "co.kr": "icann",
    "github.io": "private", "googleapis.com": "private", "appspot.com": "private",
    "blogspot.com": "private", "herokuapp.com": "private", "cloudfront.net": "private",
    "azurewebsites.net": "private", "s3.amazonaws.com": "private", "vercel.app": "private",
    "netlify.app": "private", "pages.dev": "private", "workers.dev": "private",
}


class _PublicSuffixes:
    """Exact, wildcard and exception rules of the public suffix list, keyed by A-label text."""

    def __init__(self) -> None:
        self.exact: dict[str, str] = {}
        self.wild: dict[str, str] = {}
        self.exceptions: set[str] = set()
        self.source = "built-in list"
        try:
            import publicsuffix2  # noqa: PLC0415 (loaded lazily: only wildcards need it)

            path = os.path.join(os.path.dirname(publicsuffix2.__file__), "public_suffix_list.dat")
            with open(path, encoding="utf-8") as fh:
                self._read(fh)
            self.source = path
        except (ImportError, OSError, UnicodeError):
            self.exact = dict(_BUILTIN_SUFFIXES)

    def _read(self, lines: Iterable[str]) -> None:
        import idna  # noqa: PLC0415

        section = "icann"
        for raw in lines:
            line = raw.strip()
            if line.startswith("// ===BEGIN PRIVATE"):
                section = "private"
            if not line or line.startswith("//"):
                continue
            rule = line.split()[0]
            table: dict[str, str] | None = self.exact
            if rule.startswith("!"):
                table, rule = None, rule[1:]
            elif rule.startswith("*."):
                table, rule = self.wild, rule[2:]
            try:
                rule = rule if rule.isascii() else idna.encode(rule, uts46=True).decode("ascii")
            except (idna.IDNAError, UnicodeError):
                continue
            rule = rule.lower()
            if table is None:
                self.exceptions.add(rule)
            else:
                table.setdefault(rule, section)

    def section(self, domain: str) -> str | None:
        """"icann" or "private" if `domain` is itself a public suffix, else None."""
        if "." not in domain:
            return "icann"  # the default rule: every top-level label
        found = self.exact.get(domain)
        if found:
            return found
        parent = domain.split(".", 1)[1]
        found = self.wild.get(parent)
        if found and domain not in self.exceptions:
            return found
        return None


_PSL: _PublicSuffixes | None = None


def public_suffix_section(domain: str) -> str | None:
    """"icann"/"private" when the canonical `domain` is a public suffix, else None."""
    global _PSL
    if _PSL is None:
        _PSL = _PublicSuffixes()
    return _PSL.section(domain)


def psl_tables() -> tuple[dict[str, str], dict[str, str]]:
    """The exact and wildcard rule tables, for the bulk loader's inline check (a domain with
    two or more labels can only be a public suffix if it is in one of them)."""
    public_suffix_section("com")
    assert _PSL is not None
    return _PSL.exact, _PSL.wild


def public_suffix_source() -> str:
    public_suffix_section("com")
    assert _PSL is not None
    return _PSL.source


# ---------------------------------------------------------------------------------------------
# Parsing

def _ipv4_hint(body: str) -> str | None:
    """For a non-canonical IPv4 form ('0177.0.0.1', '2130706433'), the canonical one."""
    try:
        return socket.inet_ntoa(socket.inet_aton(body))
    except (OSError, ValueError):
        return None


def _parse_network(body: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        net = ipaddress.ip_network(body, strict=True)
    except ValueError as exc:
        try:
            loose = ipaddress.ip_network(body, strict=False)
        except ValueError:
            addr = body.split("/", 1)[0]
            if "." in addr and ":" not in addr and not all(c.isdigit() or c == "." for c in addr):
                raise PatternError("patterns name hosts, not URLs or paths",
                                   f"write the host only: {addr}") from None
            fixed = _ipv4_hint(addr)
            if fixed and fixed != addr:
                hint = (f"write the address as four decimal numbers without leading zeros "
                        f"(browsers read {addr} as {fixed})")
            else:
                hint = ("write a range such as 10.0.0.0/8 or fd00::/8 (prefix lengths: 0-32 for "
                        "IPv4, 0-128 for IPv6)")
            raise PatternError(f"not a valid CIDR range ({exc})", hint) from None
        raise PatternError("a CIDR range must have its host bits zero", f"write {loose}") from None
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96:
        mapped = net.network_address.ipv4_mapped
        if mapped is not None:
            net = ipaddress.IPv4Network(f"{mapped}/{net.prefixlen - 96}")
    return net


def _inside_special_block(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    from sfguard.policy.engine import exempting_network  # noqa: PLC0415 (engine imports this module)

    return exempting_network(net)


def parse_pattern(text: object, *, allow_list: bool = True) -> Pattern:
    """Parse one pattern. `allow_list` makes wildcards over private-section public suffixes an
    error too (see the module docstring). Raises PatternError with a hint."""
    if not isinstance(text, str):
        raise PatternError("a pattern must be text", 'quote it, e.g. "*.example.com"')
    if not text:
        raise PatternError("empty pattern", "name a host such as example.com, or remove the entry")
    if text != text.strip():
        raise PatternError("a pattern has no spaces around it", f"write {text.strip()!r}")
    if "://" in text:
        host = text.split("://", 1)[1].split("/", 1)[0].split("@")[-1]
        raise PatternError("patterns name hosts, not URLs", f"write the host only: {host}")

    try:
        body, port_text = split_host_port_raw(text)
    except MalformedHost as exc:
        raise PatternError(f"not a valid pattern: {exc.reason}",
                           "IPv6 with a port is written [2001:db8::1]:443") from None
    port = None
    if port_text is not None:
        try:
            port = parse_port(port_text)
        except MalformedHost as exc:
            raise PatternError(f"bad port: {exc.reason}", "ports are 1-65535, e.g. example.com:8443") from None
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
        if ":" not in body:
            raise PatternError("brackets hold only IPv6 addresses", f"write {body}")

    if "/" in body and "*" not in body:
        net = _parse_network(body)
        if allow_list and net.prefixlen < (CATCH_ALL_V4 if net.version == 4 else CATCH_ALL_V6) \
                and not _inside_special_block(net):
            widest = "/8" if net.version == 4 else "/32"
            raise PatternError(
                f"{net} is a catch-all: an IP range wider than {widest} would match a large part of "
                "the Internet",
                f"name the hosts, or a range of {widest} or narrower (e.g. "
                f"{'10.0.0.0/8' if net.version == 4 else '2001:db8::/32'})")
        if net.prefixlen == net.max_prefixlen:
            return Pattern("ip", str(net.network_address), port)
        return Pattern("cidr", str(net), port)

    if "*" in body:
        if body == "*":
            raise PatternError("a bare * would match every host",
                               "name the sites instead, e.g. *.example.com")
        rest = body[2:]
        if not body.startswith("*.") or "*" in rest:
            tail = body.rsplit("*", 1)[1].lstrip(".")
            if "." in tail and "*" not in tail and "/" not in tail:
                hint = f"a * must be the whole leftmost label: write *.{tail} (it also matches {tail})"
            else:
                hint = "a * must be the whole leftmost label, as in *.example.com"
            raise PatternError("a wildcard must be the whole leftmost label", hint)
        try:
            domain, is_ip = normalize_host_ex(rest)
        except MalformedHost as exc:
            raise PatternError(f"not a valid host after '*.': {exc.reason}", _host_hint(rest, exc)) from None
        if is_ip:
            raise PatternError("a wildcard cannot prefix an IP address",
                               "write the address alone, or a CIDR range such as 10.0.0.0/8")
        section = public_suffix_section(domain)
        if section == "icann" or (section == "private" and allow_list):
            raise PatternError(
                f"*.{domain} would match every site under the public suffix {domain}",
                f"name a registrable domain, e.g. *.example.{domain}")
        return Pattern("wild", domain, port)

    if body.startswith("."):
        rest = body.lstrip(".")
        raise PatternError("a pattern cannot start with a dot",
                           f"write *.{rest} (the domain and its subdomains) or {rest} (that host only)")
    try:
        host, is_ip = normalize_host_ex(body)
    except MalformedHost as exc:
        raise PatternError(f"not a valid host: {exc.reason}", _host_hint(body, exc)) from None
    return Pattern("ip" if is_ip else "name", host, port)


def _host_hint(body: str, exc: MalformedHost) -> str | None:
    if "canonical IPv4" in exc.reason:
        fixed = _ipv4_hint(body)
        if fixed:
            return (f"write the address as four decimal numbers without leading zeros "
                    f"(browsers read {body} as {fixed})")
        return "write the address as four decimal numbers, e.g. 192.0.2.1"
    if "@" in body:
        return f"write the host only: {body.rsplit('@', 1)[1]}"
    if "/" in body:
        return f"write the host only: {body.split('/', 1)[0]}"
    if "empty label" in exc.reason:
        return "remove the doubled or leading dot"
    if "longer than" in exc.reason:
        return "labels are at most 63 characters, names at most 253"
    return None


# ---------------------------------------------------------------------------------------------
# The index

class Match:
    """The rule that matched: `rule` is "SOURCE PATTERN", e.g. "sites.yaml:23 *.linkedin.com";
    `network` is set for IP and CIDR patterns (the range they cover)."""

    __slots__ = ("rule", "pattern", "kind", "port", "reason", "network")

    def __init__(self, rule: str, pattern: str, kind: str, port: int | None, reason: str | None,
                 network: str | None):
        self.rule, self.pattern, self.kind = rule, pattern, kind
        self.port, self.reason, self.network = port, reason, network

    def __repr__(self) -> str:
        return f"Match({self.rule!r}, reason={self.reason!r})"


_K = TypeVar("_K")

_V4_MASKS = [((1 << 32) - 1) ^ ((1 << (32 - p)) - 1) for p in range(33)]
_V6_MASKS = [((1 << 128) - 1) ^ ((1 << (128 - p)) - 1) for p in range(129)]


def suffixes(host: str) -> list[str]:
    """`host` and each parent domain, deepest first: a.b.com -> [a.b.com, b.com, com]."""
    out = [host]
    i = host.find(".")
    while i >= 0:
        out.append(host[i + 1:])
        i = host.find(".", i + 1)
    return out


class RuleSet:
    """An index of patterns from one source.

    `source` labels the rules: with line numbers, a rule reads "sites.yaml:23 *.linkedin.com";
    without (a run's allow_domains), "--allow *.example.com".

    Names: dicts keyed by the canonical host (exact) or domain (wildcard); a lookup tries the
    host, then its parent domains, but only those whose label count lies between the shortest
    and the longest wildcard domain in the set. IPs: exact in the same dict; CIDRs in one dict
    per prefix length, longest first.
    """

    def __init__(self, source: str = "--allow"):
        self.source = source
        self._exact: dict[str, int] = {}          # names and IP literals
        self._exact_p: dict[tuple[str, int], int] = {}
        self._wild: dict[str, int] = {}
        self._wild_p: dict[tuple[str, int], int] = {}
        self._depth = [255, 0]                    # fewest and most labels of wildcard domains
        # CIDRs: {version: {prefixlen: {network int: rule id}}}; with a port: {(int, port): id}
        self._cidr: dict[int, dict[int, dict[int, int]]] = {4: {}, 6: {}}
        self._cidr_p: dict[int, dict[int, dict[tuple[int, int], int]]] = {4: {}, 6: {}}
        self._plens: dict[int, list[int]] = {4: [], 6: []}
        self._plens_p: dict[int, list[int]] = {4: [], 6: []}
        self._lines = array("l")
        self._reason_ix = array("l")
        self._reasons: list[str] = []
        self._reason_ids: dict[str, int] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, pattern: Pattern, line: int | None = None, reason: str | None = None) -> bool:
        """Add a pattern; False if the same pattern was already there (the first one is kept)."""
        port = pattern.port
        if pattern.kind in ("name", "ip"):
            if port is None:
                return self._insert(self._exact, pattern.key, line, reason)
            return self._insert(self._exact_p, (pattern.key, port), line, reason)
        if pattern.kind == "wild":
            self.note_depth(pattern.key.count(".") + 1)
            if port is None:
                return self._insert(self._wild, pattern.key, line, reason)
            return self._insert(self._wild_p, (pattern.key, port), line, reason)
        net = ipaddress.ip_network(pattern.key)
        base = int(net.network_address)
        if port is None:
            return self._insert(self._cidr_table(self._cidr, self._plens, net), base, line, reason)
        return self._insert(self._cidr_table(self._cidr_p, self._plens_p, net), (base, port), line, reason)

    @staticmethod
    def _cidr_table(tables: dict[int, dict[int, dict[_K, int]]], plens: dict[int, list[int]],
                    net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> dict[_K, int]:
        """The table of `net`'s IP version and prefix length (made on first use)."""
        plen, version = net.prefixlen, net.version
        table = tables[version].get(plen)
        if table is None:
            table = tables[version][plen] = {}
            plens[version].append(plen)
            plens[version].sort(reverse=True)  # longest prefix first
        return table

    def _insert(self, table: dict[_K, int], key: _K, line: int | None, reason: str | None) -> bool:
        if key in table:
            return False
        table[key] = len(self._lines)
        self._lines.append(line or 0)
        self._reason_ix.append(self.reason_id(reason) if reason is not None else -1)
        self._count += 1
        return True

    def note_depth(self, labels: int) -> None:
        if labels < self._depth[0]:
            self._depth[0] = labels
        if labels > self._depth[1]:
            self._depth[1] = labels

    def reason_id(self, reason: str) -> int:
        rid = self._reason_ids.get(reason)
        if rid is None:
            rid = self._reason_ids[reason] = len(self._reasons)
            self._reasons.append(reason)
        return rid

    def _match(self, rid: int, kind: str, key: str, port: int | None) -> Match:
        text = pattern_text(kind, key, port)
        line = self._lines[rid]
        ri = self._reason_ix[rid]
        network = None
        if kind == "ip":
            network = key + ("/128" if ":" in key else "/32")
        elif kind == "cidr":
            network = key
        return Match(f"{self.source}:{line} {text}" if line else f"{self.source} {text}", text, kind,
                     port, self._reasons[ri] if ri >= 0 else None, network)

    def match(self, host: str, is_ip: bool, port: int | None, port_only: bool = False,
              parents: list[str] | None = None) -> Match | None:
        """The most specific rule matching the canonical `host`: port-specific rules first, then
        the exact host, then wildcards from the deepest domain up (for IPs: exact, then the
        longest CIDR prefix). `port_only`: only rules with that explicit port. `parents`:
        `suffixes(host)`, when the caller already has it."""
        if is_ip:
            return self._match_ip(host, port, port_only)
        if port is not None and self._exact_p:
            rid = self._exact_p.get((host, port))
            if rid is not None:
                return self._match(rid, "name", host, port)
        if not port_only:
            rid = self._exact.get(host)
            if rid is not None:
                return self._match(rid, "name", host, None)
        wild_p = self._wild_p if port is not None else None
        if not (wild_p or (self._wild and not port_only)):
            return None
        if parents is None:
            parents = suffixes(host)
        n = len(parents)
        fewest, most = self._depth
        # parents[i] has n - i labels; keep those with fewest <= labels <= most.
        start = n - most if n > most else 0
        stop = n - fewest + 1
        if wild_p and port is not None:
            wild = None if port_only else self._wild
            for i in range(start, stop):
                domain = parents[i]
                rid = wild_p.get((domain, port))
                if rid is not None:
                    return self._match(rid, "wild", domain, port)
                if wild is not None:
                    rid = wild.get(domain)
                    if rid is not None:
                        return self._match(rid, "wild", domain, None)
            return None
        get = self._wild.get
        for i in range(start, stop):
            rid = get(parents[i])
            if rid is not None:
                return self._match(rid, "wild", parents[i], None)
        return None

    def _match_ip(self, host: str, port: int | None, port_only: bool) -> Match | None:
        if port is not None and self._exact_p:
            rid = self._exact_p.get((host, port))
            if rid is not None:
                return self._match(rid, "ip", host, port)
        if not port_only:
            rid = self._exact.get(host)
            if rid is not None:
                return self._match(rid, "ip", host, None)
        version = 6 if ":" in host else 4
        if not (self._plens[version] or self._plens_p[version]):
            return None
        value = int.from_bytes(socket.inet_pton(socket.AF_INET6 if version == 6 else socket.AF_INET, host), "big")
        masks = _V6_MASKS if version == 6 else _V4_MASKS
        if port is not None:
            for plen in self._plens_p[version]:
                base = value & masks[plen]
                rid = self._cidr_p[version][plen].get((base, port))
                if rid is not None:
                    net = ipaddress.ip_network((base, plen))
                    return self._match(rid, "cidr", str(net), port)
        if port_only:
            return None
        for plen in self._plens[version]:
            base = value & masks[plen]
            rid = self._cidr[version][plen].get(base)
            if rid is not None:
                net = ipaddress.ip_network((base, plen))
                return self._match(rid, "cidr", str(net), None)
        return None

    def patterns(self) -> list[str]:
        """Every pattern in the set (canonical text), for display; O(rules)."""
        out = [pattern_text("name", k, None) for k in self._exact]
        out += [pattern_text("name", k, p) for k, p in self._exact_p]
        out += [pattern_text("wild", k, None) for k in self._wild]
        out += [pattern_text("wild", k, p) for k, p in self._wild_p]
        for tables in self._cidr.values():
            for plen, table in tables.items():
                out += [str(ipaddress.ip_network((b, plen))) for b in table]
        for tables_p in self._cidr_p.values():
            for plen, table_p in tables_p.items():
                out += [pattern_text("cidr", str(ipaddress.ip_network((b, plen))), p) for b, p in table_p]
        return out


def compile_patterns(patterns: Iterable[str], source: str = "--allow") -> RuleSet:
    """A run's allow_domains as a RuleSet. Raises PolicyError with every bad entry, each with
    field "allow_domains[i]" and a hint. Empty strings are errors; an empty list is fine."""
    if isinstance(patterns, str):
        patterns = [patterns]
    rules = RuleSet(source)
    issues: list[PolicyIssue] = []
    for i, text in enumerate(patterns):
        try:
            rules.add(parse_pattern(text, allow_list=True))
        except PatternError as exc:
            issues.append(PolicyIssue(source, None, None, f"allow_domains[{i}]",
                                      f"{exc.message}: {_show(text)}", exc.hint))
    if issues:
        raise PolicyError(issues)
    return rules


def _show(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = text if len(text) <= 120 else text[:120] + "..."
    return repr(text) if isinstance(value, str) else text
