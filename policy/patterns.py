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

Parsed patterns go into the rule index, `policy.index.RuleSet`.
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from sfguard.errors import SfguardError
from sfguard.policy.errors import MalformedHost
from sfguard.policy.hosts import join_host_port, normalize_host_ex, parse_port, split_host_port_raw

#: Shortest CIDR prefix accepted where a pattern allows (allow_domains, --allow, allow_always,
#: private_networks.allow); a wider range is refused like a bare `*`.
CATCH_ALL_V4 = 8
CATCH_ALL_V6 = 32

#: `PLAIN_NAME(text)` matches plain lower-case ASCII names (optionally "*."-prefixed) whose last
#: label is not a number: without "xn--" (punycode), such a text is already a canonical pattern
#: and needs no `parse_pattern` (the bulk path of the policy reader; lint's duplicate check).
PLAIN_NAME = re.compile(
    r"(\*\.)?((?:[a-z0-9_-]{1,63}\.)+(?!0x)(?![0-9]+\Z)[a-z0-9_-]{1,63})").fullmatch


class PatternError(SfguardError):
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
    if _PSL is None:   # public_suffix_section loads it or raises
        raise RuntimeError("the public suffix list is not loaded")
    return _PSL.exact, _PSL.wild


def public_suffix_source() -> str:
    public_suffix_section("com")
    if _PSL is None:   # public_suffix_section loads it or raises
        raise RuntimeError("the public suffix list is not loaded")
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


