"""Tell systemd how the guard is doing (`Type=notify` units, docs/sfguard.service).

systemd passes a datagram socket in `$NOTIFY_SOCKET` (a path, or an abstract name written with
a leading `@`); the service sends `READY=1` once it serves and `STOPPING=1` when it begins to
tear down. Without the variable nothing is sent, so a guard started by hand is unchanged.
The protocol is a single datagram of `KEY=VALUE` lines; no library is needed for it.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("sfguard.daemon")


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to systemd. True when it was sent, False when no service
    manager asked for it or the socket could not be reached (logged: a notify must never stop
    the guard)."""
    target = os.environ.get("NOTIFY_SOCKET", "")
    if not target:
        return False
    address = "\0" + target[1:] if target.startswith("@") else target
    if not (address.startswith("\0") or address.startswith("/")):
        log.warning("NOTIFY_SOCKET is neither a path nor an abstract name; not notifying")
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("could not notify the service manager (%s): %s", state.split("=", 1)[0],
                    exc.strerror or exc)
        return False
    return True
