"""The audit trail: append-only JSON lines, each record chained to the one before.

`<home>/audit.log` (0600), one record per line::

    {"event": "profile_leased", "fields": {"profile": "shop", "run": "r1", "scope": "local"},
     "hash": "<sha256>", "prev": "<hash of the previous record>", "seq": 7, "ts": 1764679...}

`hash` = sha256 over the canonical JSON (sorted keys, no spaces) of the record without
`hash` and `mac`. The first record's `prev` is 64 zeros. `<home>/audit.head` (0600) holds
the last `seq` and `hash`, rewritten after every append, so a cut-off tail is detected too.

The chain is keyed: every record also carries `mac` = HMAC-SHA256 over the canonical JSON of
the record without `mac` (so over its `hash` and `prev` too), and the head file carries a
`mac` over its `seq` and `hash`. The key is the KeyProvider's audit key (a key of its own,
never a sealing key; keyring or `<home>/keys/audit.hmac`). Whoever rewrites the log and the
head without the key (recomputing every sha256) is detected. Logs written before the key
existed have no `mac`: their records still verify with the plain hash chain; once a keyed
record exists, every later record and the head must be keyed.

An absent or empty log is not "intact" when the home shows records must have existed: sealed
profiles under `<home>/profiles/`, or the audit key itself (made with the first keyed record).

Appends from several processes are serialised with fcntl.flock on `<home>/audit.lock`
around read-head + append + fsync + write-head. The chain continues from the head file, so
an edit, deletion, insertion, reordering or truncation stays visible to `verify()`.

Only a fixed set of events and fields is accepted, each field validated: profile names, run
ids, hosts, counts, short reason codes. Never cookie or token values.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sfguard.supervisor.home import FILE_MODE, atomic_write, ensure_home
from sfguard.supervisor.profiles.keys import KeyMissing
from sfguard.supervisor.protocols import validate_name, validate_run_id

LOG_FILE = "audit.log"
HEAD_FILE = "audit.head"
LOCK_FILE = "audit.lock"
GENESIS = "0" * 64

EVENTS = frozenset({
    "profile_created", "profile_leased", "profile_released", "profile_deleted", "scope_deleted",
    "login_checked", "handoff_opened", "handoff_confirmed", "policy_reloaded", "denials_aggregated",
    "handoff_viewed", "handoff_closed",
    "policy_edit_refused",    # an invalid edit of the live policy: the last good one stays
    "profile_resealed",       # the shared store: a reseal, in the transaction that stores it
})

_TOKEN_RE = re.compile(r"^[a-z0-9][a-z0-9_.:-]{0,63}$", re.ASCII)
_HOST_RE = re.compile(r"^[A-Za-z0-9._:\-\[\]*]{1,255}$", re.ASCII)
_STAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", re.ASCII)


class AuditFieldError(ValueError):
    """An audit event or field that is not allowed (the value itself is never echoed)."""


def _host(v: Any) -> str:
    if not isinstance(v, str) or not _HOST_RE.fullmatch(v):
        raise AuditFieldError("host must be a plain host name or address")
    return v.lower()


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise AuditFieldError("count fields must be non-negative integers")
    return v


def _token(v: Any) -> str:
    if not isinstance(v, str) or not _TOKEN_RE.fullmatch(v):
        raise AuditFieldError("reason/outcome fields must be short lower-case codes")
    return v


def _hosts(v: Any) -> dict[str, int]:
    """{host: count}: the aggregated denials of a period."""
    if not isinstance(v, dict) or len(v) > 1000:
        raise AuditFieldError("hosts must be a mapping host -> count (at most 1000)")
    return {_host(h): _count(c) for h, c in v.items()}


def _name(v: Any) -> str:
    try:
        return validate_name(v)
    except ValueError:
        raise AuditFieldError("profile/scope must be a valid profile name") from None


def _run(v: Any) -> str:
    try:
        return validate_run_id(v)
    except ValueError:
        raise AuditFieldError("run must be a valid run id") from None


def _stage(v: Any) -> str:
    if not isinstance(v, str) or not _STAGE_RE.fullmatch(v):
        raise AuditFieldError("stage must be a plain stage id")
    return v


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise AuditFieldError("flag fields must be true or false")
    return v


def _digest(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{8,64}", v):
        raise AuditFieldError("digest fields must be hex")
    return v


FIELDS = {
    "scope": _name, "profile": _name, "run": _run, "stage": _stage, "host": _host,
    "hosts": _hosts, "count": _count, "profiles": _count, "pid": _count, "port": _count,
    "outcome": _token, "reason": _token, "result": _token, "by": _token, "mode": _token,
    "logged_in": _flag, "policy_sha256": _digest, "period_s": _count,
}


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def record_hash(rec: dict) -> str:
    return hashlib.sha256(canonical({k: v for k, v in rec.items()
                                     if k != "hash" and k != "mac"})).hexdigest()


def record_mac(key: bytes, rec: dict) -> str:
    """HMAC-SHA256 of the record without `mac` (its `hash` and `prev` included)."""
    return hmac.new(key, canonical({k: v for k, v in rec.items() if k != "mac"}),
                    hashlib.sha256).hexdigest()


def head_mac(key: bytes, seq: int, digest: str) -> str:
    return hmac.new(key, canonical({"hash": digest, "seq": seq, "what": "audit.head"}),
                    hashlib.sha256).hexdigest()


def clean_fields(event: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The validated fields of an allowed event; AuditFieldError for anything else."""
    if event not in EVENTS:
        raise AuditFieldError(f"unknown audit event {ascii(event)[:60]}")
    clean = {}
    for name, value in fields.items():
        check = FIELDS.get(name)
        if check is None:
            raise AuditFieldError(f"field {ascii(name)[:40]} is not allowed in audit records")
        clean[name] = check(value)
    return clean


def chain_record(key: bytes, last_seq: int, last_hash: str, event: str,
                 clean: dict[str, Any]) -> dict[str, Any]:
    """The next record after (last_seq, last_hash): hashed and keyed."""
    rec = {"seq": last_seq + 1, "ts": round(time.time(), 6), "event": event,
           "fields": clean, "prev": last_hash}
    rec["hash"] = record_hash(rec)
    rec["mac"] = record_mac(key, rec)
    return rec


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    records: int
    line: int | None = None        # 1-based line of the first bad record
    reason: str | None = None

    def __str__(self) -> str:
        if self.ok:
            return f"audit log intact: {self.records} record(s)"
        where = f"line {self.line}" if self.line else "log"
        return f"audit log broken at {where}: {self.reason}"


class LocalAuditSink:
    """AuditSink writing `<home>/audit.log` with a keyed hash chain and a head file.

    `keys` is the KeyProvider (default: `default_key_provider(home)`, as the profile store).
    `read_only` (`sfguard audit verify|show`): create nothing, neither the home nor the lock."""

    def __init__(self, home: Path, keys: Any = None, read_only: bool = False):
        self.read_only = read_only
        self.home = Path(home) if read_only else ensure_home(home)
        self.log_path = self.home / LOG_FILE
        self.head_path = self.home / HEAD_FILE
        self.lock_path = self.home / LOCK_FILE
        if keys is None:
            from sfguard.supervisor.profiles.keys import default_key_provider  # noqa: PLC0415
            keys = default_key_provider(self.home)
        self.keys = keys
        self._key: bytes | None = None

    def _audit_key(self, create: bool) -> bytes | None:
        if self._key is None:
            self._key = self.keys.get_audit_key(create=create)
        return self._key

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
        except Exception:  # a damaged key is evidence too
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
        try:
            d = json.loads(self.head_path.read_bytes())
            mac = d.get("mac")
            return int(d["seq"]), str(d["hash"]), (mac if isinstance(mac, str) else None)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError):
            return (-1, "", None)

    def _last_line_record(self) -> tuple[int, str] | None:
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
                return int(rec["seq"]), str(rec["hash"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            return (-1, "")

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one validated record and return it. AuditFieldError for unknown input."""
        clean = clean_fields(event, fields)
        with self._locked():
            # Continue the chain from the head file (the truth), else from the log's last line.
            last = self._head() or self._last_line_record() or (0, GENESIS)
            key = self._audit_key(create=True)
            if key is None:         # a provider asked to create the key returns it
                raise KeyMissing("the key provider gave no audit key to write with")
            rec = chain_record(key, last[0], last[1], event, clean)
            line = canonical(rec) + b"\n"
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                         FILE_MODE)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            atomic_write(self.head_path, canonical({
                "seq": rec["seq"], "hash": rec["hash"],
                "mac": head_mac(key, rec["seq"], rec["hash"])}))
        return rec

    def _iter_lines(self) -> Iterator[tuple[int, bytes]]:
        try:
            with open(self.log_path, "rb") as fh:
                yield from enumerate(fh, 1)
        except FileNotFoundError:
            return

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
                key = self._audit_key(create=False)
            except Exception as exc:  # KeyMissing: damaged or not private
                return VerifyResult(False, 0, None, f"the audit key cannot be used: {exc}")
            walked = walk_chain(self._iter_lines(), key)
            if isinstance(walked, VerifyResult):
                return walked
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


@dataclass(frozen=True)
class ChainEnd:
    """Where a verified walk over the records ended."""
    prev_hash: str
    seq: int
    count: int
    keyed: bool


def record_matches(rec: dict[str, Any], profile: str | None, run: str | None) -> bool:
    """The `records(profile=, run=)` filter of every AuditSink: unset means any."""
    f = rec.get("fields") or {}
    return (profile is None or f.get("profile") == profile) and (run is None or f.get("run") == run)


def walk_chain(lines: Iterable[tuple[int, bytes]], key: bytes | None) -> VerifyResult | ChainEnd:
    """Check every record (one canonical JSON line each, numbered from 1): hash, sequence,
    link, event and MAC. A VerifyResult names the first bad record; a ChainEnd says the walk
    was clean. Shared by every AuditSink that keeps the chain (file or database)."""
    prev_hash, seq, count = GENESIS, 0, 0
    keyed = False
    for n, line in lines:
        if not line.endswith(b"\n"):
            return VerifyResult(False, count, n, "last line is incomplete (cut mid-record)")
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError
        except ValueError:
            return VerifyResult(False, count, n, "not a JSON record")
        if rec.get("hash") != record_hash(rec):
            return VerifyResult(False, count, n, "record content does not match its hash (edited)")
        if rec.get("seq") != seq + 1:
            return VerifyResult(False, count, n, f"sequence number {rec.get('seq')} where "
                                f"{seq + 1} was expected (record deleted, inserted or moved)")
        if rec.get("prev") != prev_hash:
            return VerifyResult(False, count, n, "does not chain to the previous record "
                                "(record deleted, inserted or moved)")
        if rec.get("event") not in EVENTS:
            return VerifyResult(False, count, n, "unknown event")
        if "mac" in rec:
            if key is None:
                return VerifyResult(False, count, n, "the record is keyed but the audit key "
                                    "is missing (key deleted, or the log comes from "
                                    "another home)")
            if not isinstance(rec["mac"], str) or not hmac.compare_digest(
                    rec["mac"], record_mac(key, rec)):
                return VerifyResult(False, count, n, "record MAC does not match (rewritten "
                                    "without the audit key)")
            keyed = True
        elif keyed:
            return VerifyResult(False, count, n, "an unkeyed record after keyed ones "
                                "(rewritten without the audit key)")
        prev_hash, seq, count = rec["hash"], rec["seq"], count + 1
    return ChainEnd(prev_hash, seq, count, keyed)


def check_head(end: ChainEnd, head: tuple[int, str, str | None], key: bytes | None,
               what: str) -> VerifyResult:
    """Compare a clean walk's end with the head (seq, hash, mac) kept beside the records."""
    seq, prev_hash, count = end.seq, end.prev_hash, end.count
    if head[0] == seq and head[1] == prev_hash and count:
        if key is not None and not end.keyed:
            return VerifyResult(False, count, None, "the audit key exists but no record is "
                                "keyed (log rewritten without the audit key)")
        if end.keyed and (key is None or head[2] is None or not hmac.compare_digest(
                head[2], head_mac(key, head[0], head[1]))):
            return VerifyResult(False, count, None, f"{what} MAC does not "
                                "match (rewritten without the audit key)")
    if head[0] != seq or head[1] != prev_hash:
        if head[0] > seq:
            return VerifyResult(False, count, count + 1, f"log ends at record {seq} but the "
                                f"{what} says {head[0]} (tail truncated)")
        return VerifyResult(False, count, count or None,
                            f"last record (seq {seq}) does not match the {what} (seq {head[0]})")
    return VerifyResult(True, count)
