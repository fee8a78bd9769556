"""A strict reader of the first TLS flight of a tunnel: the whole ClientHello, or nothing.

The guard decides on the server names a ClientHello carries, so it must see the complete
message before a single byte goes upstream, however the client cuts it: a one-byte first write,
a ClientHello spread over several TLS records, records cut anywhere. `read_client_hello(data)`
looks at everything the client has sent so far and answers one of:

- `NEED_MORE`: a valid prefix; wait for more bytes (the caller bounds size and time);
- a `Hello` with every `server_name` entry (type and name) and whether an encrypted
  ClientHello extension (ECH, or the older ESNI) is present;
- `BadHello(reason)`: anything malformed, including a second handshake message or a
  non-handshake record before the ClientHello is complete, a record over 2^14 bytes, empty
  records, duplicate extensions, a server_name extension whose lengths do not add up.

Protocol plumbing only: which names are acceptable is decided by the caller.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, Literal

from sfguard.errors import SfguardError

#: Largest ClientHello handshake message accepted (post-quantum key shares make ~2 KB common).
MAX_HELLO = 48 * 1024
_MAX_RECORD = 1 << 14
EXT_SERVER_NAME = 0x0000
#: encrypted_client_hello (RFC 9849 / draft 13+) and the older encrypted_server_name (ESNI).
EXT_ENCRYPTED = frozenset({0xFE0D, 0xFFCE})


class _NeedMore(enum.Enum):
    NEED_MORE = "NEED_MORE"

    def __repr__(self) -> str:
        return "NEED_MORE"


NEED_MORE: Final = _NeedMore.NEED_MORE


@dataclass(frozen=True)
class BadHello:
    reason: str


@dataclass(frozen=True)
class Hello:
    """What the guard needs of a ClientHello: every server_name entry as (type, raw name)."""

    server_names: tuple[tuple[int, bytes], ...]
    has_sni_extension: bool
    encrypted: bool   # an ECH / ESNI extension is present
    length: int       # bytes of records that carried the ClientHello


def could_be_tls(data: bytes) -> bool:
    """True when `data` starts like a TLS handshake record (one byte is enough to say)."""
    return bool(data) and data[0] == 0x16


def read_client_hello(data: bytes) -> Hello | BadHello | Literal[_NeedMore.NEED_MORE]:
    """See the module docstring."""
    handshake = bytearray()
    offset = 0
    need = None  # handshake message length once known (4-byte header included)
    while True:
        if len(data) - offset < 5:
            header = data[offset:]
            # Check what we have of the next record header, so garbage is refused at once.
            if header[:1] and header[0] != 0x16:
                return BadHello("a non-handshake record before the ClientHello was complete")
            if len(header) >= 2 and header[1] != 0x03:
                return BadHello("not a TLS record (version)")
            return NEED_MORE
        ctype, major, minor = data[offset], data[offset + 1], data[offset + 2]
        length = int.from_bytes(data[offset + 3:offset + 5], "big")
        if ctype != 0x16:
            return BadHello("a non-handshake record before the ClientHello was complete")
        if major != 0x03 or minor > 0x04:
            return BadHello("not a TLS record (version)")
        if length == 0 or length > _MAX_RECORD:
            return BadHello("a TLS record of invalid length")
        if len(data) - offset - 5 < length:
            return NEED_MORE
        handshake += data[offset + 5:offset + 5 + length]
        offset += 5 + length
        if need is None and len(handshake) >= 4:
            if handshake[0] != 0x01:
                return BadHello("the first handshake message is not a ClientHello")
            need = 4 + int.from_bytes(handshake[1:4], "big")
            if need > MAX_HELLO:
                return BadHello(f"a ClientHello over {MAX_HELLO} bytes")
        if need is not None and len(handshake) >= need:
            if len(handshake) != need:
                return BadHello("more handshake data after the ClientHello in its records")
            return _parse_body(bytes(handshake[4:need]), offset)


def _parse_body(body: bytes, length: int) -> Hello | BadHello:
    r = _Reader(body)
    try:
        r.take(2 + 32)                        # legacy_version, random
        sid = r.vec(1)
        if len(sid) > 32:
            return BadHello("a session id over 32 bytes")
        suites = r.vec(2)
        if not suites or len(suites) % 2:
            return BadHello("invalid cipher suites")
        if not r.vec(1):
            return BadHello("no compression methods")
        if r.done():
            return Hello((), False, False, length)
        exts = _Reader(r.vec(2))
        if not r.done():
            return BadHello("bytes after the extensions")
        seen: set[int] = set()
        names: list[tuple[int, bytes]] = []
        has_sni = encrypted = False
        while not exts.done():
            etype = exts.u16()
            edata = exts.vec(2)
            if etype in seen:
                return BadHello(f"extension {etype} appears twice")
            seen.add(etype)
            if etype == EXT_SERVER_NAME:
                has_sni = True
                sn = _Reader(edata)
                entries = _Reader(sn.vec(2))
                if not sn.done():
                    return BadHello("bytes after the server_name list")
                while not entries.done():
                    kind = entries.take(1)[0]
                    names.append((kind, entries.vec(2)))
                if not names:
                    return BadHello("an empty server_name list")
            elif etype in EXT_ENCRYPTED:
                encrypted = True
        return Hello(tuple(names), has_sni, encrypted, length)
    except _Short:
        return BadHello("a truncated ClientHello field")


class _Short(SfguardError):
    pass


class _Reader:
    __slots__ = ("b", "i")

    def __init__(self, b: bytes) -> None:
        self.b, self.i = b, 0

    def take(self, n: int) -> bytes:
        if self.i + n > len(self.b):
            raise _Short
        out = self.b[self.i:self.i + n]
        self.i += n
        return out

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def vec(self, width: int) -> bytes:
        return self.take(int.from_bytes(self.take(width), "big"))

    def done(self) -> bool:
        return self.i >= len(self.b)
