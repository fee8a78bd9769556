"""The audit chain's pure part, shared by every AuditSink (the home's file, the PostgreSQL
table): the events and fields a record may carry, the canonical form, hashes and MACs, and the
walk that checks a chain. No files, no database (supervisor/profiles/audit.py, pg_audit.py).

Key versions: a record keyed by version N > 1 carries `"kid": N` (no `kid`: version 1). The
version changes only at a `key_rotated` record {from_version, to_version}: keyed by the new
version, it also carries `mac_from`, a MAC by the old version's key, so both keys sign the
hand-over. Its `prev` is the hash of the old key's last record, so a MAC that verifies under
the new key covers the whole history before it: once an old version is retired (its key
gone), its records are checked by their hashes and by the first later record whose key is
still held. A version never goes back down, and the chain may not end on a version older
than the key state's current one (records cut back to before a rotation).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sfguard.errors import SfguardError
from sfguard.supervisor.protocols import ProfileNameError, VerifyResult, validate_name, validate_run_id

GENESIS = "0" * 64

EVENTS = frozenset({
    "profile_created", "profile_leased", "profile_released", "profile_deleted", "scope_deleted",
    "login_checked", "handoff_opened", "handoff_confirmed", "policy_reloaded", "denials_aggregated",
    "handoff_viewed", "handoff_closed",
    "policy_edit_refused",    # an invalid edit of the live policy: the last good one stays
    "profile_resealed",       # the shared store: a reseal, in the transaction that stores it
    "audit_archived",         # segments moved away (`sfguard audit archive`); the anchor names where it starts
    # console sessions (by their public id, never a cookie or link value)
    "console_signed_in", "console_signed_out", "console_sign_in_refused",
    # write gates: a write held for a person, and what became of it (supervisor/writes/approvals.py)
    "write_held", "write_approved", "write_denied", "write_timed_out", "write_cancelled",
    # a profile carried what would have run before the guard (a saved session, start-up pages,
    # an extension): removed or kept from loading at its browser's start (issue 52)
    "profile_cleaned",
    # key versions (supervisor/profiles/rotation.py): the chain's hand-over to a new key, a
    # rotation's start, resumption and end, each profile moved, a version retired
    "key_rotated", "key_rotation_started", "key_rotation_resumed", "key_rotation_finished",
    "profile_rekeyed", "key_retired",
    # run records (supervisor/record): a record sealed (the digest of its index), one removed
    # by the retention; console controls over running sessions, with who used them
    "run_recorded", "run_record_removed",
    "console_run_ended", "console_stage_cancelled", "console_browser_restarted", "console_stage_watched",
})

_TOKEN_RE = re.compile(r"^[a-z0-9][a-z0-9_.:-]{0,63}$", re.ASCII)
_HOST_RE = re.compile(r"^[A-Za-z0-9._:\-\[\]*]{1,255}$", re.ASCII)
_STAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", re.ASCII)


class AuditFieldError(SfguardError):
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
    except ProfileNameError:
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


_TEXT_RE = re.compile(r"^[\x20-\x7e\u00a0-\U0010ffff]*$")


def _text(limit: int) -> Any:
    """Printable text of at most `limit` characters (no control characters, no line breaks)."""
    def check(v: Any) -> str:
        if not isinstance(v, str) or len(v) > limit or not _TEXT_RE.fullmatch(v):
            raise AuditFieldError(f"text fields are at most {limit} printable characters on one line")
        return v
    return check


FIELDS = {
    "scope": _name, "profile": _name, "run": _run, "stage": _stage, "host": _host,
    "hosts": _hosts, "count": _count, "profiles": _count, "pid": _count, "port": _count,
    "outcome": _token, "reason": _token, "result": _token, "by": _token, "mode": _token,
    "logged_in": _flag, "policy_sha256": _digest, "period_s": _count,
    "seq": _count, "segments": _count,
    "approval": _token, "attempt": _count, "method": _token, "why": _token,
    # a held write's record: its address with query values hidden, its form's field names, its
    # body's type and size, the sites.yaml rule that held it, the decider's own words
    "url": _text(2048), "fields": _text(500), "body_type": _text(200), "body_size": _count,
    "rule": _text(300), "note": _text(500),
    "removed": _text(500),
    "person": _token,         # whom a console link was for (`sfguard console --as NAME`)
    "version": _count, "from_version": _count, "to_version": _count, "pending": _count,
    "record": _text(200), "record_sha256": _digest,     # a run record's folder and index digest
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


def record_mac_from(key: bytes, rec: dict) -> str:
    """A `key_rotated` record's MAC by the old version's key: over the record without `hash`,
    `mac` and `mac_from` (the hash and the new key's MAC then cover it)."""
    return hmac.new(key, canonical({k: v for k, v in rec.items() if k not in ("hash", "mac", "mac_from")}),
                    hashlib.sha256).hexdigest()


def record_kid(rec: dict) -> int | None:
    """The key version of a record (1 without `kid`); None when `kid` is not a version."""
    kid = rec.get("kid", 1)
    return kid if isinstance(kid, int) and not isinstance(kid, bool) and kid >= 1 else None


def head_mac(key: bytes, seq: int, digest: str, what: str = "audit.head") -> str:
    return hmac.new(key, canonical({"hash": digest, "seq": seq, "what": what}),
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
                 clean: dict[str, Any], kid: int = 1, from_key: bytes | None = None) -> dict[str, Any]:
    """The next record after (last_seq, last_hash): hashed and keyed by `key`, which is key
    version `kid`; `from_key` (a `key_rotated` record): the old version's key signs it too."""
    rec: dict[str, Any] = {"seq": last_seq + 1, "ts": round(time.time(), 6), "event": event,
                           "fields": clean, "prev": last_hash}
    if kid != 1:
        rec["kid"] = kid
    if from_key is not None:
        rec["mac_from"] = record_mac_from(from_key, rec)
    rec["hash"] = record_hash(rec)
    rec["mac"] = record_mac(key, rec)
    return rec


def tie_record(keys: Callable[[int], bytes | None], last_seq: int, last_hash: str, old: int,
               new: int) -> dict[str, Any]:
    """The `key_rotated` record that hands the chain from version `old` to `new` (both keys
    must be here: KeyError otherwise, never a half-signed hand-over)."""
    old_key, new_key = keys(old), keys(new)
    if old_key is None or new_key is None:
        raise KeyError(old if old_key is None else new)
    return chain_record(new_key, last_seq, last_hash, "key_rotated",
                        {"from_version": old, "to_version": new}, kid=new, from_key=old_key)


@dataclass(frozen=True)
class ChainKeys:
    """The audit keys a walk checks MACs with: `lookup(version)` is that version's key (None
    when this home has none), `retired` the versions whose keys were removed on purpose,
    `current` the key state's current version (None: not checked)."""
    lookup: Callable[[int], bytes | None]
    retired: frozenset[int] = frozenset()
    current: int | None = None

    @classmethod
    def of(cls, keys: bytes | None | ChainKeys) -> ChainKeys:
        """Walks given one key (or None) check every version against it (the old callers)."""
        if isinstance(keys, ChainKeys):
            return keys
        return cls(lambda _version: keys)


@dataclass(frozen=True)
class ChainEnd:
    """Where a verified walk over the records ended (`kid`: the last keyed record's version)."""
    prev_hash: str
    seq: int
    count: int
    keyed: bool
    kid: int | None = None


def record_matches(rec: dict[str, Any], profile: str | None, run: str | None) -> bool:
    """The `records(profile=, run=)` filter of every AuditSink: unset means any."""
    f = rec.get("fields") or {}
    return (profile is None or f.get("profile") == profile) and (run is None or f.get("run") == run)


def walk_chain(lines: Iterable[tuple[int, bytes]], key: bytes | None | ChainKeys,
               start: tuple[int, str] = (0, GENESIS)) -> VerifyResult | ChainEnd:
    """Check every record (one canonical JSON line each, numbered from 1): hash, sequence,
    link, event, key version and MAC. A VerifyResult names the first bad record; a ChainEnd
    says the walk was clean. Shared by every AuditSink that keeps the chain (file or database).
    `start`: the (seq, hash) the first record must follow (an archived beginning,
    LocalAuditSink); the first record read sets the key version."""
    keys = ChainKeys.of(key)
    seq, prev_hash = start
    count = 0
    keyed = start[0] > 0        # only a keyed chain can be archived
    kid: int | None = None
    unchecked: int | None = None    # a record keyed by a retired version, not yet covered
    for n, line in lines:
        rec, unparsed = _parse(line)
        if rec is None:
            return VerifyResult(False, count, n, unparsed)
        problem = _link_problem(rec, seq, prev_hash, count)
        if problem:
            return VerifyResult(False, count, n, problem)
        if "mac" in rec:
            rkid = record_kid(rec)
            problem = _version_problem(rec, rkid, kid)
            if problem is None and rkid is not None:
                problem, covered = _mac_problem(rec, rkid, keys)
                if not covered:
                    unchecked = unchecked or rkid
                else:
                    unchecked = None
            if problem:
                return VerifyResult(False, count, n, problem)
            keyed, kid = True, rkid
        elif keyed:
            return VerifyResult(False, count, n, "an unkeyed record after keyed ones "
                                "(rewritten without the audit key)")
        prev_hash, seq, count = rec["hash"], rec["seq"], count + 1
    if unchecked is not None:
        return VerifyResult(False, count, None, f"the last records are keyed by retired key version "
                            f"{unchecked} and no later record keyed by a version still held covers them")
    return ChainEnd(prev_hash, seq, count, keyed, kid)


def _parse(line: bytes) -> tuple[dict | None, str]:
    if not line.endswith(b"\n"):
        return None, "last line is incomplete (cut mid-record)"
    try:
        rec = json.loads(line)
    except ValueError:
        return None, "not a JSON record"
    if not isinstance(rec, dict):
        return None, "not a JSON record"
    return rec, ""


def _link_problem(rec: dict, seq: int, prev_hash: str, count: int) -> str | None:
    """Hash, sequence, link and event of one record."""
    if rec.get("hash") != record_hash(rec):
        return "record content does not match its hash (edited)"
    if rec.get("seq") != seq + 1:
        if count == 0 and seq == 0 and isinstance(rec.get("seq"), int) and rec["seq"] > 1:
            return (f"the chain starts at record {rec['seq']}: records 1 to {rec['seq'] - 1} are "
                    "missing (a segment removed or emptied; old segments may only be moved away "
                    "with `sfguard audit archive`, which records an anchor)")
        return (f"sequence number {rec.get('seq')} where {seq + 1} was expected (record deleted, "
                "inserted or moved)")
    if rec.get("prev") != prev_hash:
        return "does not chain to the previous record (record deleted, inserted or moved)"
    if rec.get("event") not in EVENTS:
        return "unknown event"
    return None


def _version_problem(rec: dict, rkid: int | None, kid: int | None) -> str | None:
    """A record's key version against the one before it: the same, or higher only at a
    `key_rotated` record that names both."""
    if rkid is None:
        return "the record's key version (kid) is not a version number"
    if kid is None or rkid == kid:
        if rec.get("event") == "key_rotated" and kid is not None:
            return "a key_rotated record that does not change the key version"
        return None
    if rkid < kid:
        return (f"keyed by key version {rkid} after records of version {kid} (written with an "
                "old key after a rotation)")
    f = rec.get("fields") or {}
    if rec.get("event") != "key_rotated" or f.get("from_version") != kid or f.get("to_version") != rkid:
        return (f"the key version changes from {kid} to {rkid} without a key_rotated record "
                "naming both")
    return None


def _mac_problem(rec: dict, rkid: int, keys: ChainKeys) -> tuple[str | None, bool]:
    """(what is wrong with the record's MACs, whether a held key checked it)."""
    key = keys.lookup(rkid)
    if key is None:
        if rkid in keys.retired:
            return None, False
        return ("the record is keyed but the audit key is missing (key deleted, or the log comes "
                "from another home)" if rkid == 1 else f"the record is keyed by key version "
                f"{rkid}, whose audit key is missing (not retired: deleted by hand, or the log "
                "comes from another home)"), False
    if not isinstance(rec["mac"], str) or not hmac.compare_digest(rec["mac"], record_mac(key, rec)):
        return "record MAC does not match (rewritten without the audit key)", True
    if rec.get("event") == "key_rotated":
        old = (rec.get("fields") or {}).get("from_version")
        old_key = keys.lookup(old) if isinstance(old, int) else None
        mac_from = rec.get("mac_from")
        if old_key is not None and (not isinstance(mac_from, str) or not hmac.compare_digest(
                mac_from, record_mac_from(old_key, rec))):
            return f"the key_rotated record's MAC by key version {old} does not match", True
    return None, True


def check_head(end: ChainEnd, head: tuple[int, str, str | None], key: bytes | None | ChainKeys,
               what: str) -> VerifyResult:
    """Compare a clean walk's end with the head (seq, hash, mac) kept beside the records; the
    head is keyed by the key version of the last record."""
    keys = ChainKeys.of(key)
    seq, prev_hash, count = end.seq, end.prev_hash, end.count
    if head[0] == seq and head[1] == prev_hash and count:
        last_key = keys.lookup(end.kid or 1)
        if last_key is not None and not end.keyed:
            return VerifyResult(False, count, None, "the audit key exists but no record is "
                                "keyed (log rewritten without the audit key)")
        if end.keyed and (last_key is None or head[2] is None or not hmac.compare_digest(
                head[2], head_mac(last_key, head[0], head[1]))):
            return VerifyResult(False, count, None, f"{what} MAC does not "
                                "match (rewritten without the audit key)")
        if end.keyed and keys.current is not None and (end.kid or 1) < keys.current:
            return VerifyResult(False, count, None, f"the chain ends on key version {end.kid or 1} "
                                f"but version {keys.current} is current: the records keyed by it "
                                "were cut (or the log was rewritten with an old key)")
    if head[0] != seq or head[1] != prev_hash:
        if head[0] > seq:
            return VerifyResult(False, count, count + 1, f"log ends at record {seq} but the "
                                f"{what} says {head[0]} (tail truncated)")
        return VerifyResult(False, count, count or None,
                            f"last record (seq {seq}) does not match the {what} (seq {head[0]})")
    return VerifyResult(True, count)
