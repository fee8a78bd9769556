"""The rule index: which pattern of a set matches a host and port, in constant time.

`RuleSet` holds the patterns of one source (`policy.patterns` parses them). Lookup walks the
labels of the host (``a.b.example.com``, ``b.example.com``, ``example.com``, ``com``) with one or
two dict look-ups each, and an IP address with one look-up per distinct CIDR prefix length in
the set, so the cost does not grow with the number of rules. A match names its rule as
"SOURCE:LINE PATTERN" with the reason it was given.

`compile_patterns` builds the set of a run's allow_domains; the policy reader adds a file's
plain names in bulk with `RuleSet.add_plain_names`.
"""
from __future__ import annotations

import ipaddress
import socket
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from sfguard.policy.errors import PolicyError, PolicyIssue
from sfguard.policy.patterns import PLAIN_NAME, Pattern, PatternError, parse_pattern, pattern_text, psl_tables


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

    def add_plain_names(self, texts: Sequence[Any], positions: Sequence[int], line_shift: int,
                        reason: str | None) -> list[int]:
        """The policy reader's bulk path: add every text that is already a canonical plain name
        or ``*.`` wildcard (`PLAIN_NAME`, no punycode, not over a public suffix) straight into
        the index, with line `positions[i] >> line_shift`. Returns the indexes of the other
        texts, which take `parse_pattern` and `add` (with their errors)."""
        rid = self.reason_id(reason) if reason is not None else -1
        exact, wild, depth = self._exact, self._wild, self._depth
        add_line, add_reason = self._lines.append, self._reason_ix.append
        fast = PLAIN_NAME
        psl_exact, psl_wild = psl_tables()
        added = 0
        next_id = len(self._lines)
        slow: list[int] = []
        for i, text in enumerate(texts):
            if (text.__class__ is str and len(text) <= 253 and fast(text) is not None
                    and "xn--" not in text):
                if text[0] != "*":
                    table, key = exact, text
                else:
                    key = text[2:]
                    if key in psl_exact or key.partition(".")[2] in psl_wild:
                        slow.append(i)
                        continue
                    table = wild
                    labels = key.count(".") + 1
                    if labels < depth[0]:
                        depth[0] = labels
                    if labels > depth[1]:
                        depth[1] = labels
                if key not in table:
                    table[key] = next_id
                    next_id += 1
                    add_line(positions[i] >> line_shift)
                    add_reason(rid)
                    added += 1
                continue
            slow.append(i)
        self._count += added
        return slow

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
