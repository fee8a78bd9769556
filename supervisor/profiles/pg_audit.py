"""The audit chain of the shared store: `PgAuditSink`, one row per record (see pg_backend.py).

Key versions as in the local chain (audit_chain.py): a record is keyed by the store's current
key version, read in the transaction that appends it under the head's row lock; when the head
names an older version, the `key_rotated` record goes first. `switch_key` and
`finish_rotation` change the key state in the transaction of their record.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

from sfguard.supervisor.profiles import audit as audit_mod
from sfguard.supervisor.profiles.audit_chain import ChainKeys, tie_record
from sfguard.supervisor.profiles.keys import KeyMissing, KeyVersionMissing
from sfguard.supervisor.profiles.pg_backend import PgBackend

__all__ = ["PgAuditSink"]


class PgAuditSink:
    """AuditSink on PostgreSQL: the keyed chain of supervisor/profiles/audit.py, one row per record;
    the record and the head move together in one transaction under the head's row lock."""

    def __init__(self, backend: PgBackend, keys):
        self.backend = backend
        self.keys = keys

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        clean = audit_mod.clean_fields(event, fields)
        with self.backend.conn() as conn:
            return self.append(conn, event, clean)

    def append(self, conn, event: str, clean: dict) -> dict[str, Any]:
        """Append inside the caller's transaction (so an event and its record commit together),
        keyed by the current key version (after the `key_rotated` record when the head's is
        older). KeyVersionMissing when this host has not got that version: nothing is written."""
        seq, prev, kid = conn.execute("SELECT seq, hash, kid FROM sfguard_audit_head WHERE id = 1 "
                                      "FOR UPDATE").fetchone()
        row = conn.execute("SELECT current_version FROM sfguard_meta WHERE id = 1").fetchone()
        version = max(int(kid), 1 if row is None else int(row[0]))
        if int(seq) > 0 and int(kid) < version:
            seq, prev = self._write(conn, tie_record(self._key, int(seq), str(prev), int(kid), version),
                                    version)
        key = self.keys.get_audit_key(create=True, version=version)
        rec = audit_mod.chain_record(key, int(seq), str(prev), event, clean, kid=version)
        self._write(conn, rec, version)
        return rec

    def _key(self, version: int) -> bytes | None:
        return self.keys.get_audit_key(create=False, version=version)

    def _write(self, conn, rec: dict[str, Any], version: int) -> tuple[int, str]:
        key = self.keys.get_audit_key(create=False, version=version)
        conn.execute("INSERT INTO sfguard_audit (seq, body) VALUES (%s, %s)",
                     (rec["seq"], audit_mod.canonical(rec).decode()))
        conn.execute("UPDATE sfguard_audit_head SET seq = %s, hash = %s, mac = %s, kid = %s WHERE id = 1",
                     (rec["seq"], rec["hash"], audit_mod.head_mac(key, rec["seq"], rec["hash"]), version))
        return rec["seq"], rec["hash"]

    def append_event(self, conn, event: str, **fields: Any) -> dict[str, Any]:
        """Validate and append a record inside the caller's transaction: the state change it
        records and the record commit together or not at all."""
        return self.append(conn, event, audit_mod.clean_fields(event, fields))

    def switch_key(self, version: int) -> None:
        """The `key_rotated` record and the store's current version, in one transaction."""
        with self.backend.conn() as conn:
            seq, prev, kid = conn.execute("SELECT seq, hash, kid FROM sfguard_audit_head WHERE id = 1 "
                                          "FOR UPDATE").fetchone()
            if int(seq) > 0 and int(kid) < version:
                self._write(conn, tie_record(self._key, int(seq), str(prev), int(kid), version), version)
            self.keys.set_current(version, conn)

    def finish_rotation(self, version: int, **fields: Any) -> bool:
        """`key_rotation_finished` and the rotation's end in one transaction (once, whichever
        host gets there first)."""
        clean = audit_mod.clean_fields("key_rotation_finished", {"to_version": version, **fields})
        with self.backend.conn() as conn:
            conn.execute("SELECT 1 FROM sfguard_audit_head WHERE id = 1 FOR UPDATE")
            if not self.keys.end_rotation(version, conn):
                return False
            self.append(conn, "key_rotation_finished", clean)
            return True

    def key_coverage(self) -> dict[int, dict[str, int]]:
        """Records per key version (the database keeps no segments: one per version)."""
        with self.backend.conn() as conn:
            rows = conn.execute("SELECT coalesce((body::jsonb ->> 'kid')::int, 1), count(*) FROM "
                                "sfguard_audit WHERE body::jsonb ? 'mac' GROUP BY 1").fetchall()
        return {int(k): {"segments": 1, "records": int(n)} for k, n in rows}

    def chain_keys(self) -> ChainKeys:
        retired = frozenset(v.version for v in self.keys.versions() if v.state == "retired")

        def lookup(version: int) -> bytes | None:
            if version in retired:
                return None
            try:
                return self._key(version)
            except KeyVersionMissing:
                return None
        return ChainKeys(lookup, retired, self.keys.current_version())

    def _rows(self) -> Iterator[tuple[int, bytes]]:
        with self.backend.conn() as conn:
            yield from self._rows_in(conn)

    def records(self, *, profile: str | None = None, run: str | None = None) -> list[dict[str, Any]]:
        out = []
        for _, line in self._rows():
            rec = json.loads(line)
            if audit_mod.record_matches(rec, profile, run):
                out.append(rec)
        return out

    def verify(self) -> audit_mod.VerifyResult:
        """Walk the whole chain in the database and compare its end with the head row."""
        try:
            keys = self.chain_keys()
        except KeyMissing as exc:
            return audit_mod.VerifyResult(False, 0, None, f"the audit key cannot be used: {exc}")
        with self.backend.conn() as conn:
            if self.backend.read_only:     # no row locks there: one snapshot for walk and head
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            else:
                conn.execute("SELECT 1 FROM sfguard_audit_head WHERE id = 1 FOR SHARE")
            walked = audit_mod.walk_chain(self._rows_in(conn), keys)
            if isinstance(walked, audit_mod.VerifyResult):
                return walked
            head = conn.execute("SELECT seq, hash, mac FROM sfguard_audit_head WHERE id = 1").fetchone()
        if head is None:
            return audit_mod.VerifyResult(False, walked.count, None, "the audit head row is missing")
        if walked.count == 0 and int(head[0]) == 0:
            return audit_mod.VerifyResult(True, 0)
        return audit_mod.check_head(walked, (int(head[0]), str(head[1]), head[2]), keys,
                                    "audit head row")

    @staticmethod
    def _rows_in(conn) -> Iterator[tuple[int, bytes]]:
        with conn.cursor(name=f"audit_{secrets.token_hex(4)}") as cur:
            cur.itersize = 1000
            cur.execute("SELECT body FROM sfguard_audit ORDER BY seq")
            for n, (body,) in enumerate(cur, 1):
                yield n, body.encode() + b"\n"
