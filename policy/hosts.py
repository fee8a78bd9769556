"""Host normalisation: one canonical spelling per host, or `MalformedHost`.

The guard compares hosts as strings, so every spelling that a browser or resolver would treat as
the same host must normalise to the same string, and every spelling that could mean different
things to different parsers is refused. The rules (docs/design.md 4.1):

- Lower case; one trailing dot removed (``example.com.`` -> ``example.com``; two -> malformed).
- IDN to A-labels with UTS #46 mapping (non-transitional, as browsers do): ``BÜCHER.de`` ->
  ``xn--bcher-kva.de``; fullwidth dots and letters are mapped first. ``xn--`` labels must be valid
  punycode.
- IPv4 only in canonical dotted-quad form. A host whose last label is a number (as the WHATWG URL
  standard defines it: all digits, or ``0x`` + hex) is an IPv4 attempt, and decimal
  (``2130706433``), octal (``0177.0.0.1``), hex (``0x7f.1``), short (``127.1``) and mixed forms
  are malformed, because browsers read them as IP addresses while naive code reads them as names.
- IPv6 with or without brackets, written back compressed (``[0:0::1]`` -> ``::1``).
  IPv4-mapped IPv6 becomes its IPv4 (``::ffff:127.0.0.1`` -> ``127.0.0.1``).
- Zone ids (``fe80::1%eth0``) are malformed: a zone names a local interface, and link-local
  addresses are never a destination for the guard. Stripping it would hide what was asked.
- Refused outright: whitespace and control characters, ``@`` (user info), ``/ ? #`` (paths,
  queries, fragments), ``\\``, ``%`` (percent-encoding, zones), ``*``, ``:`` in a name (use
  `split_host_port`), empty labels, labels over 63 and names over 253 octets.
- Underscores are allowed in labels (Chrome resolves such names and some real hosts use them);
  hyphens anywhere in a label are allowed too. Matching is label-exact, so neither widens a rule.
"""
from __future__ import annotations

import ipaddress
import re

import idna

from sfguard.policy.errors import MalformedHost

MAX_INPUT = 1024          # longer input is refused before any work is done
MAX_NAME = 253
MAX_LABEL = 63

_NAME_RE = re.compile(r"(?:[a-z0-9_-]{1,63}\.)*[a-z0-9_-]{1,63}")
_LABEL_CHARS_RE = re.compile(r"[a-z0-9_-]+")
_HEX_NUMBER_RE = re.compile(r"0x[0-9a-f]*")
_PORT_RE = re.compile(r"[0-9]{1,5}")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_IPV4_RE = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")

# Characters that never belong in a host, with the reason given for them. Checked before and
# after the UTS #46 mapping (fullwidth '＠' maps to '@', '／' to '/').
_BAD_CHARS = (
    ("@", "contains '@': user info before a host is not accepted"),
    ("/", "contains '/': give a host, not a URL or path"),
    ("\\", "contains a backslash"),
    ("?", "contains '?': give a host, not a URL with a query"),
    ("#", "contains '#': give a host, not a URL with a fragment"),
    ("%", "contains '%': percent-encoding and zone ids are not accepted"),
    ("*", "contains '*': a wildcard is a pattern, not a host"),
)
_SPACES = "\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_CTRL_OR_SPACE_RE = re.compile(f"[{_SPACES}]")
_ANY_BAD_RE = re.compile(f"[{_SPACES}@/\\\\?#%*]")


def _check_chars(text: str) -> None:
    if _ANY_BAD_RE.search(text) is None:
        return
    if _CTRL_OR_SPACE_RE.search(text):
        raise MalformedHost("contains whitespace or a control character")
    for ch, why in _BAD_CHARS:
        if ch in text:
            raise MalformedHost(why)


def _ends_in_number(last_label: str) -> bool:
    """WHATWG URL 'ends in a number': all ASCII digits, or 0x followed by hex digits."""
    return (last_label.isascii() and last_label.isdigit()) or bool(_HEX_NUMBER_RE.fullmatch(last_label))


def _ipv6(text: str) -> str:
    """Canonical text of an IPv6 literal (no brackets); IPv4-mapped -> dotted IPv4."""
    try:
        addr = ipaddress.IPv6Address(text)
    except ValueError:
        raise MalformedHost("not a valid IPv6 address") from None
    if addr.scope_id:  # unreachable ('%' is refused first); kept as a guard
        raise MalformedHost("IPv6 zone ids are not accepted")
    if addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def normalize_host_ex(text: str) -> tuple[str, bool]:
    """Normalise `text`; return (host, is_ip). Raises MalformedHost. See the module docstring."""
    if text.__class__ is not str:
        if not isinstance(text, str):
            raise MalformedHost("a host must be text")
        text = str(text)
    if not text:
        raise MalformedHost("empty host")
    if len(text) > MAX_INPUT:
        raise MalformedHost(f"longer than {MAX_INPUT} characters")
    _check_chars(text)

    if text[0] == "[" or text[-1] == "]":
        if not (text[0] == "[" and text[-1] == "]"):
            raise MalformedHost("unbalanced brackets (a port after ']' belongs to HOST:PORT, not to a host)")
        return _ipv6(text[1:-1]), True
    if ":" in text:
        if text.count(":") == 1:
            raise MalformedHost("contains ':': a port is not part of a host")
        return _ipv6(text), True

    if text.isascii():
        name = text.lower()
        if name[-1] == ".":
            name = name[:-1]
        # Fast path: plain LDH(+underscore) labels of 1-63 characters.
        if _NAME_RE.fullmatch(name) is not None and len(name) <= MAX_NAME:
            last = name[name.rfind(".") + 1:]
            if last[0] in "0123456789" and _ends_in_number(last):
                if _CANONICAL_IPV4_RE.fullmatch(name) is None:
                    raise MalformedHost(
                        "not a canonical IPv4 address (decimal, octal, hex and short forms are refused)")
                return name, True
            if "xn--" in name:
                _check_punycode(name.split("."))
            return name, False
        return _slow_name(name)

    try:
        name = idna.uts46_remap(text, std3_rules=False, transitional=False)
    except (idna.IDNAError, UnicodeError, ValueError) as exc:
        raise MalformedHost(f"not a valid international name ({exc})") from None
    _check_chars(name)
    if ":" in name or "[" in name or "]" in name:
        raise MalformedHost("contains ':' or brackets after Unicode mapping")
    if name.endswith("."):
        name = name[:-1]
    return _slow_name(name)


def _check_punycode(labels: list[str]) -> None:
    for label in labels:
        if label.startswith("xn--"):
            try:
                idna.ulabel(label)
            except (idna.IDNAError, UnicodeError, ValueError):
                raise MalformedHost(f"invalid punycode label {label[:70]!r}") from None


def _slow_name(name: str) -> tuple[str, bool]:
    """Names that missed the fast path: Unicode labels, and the reasons for refusals."""
    if not name:
        raise MalformedHost("empty host")
    labels = []
    for label in name.split("."):
        if not label:
            raise MalformedHost("empty label (two dots in a row, or a leading dot)")
        if label.isascii():
            if not _LABEL_CHARS_RE.fullmatch(label):
                raise MalformedHost("contains a character not allowed in a host name")
            labels.append(label)
            continue
        try:
            labels.append(idna.alabel(label).decode("ascii"))
        except (idna.IDNAError, UnicodeError, ValueError) as exc:
            raise MalformedHost(f"not a valid international label ({exc})") from None
    name = ".".join(labels)
    if _ends_in_number(labels[-1]):
        if _CANONICAL_IPV4_RE.fullmatch(name) is None:
            raise MalformedHost(
                "not a canonical IPv4 address (decimal, octal, hex and short forms are refused)")
        return name, True
    for label in labels:
        if len(label) > MAX_LABEL:
            raise MalformedHost(f"a label is longer than {MAX_LABEL} characters")
    _check_punycode(labels)
    if len(name) > MAX_NAME:
        raise MalformedHost(f"longer than {MAX_NAME} characters")
    return name, False


def normalize_host(text: str) -> str:
    """The canonical form of a host (no port). Raises MalformedHost. See the module docstring."""
    return normalize_host_ex(text)[0]


def parse_port(text: str) -> int:
    """A port given as text: 1 to 5 ASCII digits, 1..65535. Raises MalformedHost."""
    if not _PORT_RE.fullmatch(text):
        raise MalformedHost("the port is not a number" if text else "empty port after ':'")
    port = int(text)
    if not 1 <= port <= 65535:
        raise MalformedHost(f"port {port} is out of range (1-65535)")
    return port


def split_host_port_raw(text: str) -> tuple[str, str | None]:
    """Split HOST[:PORT] without normalising: ("[::1]:443" -> ("[::1]", "443")).

    A bare IPv6 literal (two or more ':') has no port; write "[::1]:443" for one.
    """
    if not isinstance(text, str):
        raise MalformedHost("a host must be text")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise MalformedHost("'[' without ']'")
        rest = text[end + 1:]
        if not rest:
            return text, None
        if rest[0] != ":":
            raise MalformedHost("unexpected text after ']'")
        return text[:end + 1], rest[1:]
    if text.count(":") >= 2:
        return text, None
    if ":" in text:
        host, port = text.rsplit(":", 1)
        return host, port
    return text, None


def split_host_port(text: str, default_port: int | None = None) -> tuple[str, int | None]:
    """Split and normalise "[::1]:443", "a.com:80" or "a.com". Raises MalformedHost."""
    host, port = split_host_port_raw(text)
    return normalize_host(host), (parse_port(port) if port is not None else default_port)


_PRINTABLE_LIMIT = 300


def printable_host(text: object) -> str:
    """A safe rendering of a host as asked, for logs and explanations.

    Control characters are escaped (no log injection), the text is capped, and anything before
    an '@' (user info, possibly a credential) is replaced by '<redacted>'.
    """
    if not isinstance(text, str):
        text = repr(text)
    if "@" in text:
        text = "<redacted>@" + text.rsplit("@", 1)[1]
    out = "".join(ch if ch.isprintable() and ch not in "\\" else repr(ch)[1:-1] for ch in text[:_PRINTABLE_LIMIT])
    if len(text) > _PRINTABLE_LIMIT:
        out += "..."
    return out


def join_host_port(host: str, port: int | None) -> str:
    """The one way to write HOST:PORT: ``example.com:443``, ``[2001:db8::1]:443``.

    An IPv6 literal is bracketed when a port follows (a host already in brackets is kept as
    it is); without a port the host is returned unchanged (patterns accept a bare IPv6
    address). The host is not normalised here.
    """
    if port is None:
        return host
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def url_host_port(url: str) -> tuple[str, int, bool]:
    """(normalised host, port, port named in the URL) of an http:// or https:// URL.

    The port defaults to 80 or 443 by scheme. Raises MalformedHost with a readable reason for
    another scheme, a URL without a host, a bad port or a malformed host.
    """
    from urllib.parse import urlsplit  # noqa: PLC0415 (only this helper needs it)

    if not isinstance(url, str):
        raise MalformedHost("a URL must be text")
    try:
        parts = urlsplit(url)
        explicit = parts.port
    except ValueError:
        raise MalformedHost("the URL has an invalid port") from None
    if parts.scheme not in ("http", "https"):
        raise MalformedHost("only http:// and https:// URLs are accepted")
    if not parts.hostname:
        raise MalformedHost("the URL has no host")
    port = explicit if explicit is not None else (443 if parts.scheme == "https" else 80)
    if not 1 <= port <= 65535:
        raise MalformedHost(f"port {port} is out of range (1-65535)")
    return normalize_host(parts.hostname), port, explicit is not None


def allow_pattern_for_url(url: str) -> str:
    """The allow_domains pattern that lets a browser reach `url`: its normalised host, with
    ``:PORT`` when the URL names a port (``http://[::1]:8080/`` -> ``[::1]:8080``).
    Raises MalformedHost (see `url_host_port`)."""
    host, port, explicit = url_host_port(url)
    return join_host_port(host, port if explicit else None)


def parse_resolve(items: list[str]) -> dict[str, list[str]]:
    """`--resolve HOST=IP[,IP...]` entries (like curl's) as {normalised host: [IP, ...]}; the one
    parser of every command that takes them. Raises ValueError naming the entry and the fault."""
    table: dict[str, list[str]] = {}
    for item in items:
        host, sep, ips = item.partition("=")
        if not sep or not host or not ips:
            raise ValueError(f"{item!r}: expected HOST=IP")
        try:
            name = normalize_host(host)
        except MalformedHost as exc:
            raise ValueError(f"{item!r}: {exc.reason}") from None
        for ip in ips.split(","):
            try:
                table.setdefault(name, []).append(str(ipaddress.ip_address(ip.strip().strip("[]"))))
            except ValueError:
                raise ValueError(f"{item!r}: {ip.strip()!r} is not an IP address") from None
    return table
