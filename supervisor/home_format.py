"""The guard home's format version (`<home>/home.json`) and its migrations.

Every file the guard keeps in its home (sealed profiles, keys, leases, run records, the audit
chain and its segments) is laid out as the home's format says. `sfguard start` and every
command that writes the home bring an older home up to FORMAT with the migrations below, in
order, and record it; a read-only command reads an older home as it is. A home written by a
newer sfguard (a higher format) is refused by every command with one clear message, so an
older release never half-understands a newer layout (as the PostgreSQL schema is refused).

Formats:
  0  every home before this file existed (through commit 18d718e): no home.json.
  1  home.json; the audit log may be closed into segments (audit.d/, audit.anchor). Nothing
     of format 0 changes: the migration only records the format.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from sfguard.supervisor.home import HomeError, atomic_write

FILE = "home.json"
FORMAT = 1


class HomeFormatError(HomeError):
    """The home's format cannot be used by this sfguard (newer, or the file is damaged)."""


def _to_1(home: Path) -> None:
    """0 -> 1: nothing to rewrite (segments appear only when the log is closed)."""


#: migration from format N to N + 1
MIGRATIONS: dict[int, Callable[[Path], None]] = {0: _to_1}


def read_format(home: Path) -> int:
    """The home's format: 0 without home.json; HomeFormatError for a damaged file."""
    try:
        raw = (Path(home) / FILE).read_bytes()
    except FileNotFoundError:
        return 0
    try:
        data = json.loads(raw)
        fmt = data["format"]
        if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise HomeFormatError(f"{Path(home) / FILE} is damaged (it must say {{\"format\": N}}); "
                              "it was left as it is") from None
    return fmt


def check(home: Path) -> int:
    """Refuse a home this sfguard cannot read; its format otherwise."""
    fmt = read_format(home)
    if fmt > FORMAT:
        raise HomeFormatError(f"the guard home {home} was written by a newer sfguard (home format "
                              f"{fmt}; this one reads formats up to {FORMAT}): upgrade sfguard, "
                              "or use another home")
    return fmt


def upgrade(home: Path) -> int:
    """Bring the home up to FORMAT (each migration in order) and record it; its format before."""
    before = check(home)
    fmt = before
    while fmt < FORMAT:
        MIGRATIONS[fmt](home)
        fmt += 1
    if before != FORMAT or not os.path.exists(Path(home) / FILE):
        atomic_write(Path(home) / FILE, json.dumps({"format": FORMAT}).encode() + b"\n", 0o600)
    return before
