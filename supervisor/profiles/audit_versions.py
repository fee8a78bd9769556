"""The key versions of the local audit chain, a part of `LocalAuditSink` (audit.py): the audit
key of each version, the hand-over from one version to the next (`key_rotated`, a new segment),
a rotation's end, what each version keys, and the anchor keyed again before a version goes.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from sfguard.supervisor.profiles.audit_chain import (
    GENESIS,
    AuditFieldError,
    ChainKeys,
    clean_fields,
    record_kid,
    tie_record,
)
from sfguard.supervisor.profiles.keys import KeyMissing, KeyVersionMissing

__all__ = ["AuditKeyVersions", "mark_json"]


def mark_json(path: Path) -> dict[str, Any] | None:
    """The head file or the anchor as JSON; None when absent or unreadable."""
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


class AuditKeyVersions:
    """Mixed into LocalAuditSink, whose lock, files and writes it uses."""

    keys: Any
    head_path: Path
    anchor_path: Path
    _keys: dict[int, bytes]

    # provided by LocalAuditSink
    def _locked(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _append(self, event: str, clean: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _write(self, rec: dict[str, Any], key: bytes) -> dict[str, Any]:
        raise NotImplementedError

    def _head(self) -> tuple[int, str] | None:
        raise NotImplementedError

    def _last_line_record(self) -> tuple[int, str] | tuple[int, str, int] | None:
        raise NotImplementedError

    def _close_segment_if_due(self, size: int, now: float, force: bool = False) -> None:
        raise NotImplementedError

    def _files(self) -> list[Path]:
        raise NotImplementedError

    def _chain_start(self, keys: ChainKeys) -> tuple[tuple[int, str], str | None, int | None]:
        raise NotImplementedError

    def _write_anchor(self, seq: int, digest: str, key: bytes, kid: int) -> None:
        raise NotImplementedError

    def _audit_key(self, create: bool, version: int | None = None) -> bytes | None:
        """The audit key of `version` (None: the current one); None when absent and not made
        (or, for an older version, retired)."""
        v = self.keys.current_version() if version is None else version
        if v not in self._keys:
            try:
                key = self.keys.get_audit_key(create=create, version=v)
            except KeyVersionMissing:        # a version this home never had, or retired
                if version is None or create:
                    raise
                key = None
            if key is None:
                return None
            self._keys[v] = key
        return self._keys[v]

    def chain_keys(self) -> ChainKeys:
        """The keys a walk checks this chain with (every version's, the retired ones named)."""
        retired = frozenset(v.version for v in self.keys.versions() if v.state == "retired")
        return ChainKeys(lambda v: None if v in retired else self._audit_key(False, v), retired,
                         self.keys.current_version())

    def _last_kid(self) -> int | None:
        """The key version of the chain's last record (the head names it); None: no keyed record."""
        head = mark_json(self.head_path)
        if head is None:
            last = self._last_line_record()
            return None if last is None or len(last) < 3 else last[2]
        return None if head.get("mac") is None else (record_kid(head) or 1)

    def _tie(self, old: int, new: int) -> None:
        """Under the lock: close the active log into a segment (each segment is keyed by one
        version) and start the next with the `key_rotated` record from `old` to `new`."""
        self._close_segment_if_due(0, 0.0, force=True)
        last = self._head() or self._last_line_record() or (0, GENESIS)
        try:
            rec = tie_record(lambda v: self._audit_key(v == new, v), last[0], last[1], old, new)
        except KeyError as exc:
            raise KeyMissing(f"the audit key of key version {exc.args[0]} is missing: the chain "
                             f"cannot be handed from version {old} to {new}") from None
        self._write(rec, self._keys[new])

    def switch_key(self, version: int) -> None:
        """Make the prepared key `version` current: the chain's `key_rotated` record (when the
        chain's last record is keyed by an older version), then the key state, under the lock.
        Done again after a crash between the two, it only sets the key state."""
        with self._locked():
            last_kid = self._last_kid()
            if last_kid is not None and last_kid < version:
                self._tie(last_kid, version)
            self.keys.set_current(version)

    def finish_rotation(self, version: int, **fields: Any) -> bool:
        """`key_rotation_finished` and the end of the rotation to `version`, under the lock;
        False (nothing written) when no such rotation is under way."""
        clean = clean_fields("key_rotation_finished", {"to_version": version, **fields})
        with self._locked():
            rot = self.keys.rotation()
            if rot is None or rot.to_version != version or not rot.switched:
                return False
            self._append("key_rotation_finished", clean)
            return self.keys.end_rotation(version)

    def key_coverage(self) -> dict[int, dict[str, int]]:
        """Per key version: how many segments (audit.log counted as one) hold records keyed by
        it, and how many records."""
        out: dict[int, dict[str, int]] = {}
        for path in self._files():
            seen: set[int] = set()
            try:
                with open(path, "rb") as fh:
                    for line in fh:
                        try:
                            rec = json.loads(line)
                        except ValueError:
                            continue
                        kid = record_kid(rec) if isinstance(rec, dict) and "mac" in rec else None
                        if kid is not None:
                            out.setdefault(kid, {"segments": 0, "records": 0})["records"] += 1
                            seen.add(kid)
            except FileNotFoundError:
                continue
            for kid in seen:
                out[kid]["segments"] += 1
        return out

    def rekey_anchor(self, version: int) -> bool:
        """Key the anchor again with the current version when `version` keys it (before that
        version is retired); True when it was rewritten. The anchor must verify first."""
        with self._locked():
            mark = mark_json(self.anchor_path)
            if mark is None or (record_kid(mark) or 1) != version:
                return False
            keys = self.chain_keys()
            (seq, digest), problem, _kid = self._chain_start(keys)
            if problem:
                raise AuditFieldError(problem)
            current = self.keys.current_version()
            key = self._audit_key(False, current)
            if key is None:
                raise KeyMissing("the current key version has no audit key to key the anchor with")
            self._write_anchor(seq, digest, key, current)
            return True
