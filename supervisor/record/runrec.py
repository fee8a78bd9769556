"""What the recorder keeps in memory of a run while it is recorded (its files: files.py)."""
from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sfguard.supervisor.record import files
from sfguard.supervisor.record.tabs import TabWatcher


def site(url: Any) -> tuple[str | None, int | None]:
    """(host, port) of an http(s) or ws(s) address; (None, None) for anything else."""
    return _site(url) if isinstance(url, str) else (None, None)


@functools.lru_cache(maxsize=512)
def _site(url: str) -> tuple[str | None, int | None]:
    try:
        p = urlsplit(url)
        if p is None or p.scheme not in ("http", "https", "ws", "wss") or not p.hostname:
            return None, None
        return p.hostname.lower(), p.port or (443 if p.scheme in ("https", "wss") else 80)
    except ValueError:
        return None, None


@dataclass
class StageRec:
    attempt: int
    ready: bool = False
    last_event: str | None = None  # the lifecycle event written last (the same is not written twice)
    last_tab: str | None = None    # the page it last sent a command to
    pipe: Any = None               # its browser's pipe
    busy: int = 0                  # commands since the last interval picture
    last_shot: float = 0.0
    last_cmd: int | None = None    # seq of its last command
    last_t: float = 0.0            # when it sent its last command (monotonic)


@dataclass
class RunRec:
    run_id: str
    writer: files.RecordWriter
    index: dict[str, Any]
    stages: dict[str, StageRec] = field(default_factory=dict)
    watchers: dict[int, TabWatcher] = field(default_factory=dict)     # id(pipe) -> watcher
    profile_of: dict[int, str | None] = field(default_factory=dict)  # id(pipe) -> profile
    #: (monotonic time, host, seq, stage) of its latest navigating commands (links)
    navs: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    held: dict[str, int] = field(default_factory=dict)                # approval -> seq
    paused: set[str] = field(default_factory=set)                     # profiles in a handoff
    marks: set[tuple[str, str]] = field(default_factory=set)
    capped: bool = False
    dropped: int = 0
    shots: int = 0
    #: the index is written by threads (a stage's profile named, the seal): one at a time, and
    #: nothing after the seal
    index_lock: threading.Lock = field(default_factory=threading.Lock)
    sealed: bool = False
