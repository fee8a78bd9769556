"""Tell systemd how the guard is doing (`Type=notify` units, docs/sfguard.service).

systemd passes a datagram socket in `$NOTIFY_SOCKET` (a path, or an abstract name written with
a leading `@`); the service sends `READY=1` once it serves and `STOPPING=1` when it begins to
tear down. Without the variable nothing is sent, so a guard started by hand is unchanged.
The protocol is a single datagram of `KEY=VALUE` lines; no library is needed for it. With
`WatchdogSec=` the service also sends `WATCHDOG=1` while its event loop runs (`keep_alive`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger("sfguard.daemon")
_warned: set[str] = set()      # what could not be sent, said once each (the watchdog repeats)


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
        key = state.split("=", 1)[0]
        if key not in _warned:
            _warned.add(key)
            log.warning("could not notify the service manager (%s): %s", key, exc.strerror or exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """How often to send WATCHDOG=1, in seconds: a third of the unit's WatchdogSec (systemd
    passes it as $WATCHDOG_USEC, and $WATCHDOG_PID when it is meant for one process), or None
    when no watchdog is asked of this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 3


def start_keep_alive() -> asyncio.Task | None:
    """The watchdog's pinger on the running loop, when the service manager asked for one."""
    every = watchdog_interval()
    return None if every is None else asyncio.get_running_loop().create_task(keep_alive(every))


async def keep_alive(interval: float) -> None:
    """Send WATCHDOG=1 every `interval` seconds from the event loop itself, so the pings stop
    when the loop is blocked (a stuck call, a busy loop): systemd then kills the guard
    (SIGABRT) and restarts it (Restart=on-failure), and the next start sweeps what it left."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
