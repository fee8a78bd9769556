"""The audit chain of the shared store: `PgAuditSink`, one row per record (see pg_backend.py)."""
from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

from sfguard.supervisor.profiles import audit as audit_mod
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
        key = self.keys.get_audit_key(create=True)
        with self.backend.conn() as conn:
            return self.append(conn, key, event, clean)

    @staticmethod
    def append(conn, key: bytes, event: str, clean: dict) -> dict[str, Any]:
        """Append inside the caller's transaction (so an event and its record commit together)."""
        seq, prev = conn.execute("SELECT seq, hash FROM sfguard_audit_head WHERE id = 1 "
                                 "FOR UPDATE").fetchone()
        rec = audit_mod.chain_record(key, int(seq), str(prev), event, clean)
        conn.execute("INSERT INTO sfguard_audit (seq, body) VALUES (%s, %s)",
                     (rec["seq"], audit_mod.canonical(rec).decode()))
        conn.execute("UPDATE sfguard_audit_head SET seq = %s, hash = %s, mac = %s WHERE id = 1",
                     (rec["seq"], rec["hash"], audit_mod.head_mac(key, rec["seq"], rec["hash"])))
        return rec

    def append_event(self, conn, event: str, **fields: Any) -> dict[str, Any]:
        """Validate and append a record inside the caller's transaction: the state change it
        records and the record commit together or not at all."""
        clean = audit_mod.clean_fields(event, fields)
        return self.append(conn, self.keys.get_audit_key(create=True), event, clean)

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
        key = self.keys.get_audit_key(create=False)
        with self.backend.conn() as conn:
            if self.backend.read_only:     # no row locks there: one snapshot for walk and head
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            else:
                conn.execute("SELECT 1 FROM sfguard_audit_head WHERE id = 1 FOR SHARE")
            walked = audit_mod.walk_chain(self._rows_in(conn), key)
            if isinstance(walked, audit_mod.VerifyResult):
                return walked
            head = conn.execute("SELECT seq, hash, mac FROM sfguard_audit_head WHERE id = 1").fetchone()
        if head is None:
            return audit_mod.VerifyResult(False, walked.count, None, "the audit head row is missing")
        if walked.count == 0 and int(head[0]) == 0:
            return audit_mod.VerifyResult(True, 0)
        return audit_mod.check_head(walked, (int(head[0]), str(head[1]), head[2]), key,
                                    "audit head row")

    @staticmethod
    def _rows_in(conn) -> Iterator[tuple[int, bytes]]:
        with conn.cursor(name=f"audit_{secrets.token_hex(4)}") as cur:
            cur.itersize = 1000
            cur.execute("SELECT body FROM sfguard_audit ORDER BY seq")
            for n, (body,) in enumerate(cur, 1):
                yield n, body.encode() + b"\n"
