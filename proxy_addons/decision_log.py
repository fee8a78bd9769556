"""The decision log: one JSON object per line for every decision the guard enforces.

Fields: `ts, run, client, method, host, port, decision, reason, rule, addr`. Never a path, a
query, a header value or a body: the writer only accepts these fields.

Quiet denials (`Decision.quiet`, e.g. Chromium's background calls to Google) are counted and
written as one aggregate line (`"reason": "quiet_denials"`) every `aggregate_interval` seconds
and when the log is closed.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import stat
import sys
import threading
import time
from collections import Counter
from typing import IO, Any

logger = logging.getLogger("sfguard.proxy.decisions")

#: Bound on distinct hosts kept in the quiet-denial counter between two aggregate lines.
MAX_QUIET_HOSTS = 256
#: Longest host text written to the log (a malformed host can be arbitrary garbage).
MAX_HOST_CHARS = 255


_second: list[Any] = [None, ""]  # [whole second, its "YYYY-MM-DDTHH:MM:SS" text]


def _now() -> str:
    """UTC now as `YYYY-MM-DDTHH:MM:SS.mmmZ` (the date part is formatted once per second)."""
    now = time.time()
    sec = int(now)
    if _second[0] != sec:
        _second[1] = _dt.datetime.fromtimestamp(sec, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second[0] = sec
    return f"{_second[1]}.{int((now - sec) * 1000):03d}Z"


def _clean_host(host: str | None) -> str | None:
    if host is None:
        return None
    return host[:MAX_HOST_CHARS]


_encode = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode


class DecisionLog:
    """Writes decision lines to a stream (stdout) or a file opened for append with mode 0600.

    `target` is None (no log), "-" (stdout) or a path. Thread-safe.

    Durability: each line is handed to the kernel with one `write(2)` on an O_APPEND file
    descriptor while the decision is made, before the proxy answers the client, so a reader
    of the file (the console, the audit, a test) sees every line of an answered request, and
    a crash of the proxy loses none (no fsync: a crash of the machine may). One write per
    line also keeps lines whole when several processes append to the same file.

    Rotation (the guard renames the file, supervisor/daemon/log_rotation.py): at most once a
    second the writer compares the path's file with its own and reopens the path when they
    differ. Lines written in between land at the end of the renamed file: none is lost.
    """

    def __init__(self, target: str | None = None) -> None:
        self._lock = threading.Lock()
        self._own_file = False
        self._fd: int | None = None
        self._stream: IO[str] | None = None
        self._path: str | None = None
        self._checked = 0.0          # when the path was last compared with the open file
        if target == "-":
            self._stream = sys.stdout
        elif target:
            self._path = target
            self._open()
            self._own_file = True
        self._quiet: Counter[tuple[str | None, str | None, str]] = Counter()
        self._quiet_other = 0
        self.counts: Counter[str] = Counter()  # decision -> number, for status
        self.failing = False   # the last write failed (disk full): allowed requests are refused

    def write(self, *, run: str | None, client: str | None, method: str, host: str | None,
              port: int | None, decision: str, reason: str, rule: str | None,
              addr: str | None, extra: dict[str, object] | None = None) -> bool:
        """Write one decision line. False when it could not be written (a full disk): the
        caller must not let the request through (fail closed). `extra`: the write gate's own
        fields (stage, attempt, path with the query hidden, approval)."""
        self.counts[decision] += 1
        line: dict[str, object] = {
            "ts": _now(), "run": run, "client": client, "method": method,
            "host": _clean_host(host), "port": port, "decision": decision, "reason": reason,
            "rule": rule, "addr": addr,
        }
        if extra:
            line.update({k: v for k, v in extra.items() if k not in line})
        return self._emit(line)

    def count_quiet(self, *, run: str | None, client: str | None, host: str | None) -> None:
        """Count a quiet denial instead of writing it."""
        self.counts["deny"] += 1
        with self._lock:
            key = (run, client, _clean_host(host) or "")
            if key in self._quiet or len(self._quiet) < MAX_QUIET_HOSTS:
                self._quiet[key] += 1
            else:
                self._quiet_other += 1

    def flush_quiet(self) -> None:
        """Write the aggregate of quiet denials counted since the last call (if any)."""
        with self._lock:
            quiet, other = self._quiet, self._quiet_other
            self._quiet, self._quiet_other = Counter(), 0
        by_client: dict[tuple[str | None, str | None], dict[str, int]] = {}
        for (run, client, host), n in quiet.items():
            by_client.setdefault((run, client), {})[host] = n
        for (run, client), hosts in by_client.items():
            self._emit({
                "ts": _now(), "run": run, "client": client, "method": None, "host": None,
                "port": None, "decision": "deny", "reason": "quiet_denials", "rule": None,
                "addr": None, "count": sum(hosts.values()), "hosts": hosts,
            })
        if other:
            self._emit({
                "ts": _now(), "run": None, "client": None, "method": None, "host": None,
                "port": None, "decision": "deny", "reason": "quiet_denials", "rule": None,
                "addr": None, "count": other, "hosts": {},
            })

    def _open(self) -> None:
        if self._path is None:
            return
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if stat.S_ISREG(os.fstat(fd).st_mode):   # never a device's mode (`/dev/null` is everyone's)
            os.fchmod(fd, 0o600)
        old = self._stream
        self._stream = os.fdopen(fd, "a", encoding="utf-8", buffering=1)
        self._fd = fd  # lines go straight to the descriptor (one write each)
        if old is not None:
            old.close()

    def _follow_rotation(self) -> None:
        """Reopen the path when it names another file than ours (renamed by a rotation)."""
        now = time.monotonic()
        if self._path is None or self._fd is None or now - self._checked < 1.0:
            return
        self._checked = now
        try:
            st = os.stat(self._path)
            mine = os.fstat(self._fd)
            if (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev):
                return
        except FileNotFoundError:
            pass                 # renamed and not yet recreated: open makes it
        self._open()

    def _emit(self, record: dict[str, object]) -> bool:
        if self._stream is None:
            return True
        line = _encode(record) + "\n"
        with self._lock:
            try:
                self._follow_rotation()
                if self._fd is not None:
                    data = line.encode("ascii")
                    while data:  # a regular file takes it whole; loop on a short write anyway
                        data = data[os.write(self._fd, data):]
                else:
                    self._stream.write(line)
                    self._stream.flush()
            except (OSError, ValueError) as exc:  # a closed stdout must not stop the proxy
                if not self.failing:
                    logger.error("cannot write the decision log (%s): allowed requests are refused "
                                 "until it can be written again", getattr(exc, "strerror", None)
                                 or type(exc).__name__)
                self.failing = True
                return False
            if self.failing:
                logger.warning("the decision log can be written again")
                self.failing = False
            return True

    def close(self) -> None:
        """Write the quiet aggregate and close an owned file."""
        self.flush_quiet()
        with self._lock:
            if self._own_file and self._stream is not None:
                self._stream.close()
            self._stream = None
            self._fd = None
