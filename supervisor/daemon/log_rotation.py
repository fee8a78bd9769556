"""Rotation of the guard's append-only logs (the decision log; the guard's own log file).

A log rotates when it reaches `max_bytes` or its first line is older than `max_age_s`: it is
renamed to `NAME.1` (older ones move up to `NAME.<keep>`; the oldest beyond `keep` is deleted)
and its writers reopen the name (proxy_addons/decision_log.py checks once a second). A line a
writer sends between the rename and its reopen ends up at the end of `NAME.1`: rotation never
loses an acknowledged line, and never holds a writer (a rename is all it does to the live file).
"""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sfguard.supervisor.daemon.runs import now_iso

log = logging.getLogger("sfguard.guard")


@dataclass(frozen=True)
class Retention:
    max_bytes: int = 64 * 1024 * 1024
    max_age_s: float = 86400.0
    keep: int = 14

    def check(self) -> None:
        if self.max_bytes < 4096 or self.max_age_s < 60 or not 1 <= self.keep <= 1000:
            raise ValueError("log retention: at least 4 KiB, 60 s and one kept file (at most 1000)")


def first_line_time(path: Path) -> float | None:
    """The `ts` of the log's first line (ISO 8601 with Z, or Unix seconds), if any."""
    try:
        with open(path, "rb") as fh:
            line = fh.readline(64 * 1024)
        ts = json.loads(line).get("ts")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(ts, (int, float)):
        return float(ts)
    if isinstance(ts, str):
        try:
            return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def rotated(path: Path, keep: int) -> list[Path]:
    """The rotated files of `path` that exist, newest first (NAME.1, NAME.2, ...)."""
    return [p for p in (path.with_name(f"{path.name}.{i}") for i in range(1, keep + 1)) if p.exists()]


def rotate_if_due(path: Path, retention: Retention, now: float | None = None) -> bool:
    """Rotate `path` when it is due; True when it did."""
    now = time.time() if now is None else now
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size == 0:
        return False
    born = first_line_time(path)
    if size < retention.max_bytes and (born is None or now - born < retention.max_age_s):
        return False
    oldest = path.with_name(f"{path.name}.{retention.keep}")
    if oldest.exists():
        oldest.unlink()
    for i in range(retention.keep - 1, 0, -1):
        src = path.with_name(f"{path.name}.{i}")
        if src.exists():
            os.rename(src, path.with_name(f"{path.name}.{i + 1}"))
    os.rename(path, path.with_name(f"{path.name}.1"))
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    log.info("rotated %s (%d bytes)", path.name, size)
    return True


#: how often the guard looks at its logs
CHECK_INTERVAL_S = 30.0


async def keep_rotated(paths: list[Path], retention: Retention, interval: float = CHECK_INTERVAL_S) -> None:
    """The guard's task: rotate each of `paths` when due, off the event loop, until cancelled."""
    while True:
        for path in paths:
            try:
                await asyncio.to_thread(rotate_if_due, path, retention)
            except OSError as exc:     # a full disk or a removed folder: said, tried again later
                log.warning("could not rotate %s: %s", path.name, exc.strerror or exc)
        await asyncio.sleep(interval)


def write_decision(path: Path, **fields: object) -> None:
    """One line of the decision log that the guard writes itself (the CDP gate's refusals);
    the run proxies write theirs to the same file (proxy_addons/decision_log.py)."""
    with open(path, "a", opener=lambda p, f: os.open(p, f, 0o600)) as fh:
        fh.write(json.dumps({"ts": now_iso(), **fields}) + "\n")
