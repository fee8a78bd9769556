"""The decision log followed as it grows: each new line of a run's proxy goes to the recorder.

The guard's decision log (`<home>/logs/decisions.log`) holds every run proxy's lines (and the
guard's own: the CDP gate's refusals and the write gate's decisions, which the recorder gets
first-hand). `follow` starts at the end of the file as it is, reads complete lines every
`POLL_S`, and follows a rotation (supervisor/daemon/log_rotation.py renames the file): what was
appended to the old file before the rename is read to its end, then the new file from its start.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sfguard.supervisor.errors import swallowed

log = logging.getLogger("sfguard.record")

POLL_S = 0.25
#: most bytes read in one poll (a burst is read over the next polls)
CHUNK = 1 << 20


class Tail:
    """Complete lines appended to a file since it was opened (or since the last call)."""

    def __init__(self, path: Path, from_end: bool = True):
        self.path = path
        self.fd: int | None = None
        self.ino: tuple[int, int] | None = None
        self.rest = b""
        self._open(from_end)

    def _open(self, from_end: bool) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        st = os.fstat(fd)
        if from_end:
            os.lseek(fd, st.st_size, os.SEEK_SET)
        self.fd, self.ino, self.rest = fd, (st.st_ino, st.st_dev), b""

    def lines(self) -> list[bytes]:
        out: list[bytes] = []
        if self.fd is None:
            self._open(from_end=False)
            if self.fd is None:
                return out
        out += self._read()
        try:
            st = os.stat(self.path)
            moved = (st.st_ino, st.st_dev) != self.ino
        except FileNotFoundError:
            moved = False             # renamed, not yet made again: the next poll opens it
        if moved:                      # rotated: the old file's end is read, then the new one
            out += self._read(to_end=True)
            self.close()
            self._open(from_end=False)
            out += self._read()
        return out

    def _read(self, to_end: bool = False) -> list[bytes]:
        assert self.fd is not None
        data = b""
        while chunk := os.read(self.fd, CHUNK):
            data += chunk
            if not to_end and len(data) >= CHUNK:
                break
        data = self.rest + data
        *whole, self.rest = data.split(b"\n")
        return [line for line in whole if line]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


async def follow(path: Path, on_line: Callable[[dict[str, Any]], None], poll: float = POLL_S) -> None:
    """Hand each new decision line (parsed) to `on_line`, until cancelled."""
    tail = await asyncio.to_thread(Tail, path)
    try:
        while True:
            with swallowed(log, "reading the decision log for the run records", (OSError,)):
                for line in await asyncio.to_thread(tail.lines):
                    try:
                        d = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(d, dict) and d.get("run"):
                        with swallowed(log, "a decision line into its run's record"):
                            on_line(d)
            await asyncio.sleep(poll)
    finally:
        tail.close()
