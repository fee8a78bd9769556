"""The audit trail: append-only JSON lines, each record chained to the one before.

    sink = LocalAuditSink(home)                # keys: the home's KeyProvider
    sink.record("profile_leased", profile="shop", run="r1", scope="local")
    sink.verify()                              # `sfguard audit verify`: any edit, cut or reorder

`<home>/audit.log` (0600), one record per line::

    {"event": "profile_leased", "fields": {"profile": "shop", "run": "r1", "scope": "local"},
     "hash": "<sha256>", "mac": "<HMAC-SHA256>", "prev": "<hash of the previous record>",
     "seq": 7, "ts": 1764679...}                # and "kid": N when key version N > 1 keys it

Beside it: `audit.head` (the last `seq` and `hash`, keyed), `audit.lock` (flock of every
append), `audit.d/<first seq, 12 digits>.log` (closed segments: SEGMENT_BYTES, SEGMENT_AGE_S)
and `audit.anchor` (where the chain starts after `archive(keep_from_seq)`, keyed). Only the
events and fields of audit_chain.py are accepted, each validated: never a cookie or token
value. The chain's pure part (hashes, MACs, the walk) is audit_chain.py; key versions and
`switch_key`, audit_versions.py.

Why a keyed chain, the head, segments and the anchor: docs/decisions/0027-audit-chain.md.
"""
from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sfguard.supervisor.home import FILE_MODE, atomic_write, ensure_home
from sfguard.supervisor.profiles.audit_chain import (
    EVENTS,
    FIELDS,
    GENESIS,
    AuditFieldError,
    ChainEnd,
    ChainKeys,
    canonical,
    chain_record,
    check_head,
    clean_fields,
    head_mac,
    record_hash,
    record_kid,
    record_mac,
    record_matches,
    walk_chain,
)
from sfguard.supervisor.profiles.audit_versions import AuditKeyVersions, mark_json
from sfguard.supervisor.profiles.keys import KeyMissing
from sfguard.supervisor.protocols import ProfileError, VerifyResult

#: what other modules import from here (the chain's names live in audit_chain.py)
__all__ = ["EVENTS", "FIELDS", "GENESIS", "AuditFieldError", "ChainEnd", "VerifyResult", "canonical",
           "chain_record", "check_head", "clean_fields", "head_mac", "record_hash", "record_mac",
           "record_matches", "walk_chain", "LocalAuditSink", "LOG_FILE", "HEAD_FILE", "LOCK_FILE",
           "SEGMENT_DIR", "ANCHOR_FILE", "ARCHIVE_DIR"]

LOG_FILE = "audit.log"
HEAD_FILE = "audit.head"
LOCK_FILE = "audit.lock"
SEGMENT_DIR = "audit.d"
ANCHOR_FILE = "audit.anchor"
ARCHIVE_DIR = "audit.archive"
#: the active log is closed into a segment at this size, or when its first record is this old
SEGMENT_BYTES = 8 * 1024 * 1024
SEGMENT_AGE_S = 30 * 86400
_SEGMENT_RE = re.compile(r"^(\d{12})\.log$")

class LocalAuditSink(AuditKeyVersions):
    """AuditSink writing `<home>/audit.log` with a keyed hash chain and a head file.

    `keys` is the KeyProvider (default: `default_key_provider(home)`, as the profile store).
    `read_only` (`sfguard audit verify|show`): create nothing, neither the home nor the lock."""

    def __init__(self, home: Path, keys: Any = None, read_only: bool = False,
                 segment_bytes: int = SEGMENT_BYTES, segment_age_s: float = SEGMENT_AGE_S):
        self.read_only = read_only
        self.home = Path(home) if read_only else ensure_home(home)
        self.log_path = self.home / LOG_FILE
        self.head_path = self.home / HEAD_FILE
        self.lock_path = self.home / LOCK_FILE
        self.segment_dir = self.home / SEGMENT_DIR
        self.anchor_path = self.home / ANCHOR_FILE
        self.segment_bytes, self.segment_age_s = segment_bytes, segment_age_s
        if keys is None:
            from sfguard.supervisor.profiles.keys import default_key_provider  # noqa: PLC0415
            keys = default_key_provider(self.home)
        self.keys = keys
        self._keys: dict[int, bytes] = {}

    def _evidence(self) -> str | None:
        """Why this home must have audit records, or None (a fresh home)."""
        profiles = self.home / "profiles"
        try:
            if next(profiles.rglob("profile.sealed"), None) is not None:
                return "the home holds sealed profiles"
        except OSError:
            pass
        try:
            if self._audit_key(create=False) is not None:
                return "the audit key exists, so keyed records were written"
        except (ProfileError, OSError):  # KeyMissing, KeyStateError, unreadable: a damaged key is evidence too
            return "the audit key exists, so keyed records were written"
        return None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self.read_only and not os.path.lexists(self.lock_path):
            # record() creates the lock before its first line: no lock, no writer to wait for
            yield
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _head(self) -> tuple[int, str] | None:
        head = self._head_full()
        return None if head is None else (head[0], head[1])

    def _head_full(self) -> tuple[int, str, str | None] | None:
        return _keyed_mark(self.head_path)

    def _last_line_record(self) -> tuple[int, str] | tuple[int, str, int] | None:
        """(seq, hash) of the log's last line, read from the end (the log may be large)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                end = fh.tell()
                if end == 0:
                    return None
                pos, tail = end, b""
                while pos > 0 and tail.count(b"\n") < 2:
                    step = min(4096, pos)
                    pos -= step
                    fh.seek(pos)
                    tail = fh.read(step) + tail
                last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
                rec = json.loads(last)
                if "mac" in rec:
                    return int(rec["seq"]), str(rec["hash"]), record_kid(rec) or 1
                return int(rec["seq"]), str(rec["hash"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            return (-1, "")

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one validated record and return it. AuditFieldError for unknown input."""
        clean = clean_fields(event, fields)
        with self._locked():
            return self._append(event, clean)

    def _append(self, event: str, clean: dict[str, Any]) -> dict[str, Any]:
        """Under the lock: append a record keyed by the current key version, after the
        `key_rotated` record when the chain's last record is keyed by an older one."""
        last_kid = self._last_kid()
        kid = max(self.keys.current_version(), last_kid or 1)
        if last_kid is not None and last_kid < kid:
            self._tie(last_kid, kid)
        # Continue the chain from the head file (the truth), else from the log's last line.
        last = self._head() or self._last_line_record() or (0, GENESIS)
        key = self._audit_key(True, kid)
        if key is None:         # a provider asked to create the key returns it
            raise KeyMissing("the key provider gave no audit key to write with")
        return self._write(chain_record(key, last[0], last[1], event, clean, kid=kid), key)

    def _write(self, rec: dict[str, Any], key: bytes) -> dict[str, Any]:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                     FILE_MODE)
        try:
            os.write(fd, canonical(rec) + b"\n")
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        head = {"seq": rec["seq"], "hash": rec["hash"], "mac": head_mac(key, rec["seq"], rec["hash"])}
        if rec.get("kid", 1) != 1:
            head["kid"] = rec["kid"]
        atomic_write(self.head_path, canonical(head))
        self._close_segment_if_due(size, rec["ts"])
        return rec

    def _first_record(self, path: Path) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as fh:
                first = fh.readline(1024 * 1024)
            rec = json.loads(first)
            return rec if isinstance(rec, dict) else None
        except (OSError, ValueError):
            return None

    def _close_segment_if_due(self, size: int, now: float, force: bool = False) -> None:
        """Under the lock: close audit.log into audit.d/<first seq>.log when it is big or old
        enough (or `force`). The head stays as it is (it names the last record, wherever that lives)."""
        first = self._first_record(self.log_path)
        if first is None or not isinstance(first.get("seq"), int):
            return
        age = now - float(first.get("ts") or now)
        if not force and size < self.segment_bytes and age < self.segment_age_s:
            return
        folder = self.segment_dir
        folder.mkdir(mode=0o700, exist_ok=True)
        target = folder / f"{first['seq']:012d}.log"
        if target.exists():        # never overwrite a segment (a damaged home): keep appending
            return
        os.rename(self.log_path, target)
        for d in (folder, self.home):       # the rename survives a crash
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def segments(self) -> list[Path]:
        """Closed segments, oldest first (by the first seq in their name); other files in
        audit.d are not segments and are reported by verify()."""
        try:
            names = sorted(n for n in os.listdir(self.segment_dir) if _SEGMENT_RE.fullmatch(n))
        except FileNotFoundError:
            return []
        return [self.segment_dir / n for n in names]

    def _files(self) -> list[Path]:
        return [*self.segments(), self.log_path]

    def _anchor(self) -> tuple[int, str, str | None] | None:
        return _keyed_mark(self.anchor_path)

    def archive(self, keep_from_seq: int, into: Path | None = None) -> list[Path]:
        """Move every closed segment whose records all come before `keep_from_seq` into
        `into` (default <home>/audit.archive/), record `audit_archived` in the chain and write
        the keyed anchor that lets verify() start the chain after them. The chain must verify
        first (an archive never hides damage). Returns the moved files' new paths."""
        if self.read_only:
            raise AuditFieldError("a read-only audit sink cannot archive")
        result = self.verify()
        if not result.ok:
            raise AuditFieldError(f"the audit log does not verify, nothing archived: {result}")
        key = self._audit_key(create=False)
        if key is None:
            raise KeyMissing("archiving needs the audit key (the anchor is keyed)")
        kid = self.keys.current_version()
        target = Path(into) if into is not None else self.home / ARCHIVE_DIR
        moved: list[Path] = []
        with self._locked():
            segs = self.segments()
            starts = [int(p.name[:12]) for p in segs]
            # a segment goes when the next file starts at or before keep_from_seq
            bounds = starts[1:] + [self._first_seq_of_log()]
            last_moved: tuple[int, str] | None = None
            for seg, nxt in zip(segs, bounds, strict=True):
                if nxt is None or nxt > keep_from_seq:
                    break
                last = _last_record_of(seg)
                if last is None:
                    break
                target.mkdir(mode=0o700, parents=True, exist_ok=True)
                dest = target / seg.name
                os.replace(seg, dest)
                moved.append(dest)
                last_moved = last
            if last_moved is None:
                return []
            self._write_anchor(last_moved[0], last_moved[1], key, kid)
        self.record("audit_archived", seq=last_moved[0] + 1, segments=len(moved))
        return moved

    def _write_anchor(self, seq: int, digest: str, key: bytes, kid: int) -> None:
        mark: dict[str, Any] = {"seq": seq, "hash": digest, "mac": head_mac(key, seq, digest, "audit.anchor")}
        if kid != 1:
            mark["kid"] = kid
        atomic_write(self.anchor_path, canonical(mark))

    def _first_seq_of_log(self) -> int | None:
        first = self._first_record(self.log_path)
        seq = first.get("seq") if first else None
        return seq if isinstance(seq, int) else None

    def _iter_lines(self, where: list[tuple[int, str]] | None = None) -> Iterator[tuple[int, bytes]]:
        """Every line of every segment, then of audit.log, numbered across them. `where` gets
        (first global line number, file name) per closed segment, for naming a bad line."""
        n = 0
        for path in self._files():
            if where is not None and path != self.log_path:
                where.append((n + 1, f"{SEGMENT_DIR}/{path.name}"))
            elif where is not None:
                where.append((n + 1, ""))
            try:
                with open(path, "rb") as fh:
                    for line in fh:
                        n += 1
                        yield n, line
            except FileNotFoundError:
                continue

    def records(self, *, profile: str | None = None, run: str | None = None) -> list[dict[str, Any]]:
        """Records (parsed, unverified) filtered by profile and/or run, oldest first."""
        out = []
        for _, line in self._iter_lines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if record_matches(rec, profile, run):
                out.append(rec)
        return out

    def verify(self) -> VerifyResult:
        """Check every record's hash, MAC, seq and link, the tail against the head file, and
        that an absent or empty log is possible for this home."""
        with self._locked():
            try:
                key = self.chain_keys()
                key.lookup(key.current or 1)
            except (ProfileError, OSError) as exc:  # KeyMissing, KeyStateError: damaged or not private
                return VerifyResult(False, 0, None, f"the audit key cannot be used: {exc}")
            stray = self._stray_segment_files()
            if stray:
                return VerifyResult(False, 0, None, f"{SEGMENT_DIR}/{stray} is not a segment of this "
                                    "log (renamed or put there by hand)")
            start, problem, _anchor_kid = self._chain_start(key)
            if problem:
                return VerifyResult(False, 0, None, problem)
            where: list[tuple[int, str]] = []
            try:
                walked = walk_chain(self._iter_lines(where), key, start=start)
            except KeyMissing as exc:       # an older version's key damaged or not private
                return VerifyResult(False, 0, None, f"the audit key cannot be used: {exc}")
            if isinstance(walked, VerifyResult):
                return _placed(walked, where)
            bad = self._misnamed_segment()
            if bad:
                return VerifyResult(False, walked.count, None, bad)
            head = self._head_full()
            if head is None:
                if walked.count:
                    return VerifyResult(False, walked.count, None, f"head file {HEAD_FILE} is missing")
                evidence = self._evidence()
                if evidence:
                    return VerifyResult(False, 0, None, f"the audit log is missing or empty, but "
                                        f"{evidence} (log deleted or emptied)")
                return VerifyResult(True, 0)
            return check_head(walked, head, key, f"head file {HEAD_FILE}")


    def _stray_segment_files(self) -> str | None:
        try:
            names = os.listdir(self.segment_dir)
        except FileNotFoundError:
            return None
        return next((n for n in sorted(names) if not _SEGMENT_RE.fullmatch(n)), None)

    def _misnamed_segment(self) -> str | None:
        """A segment whose name is not its first record's seq (moved or renamed by hand)."""
        for seg in self.segments():
            first = self._first_record(seg)
            if first is None:
                return f"{SEGMENT_DIR}/{seg.name} is empty (emptied by hand)"
            if first.get("seq") != int(seg.name[:12]):
                return f"{SEGMENT_DIR}/{seg.name} starts at record {first.get('seq')} (renamed by hand)"
        return None

    def _chain_start(self, keys: ChainKeys) -> tuple[tuple[int, str], str | None, int | None]:
        """Where the kept chain must start: (0, GENESIS), or after the anchor's record when
        older segments were archived, with the key version keying the anchor. An anchor must
        be keyed and name exactly the first kept record's predecessor; checked by walk_chain
        against the first record it reads."""
        anchor = self._anchor()
        if anchor is None:
            return (0, GENESIS), None, None
        seq, digest, mac = anchor
        kid = record_kid(mark_json(self.anchor_path) or {}) or 1
        key = keys.lookup(kid)
        if seq < 1 or key is None or mac is None or not hmac.compare_digest(
                mac, head_mac(key, seq, digest, "audit.anchor")):
            return (0, GENESIS), (f"{ANCHOR_FILE} is not a valid anchor (its MAC does not match: "
                                  "written without the audit key)"), None
        return (seq, digest), None, kid


def _keyed_mark(path: Path) -> tuple[int, str, str | None] | None:
    """(seq, hash, mac) of the head file or the anchor; None when absent, (-1, "", None) when
    it cannot be read as one (verify() names it)."""
    try:
        d = json.loads(path.read_bytes())
        mac = d.get("mac")
        return int(d["seq"]), str(d["hash"]), (mac if isinstance(mac, str) else None)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return (-1, "", None)


def _last_record_of(path: Path) -> tuple[int, str] | None:
    """(seq, hash) of a segment's last record."""
    last = None
    try:
        with open(path, "rb") as fh:
            for line in fh:
                last = line
        if last is None:
            return None
        rec = json.loads(last)
        return int(rec["seq"]), str(rec["hash"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _placed(result: VerifyResult, where: list[tuple[int, str]]) -> VerifyResult:
    """A walk's VerifyResult with its global line number turned into the file's own."""
    if result.line is None or not where:
        return result
    start, name = max(((s, n) for s, n in where if s <= result.line), default=(1, ""))
    if not name:
        return VerifyResult(result.ok, result.records, result.line - start + 1, result.reason)
    return VerifyResult(result.ok, result.records, result.line - start + 1, result.reason, name)

