"""Where the console listens: `sfguard start --console [HOST:]PORT` checked (loopback unless
`--console-public`)."""
from __future__ import annotations

import ipaddress

from sfguard.errors import SfguardError


class ConsoleError(SfguardError):
    pass


def parse_listen(value: str, public: bool) -> tuple[str, int]:
    """`[HOST:]PORT` -> (host, port). Non-loopback hosts need `public`."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    host = host.strip("[]") or "127.0.0.1"
    try:
        port_n = int(port)
        if not 0 <= port_n <= 65535:
            raise ValueError
    except ValueError:
        raise ConsoleError(f"--console wants [HOST:]PORT with a port from 0 to 65535, got {value!r}") from None
    if host != "localhost":
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ConsoleError(f"--console: {host!r} is not an IP address") from None
        if not ip.is_loopback and not public:
            raise ConsoleError(f"--console {value}: {host} is not a loopback address; the console "
                               "is for this machine's operator (add --console-public to listen "
                               "there anyway)")
    return host, port_n
