"""This guard instance: its lock (one guard per home: `<home>/guard.lock`, flock'd, naming the
holder's pid), its start time, and what `sfguard start` opened beside the control socket (the
API's loopback TCP port, the console). `acquire()` raises `GuardAlreadyRunning` while another
guard (or `sfguard sweep`) holds the home; `release()` is idempotent."""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sfguard.errors import SfguardError


class GuardAlreadyRunning(SfguardError):
    pass


if TYPE_CHECKING:
    from sfguard.supervisor.console.server import ConsoleServer


class Instance:
    def __init__(self, home: Path):
        self.home = home
        self.started = time.time()
        self._fd: int | None = None
        self.api_tcp_port: int | None = None   # the control API's loopback TCP port (`--tcp`)
        self.console: ConsoleServer | None = None    # the operator console, unless --no-console

    def acquire(self) -> None:
        fd = os.open(self.home / "guard.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GuardAlreadyRunning(
                f"another sfguard is already running on {self.home} (one guard per home)") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
