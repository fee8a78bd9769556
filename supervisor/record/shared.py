"""Run records in the shared PostgreSQL store (supervisor/profiles/pg_*.py, migration 3), so that
any guard host of a fleet lists a run's record and opens it.

A record's index goes to `sfguard_run_records` when its run starts (state active) and again when
it ends; at its end its timeline (the file as written, hash chain and all) and its screenshots
go too. A record is named by the host that kept it and its folder there. Opened from another
host, it is copied into that host's `<home>/records/.shared/<host>/<record>/` (0700) and read like
a local one; `sfguard runs verify` checks the copy against the index the shared audit chain
covers (`run_recorded` is written to the same chain). The store only ever holds what the local
files hold: no secret is in them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sfguard.supervisor.home import atomic_write, private_dir
from sfguard.supervisor.record import files

#: the rows a listing reads at most
MAX_LISTED = 2000
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:~-]{0,200}$")


def publish(backend: Any, folder: Path, index: dict[str, Any], final: bool) -> None:
    """The index (and, when `final`, the timeline and screenshots) into the store."""
    host, record = str(index["host"]), str(index["record"])
    body = (folder / files.TIMELINE).read_bytes() if final else None
    shots = []
    if final:
        for name in sorted(index.get("shots") or {}):
            path = folder / files.SHOTS / name
            if _NAME_RE.fullmatch(name) and path.is_file() and not path.is_symlink():
                shots.append((name, path.read_bytes()))
    with backend.conn() as conn:
        conn.execute(
            "INSERT INTO sfguard_run_records (host, record, run_id, started, ended, state, outcome, pipeline,"
            " profiles, index_json) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (host, record) DO UPDATE SET ended = EXCLUDED.ended, state = EXCLUDED.state,"
            " outcome = EXCLUDED.outcome, profiles = EXCLUDED.profiles, index_json = EXCLUDED.index_json",
            (host, record, index["run_id"], float(index.get("started") or 0), index.get("ended"),
             str(index.get("state")), index.get("outcome"), index.get("pipeline"),
             list(index.get("profiles") or []), files.canonical(index).decode()))
        if body is not None:
            conn.execute("DELETE FROM sfguard_run_record_lines WHERE host = %s AND record = %s", (host, record))
            conn.execute("INSERT INTO sfguard_run_record_lines (host, record, body) VALUES (%s, %s, %s)",
                         (host, record, body))
            conn.execute("DELETE FROM sfguard_run_record_shots WHERE host = %s AND record = %s", (host, record))
            for name, data in shots:
                conn.execute("INSERT INTO sfguard_run_record_shots (host, record, name, data) VALUES "
                             "(%s, %s, %s, %s)", (host, record, name, data))


def listing(backend: Any) -> list[dict[str, Any]]:
    """Every record's index in the store, newest first."""
    with backend.conn() as conn:
        rows = conn.execute("SELECT index_json FROM sfguard_run_records ORDER BY started DESC LIMIT %s",
                            (MAX_LISTED,)).fetchall()
    out = []
    for (text,) in rows:
        try:
            index = json.loads(text)
        except ValueError:
            continue
        if isinstance(index, dict):
            out.append(index)
    return out


def fetch(backend: Any, name: str, cache: Path, host: str | None = None) -> Path | None:
    """A local copy of the record `name` (a record's folder name, or a run id: its newest),
    kept by `host` (any host when None), under `cache`; None when the store has none ended."""
    with backend.conn() as conn:
        row = conn.execute(
            "SELECT r.host, r.record, r.index_json, l.body FROM sfguard_run_records r JOIN sfguard_run_record_lines l"
            " ON l.host = r.host AND l.record = r.record WHERE (r.record = %s OR r.run_id = %s)"
            " AND (%s::text IS NULL OR r.host = %s) ORDER BY (r.record = %s) DESC, r.started DESC LIMIT 1",
            (name, name, host, host, name)).fetchone()
        if row is None:
            return None
        shots = conn.execute("SELECT name, data FROM sfguard_run_record_shots WHERE host = %s AND record = %s",
                             (row[0], row[1])).fetchall()
    rhost, record = str(row[0]), str(row[1])
    if not (_NAME_RE.fullmatch(rhost) and _NAME_RE.fullmatch(record)):
        return None
    folder = private_dir(private_dir(private_dir(cache) / rhost) / record)
    private_dir(folder / files.SHOTS)
    atomic_write(folder / files.TIMELINE, bytes(row[3]))
    for shot, data in shots:
        if _NAME_RE.fullmatch(str(shot)):
            atomic_write(folder / files.SHOTS / str(shot), bytes(data))
    atomic_write(folder / files.INDEX, str(row[2]).encode() + b"\n")
    return folder
