"""One run's record on disk: `<home>/records/<run>/` (0700), written as the run goes.

  timeline.jsonl  one entry per line (canonical JSON, 0600), appended with one write(2) each,
                  fsynced within a second (`RecordWriter.sync`): a killed guard loses none it
                  wrote, a power cut at most the last second. Each line carries `h`, the hash
                  of the line before it and its own body: an edited, removed or moved line
                  breaks the chain from there on.
  shots/N.jpg     the screenshots, each written whole (temp file, fsync, rename)
  index.json      what lists and searches the record (run, pipeline, profiles, outcome, dates),
                  the chain's last hash and each screenshot's hash. Written at the start and
                  again when the run ends; its digest then goes into the audit chain
                  (`run_recorded`), so an edited record is found by `sfguard runs verify`.

A run id used again (after a restart) gets `<run>~2`, `<run>~3`: a record is never appended to
by a second run. Nothing here knows what an entry means (supervisor/record/recorder.py does).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sfguard.supervisor.home import FILE_MODE, atomic_write, private_dir

RECORDS = "records"
TIMELINE = "timeline.jsonl"
INDEX = "index.json"
SHOTS = "shots"
GENESIS = "0" * 32
#: longest timeline line read back (a longer one is not an entry of ours)
MAX_LINE = 64 * 1024


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def link(prev: str, body: bytes) -> str:
    """The chain hash of one line: over the hash before it and the line without `h`."""
    return hashlib.sha256(prev.encode() + body).hexdigest()[:32]


def digest(index: dict[str, Any]) -> str:
    """The digest of an index as the audit chain keeps it."""
    return hashlib.sha256(canonical(index)).hexdigest()


class RecordWriter:
    """Appends entries and screenshots to one run's folder. Thread-safe: the audit chain's
    records arrive from the guard's store threads, everything else from its event loop."""

    def __init__(self, folder: Path):
        self.folder = private_dir(folder)
        private_dir(folder / SHOTS)
        self._lock = threading.Lock()
        self.seq, self.head, self.bytes = 0, GENESIS, 0
        self.shots: dict[str, str] = {}
        self._fd: int | None = os.open(folder / TIMELINE, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                       | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        self._dirty = False

    def append(self, entry: dict[str, Any]) -> tuple[int, int]:
        """Write one entry (its `seq` and `h` are set here); (seq, bytes written)."""
        with self._lock:
            if self._fd is None:
                return 0, 0
            entry["seq"] = self.seq + 1
            body = canonical(entry)
            h = link(self.head, body)
            line = body[:-1] + b',"h":"' + h.encode() + b'"}\n'
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
            self.seq, self.head = self.seq + 1, h
            self.bytes += len(line)
            self._dirty = True
            return self.seq, len(line)

    def add_shot(self, name: str, data: bytes) -> bool:
        """A screenshot, written whole (call off the event loop: it fsyncs); False when the
        record is closed (a picture that came after its run's end is not kept)."""
        if self._fd is None:
            return False
        atomic_write(self.folder / SHOTS / name, data)     # outside the lock: entries go on meanwhile
        with self._lock:
            if self._fd is None:          # sealed meanwhile: the picture is not part of it
                with contextlib.suppress(OSError):
                    (self.folder / SHOTS / name).unlink()
                return False
            self.shots[name] = hashlib.sha256(data).hexdigest()
            self.bytes += len(data)
            return True

    def sync(self) -> None:
        with self._lock:
            if self._fd is None or not self._dirty:
                return
            self._dirty = False
            fd = self._fd
        os.fsync(fd)

    def close(self) -> None:
        self.sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


@dataclass(frozen=True)
class Written:
    """What a timeline holds when it is sealed: its entries, last hash, screenshots, bytes."""
    seq: int
    head: str
    shots: dict[str, str]
    bytes: int


def on_disk(folder: Path) -> Written:
    """What a record left open by a killed guard holds, read back from its files (a line cut
    by the kill is left out)."""
    entries, head, _problems = read_entries(folder)
    shots = {}
    for p in sorted((folder / SHOTS).glob("*")):
        if p.suffix in (".jpg", ".png") and not p.is_symlink():
            with contextlib.suppress(OSError):
                shots[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return Written(len(entries), head, shots, size(folder))


def write_index(folder: Path, index: dict[str, Any], sync: bool = True) -> str:
    """Write the index whole (a temp file renamed over it); its digest. `sync` False: not
    fsynced (a run's first index: the guard's event loop writes it; a power cut may lose it,
    never leave half of it, and the sealed index is fsynced)."""
    atomic_write(folder / INDEX, canonical(index) + b"\n", sync=sync)
    return digest(index)


def read_index(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / INDEX).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_entries(folder: Path) -> tuple[list[dict[str, Any]], str, list[str]]:
    """Every entry of a timeline in order, the chain's last hash, and what is wrong with it (a
    line cut by a crash at the very end is left out and said; an edit breaks the chain)."""
    entries: list[dict[str, Any]] = []
    problems: list[str] = []
    head = GENESIS
    try:
        data = (folder / TIMELINE).read_bytes()
    except OSError as exc:
        return [], head, [f"no timeline ({exc.strerror or exc})"]
    lines = data.split(b"\n")
    tail = lines.pop()
    if tail:
        problems.append("the last line is incomplete (cut by a crash); it is left out")
    for n, line in enumerate(lines, 1):
        try:
            entry = json.loads(line) if len(line) <= MAX_LINE else None
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or not isinstance(entry.get("h"), str):
            problems.append(f"line {n} is not an entry")
            return entries, head, problems
        h = entry.pop("h")
        if entry.get("seq") != n or link(head, canonical(entry)) != h:
            problems.append(f"line {n} does not match the chain (edited, removed or moved)")
            return entries, head, problems
        head = h
        entries.append(entry)
    return entries, head, problems


def check(folder: Path, audited: str | set[str] | None) -> list[str]:
    """What is wrong with a record against the digest the audit chain keeps of its index
    (None: no `run_recorded` record names it; a set: each host of a fleet that sealed a record
    of that name)."""
    problems: list[str] = []
    index = read_index(folder)
    if index is None:
        return ["no readable index.json"]
    sealed = {audited} if isinstance(audited, str) else set(audited or ())
    if not sealed:
        problems.append("the audit chain has no record of this index (not sealed yet, or removed)")
    elif digest(index) not in sealed:
        problems.append("index.json does not match its digest in the audit chain (edited)")
    entries, head, found = read_entries(folder)
    problems += [p for p in found if "incomplete" not in p or index.get("state") != "abandoned"]
    if head != index.get("head") or len(entries) != index.get("entries"):
        problems.append(f"the timeline ends at entry {len(entries)} ({head[:8]}) but the index says "
                        f"{index.get('entries')} ({str(index.get('head'))[:8]})")
    shots = index.get("shots")
    for name, want in sorted(shots.items() if isinstance(shots, dict) else []):
        try:
            got = hashlib.sha256((folder / SHOTS / name).read_bytes()).hexdigest()
        except OSError:
            problems.append(f"screenshot {name} is missing")
            continue
        if got != want:
            problems.append(f"screenshot {name} does not match its hash (edited)")
    return problems


def new_folder(root: Path, run_id: str) -> Path:
    """A folder for a new record of `run_id` (`<run>`, else `<run>~2`, ...)."""
    private_dir(root)
    for n in range(1, 10000):
        path = root / (run_id if n == 1 else f"{run_id}~{n}")
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue
    raise OSError(f"too many records of run {run_id}")


def folders(root: Path) -> list[Path]:
    """Every record folder, oldest first (by their index's start)."""
    try:
        found = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    except OSError:
        return []
    return sorted(found, key=lambda p: ((read_index(p) or {}).get("started") or 0, p.name))


def find(root: Path, name: str) -> Path | None:
    """The record named `name` (a folder name), or the newest record of run `name`."""
    if name and "/" not in name and not name.startswith("."):
        exact = root / name
        if exact.is_dir() and not exact.is_symlink():
            return exact
    mine = [p for p in folders(root) if (read_index(p) or {}).get("run_id") == name]
    return mine[-1] if mine else None


def size(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += p.lstat().st_size
    return total


def prune(root: Path, keep_seconds: float, max_total: int | None = None, now: float | None = None,
          active: frozenset[str] = frozenset()) -> list[str]:
    """Remove records ended longer than `keep_seconds` ago, then the oldest ended ones while
    all together exceed `max_total` bytes; never one in `active`. The names removed."""
    now = time.time() if now is None else now
    removed: list[str] = []
    ended = [(p, read_index(p) or {}) for p in folders(root) if p.name not in active]
    ended = [(p, ix) for p, ix in ended if ix.get("state") != "active"]
    for p, ix in ended:
        if now - float(ix.get("ended") or ix.get("started") or 0) > keep_seconds:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if max_total is not None:
        left = [(p, size(p)) for p, _ in ended if p.name not in removed]
        total = sum(n for _, n in left) + sum(size(root / a) for a in active if (root / a).is_dir())
        for p, n in left:
            if total <= max_total:
                break
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
            total -= n
    return removed
