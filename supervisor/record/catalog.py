"""The records of a home (and of a fleet, on the shared store): listed, found, and checked
against the audit chain. Read-only: nothing here writes a record (the shared store's records
are copied into a cache folder to be read). Used by `sfguard runs` and the console."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from sfguard.supervisor.record import files, shared, view

#: where records of other hosts are copied to be read (under the home's records folder)
SHARED_CACHE = ".shared"


def listing(root: Path, backend: Any = None) -> list[dict[str, Any]]:
    """Every record, newest first, as listings show them: this home's, and with a shared
    store every host's (a record in both counts once)."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for folder in files.folders(root):
        index = files.read_index(folder)
        if index is not None:
            seen[(str(index.get("host")), folder.name)] = view.summary_line(index)
    if backend is not None:
        for index in shared.listing(backend):
            seen.setdefault((str(index.get("host")), str(index.get("record"))), view.summary_line(index))
    return sorted(seen.values(), key=lambda line: -line["started_epoch"])


def find(root: Path, name: str, backend: Any = None, cache: Path | None = None) -> Path | None:
    """The folder of record `name` (a record's name or a run id, its newest record): this
    home's, else a copy from the shared store."""
    local = files.find(root, name)
    if local is not None or backend is None:
        return local
    return shared.fetch(backend, name, cache or root / SHARED_CACHE)


def audited(records: list[dict[str, Any]]) -> tuple[dict[str, set[str]], set[str]]:
    """From audit records: the digests sealed under each record name (on a shared store several
    hosts may have used a run id), and the records removed by the retention."""
    digests: dict[str, set[str]] = {}
    removed: set[str] = set()
    for rec in records:
        fields = rec.get("fields") or {}
        name = fields.get("record")
        if not isinstance(name, str):
            continue
        if rec.get("event") == "run_recorded" and isinstance(fields.get("record_sha256"), str):
            digests.setdefault(name, set()).add(fields["record_sha256"])
            removed.discard(name)
        elif rec.get("event") == "run_record_removed":
            removed.add(name)
    return digests, removed


def verify(root: Path, records: list[dict[str, Any]], name: str | None = None,
           folder: Path | None = None) -> list[dict[str, Any]]:
    """Each record (or the one named) checked: its timeline's chain, its screenshots, its index
    against the digest the audit chain keeps; a sealed record missing without a retention
    record is a problem too. One result per record: {record, run_id, state, ok, problems}."""
    digests, removed = audited(records)
    targets = [folder] if folder is not None else (
        [p for p in [files.find(root, name)] if p is not None] if name else files.folders(root))
    out: list[dict[str, Any]] = []
    for path in targets:
        index = files.read_index(path) or {}
        if index.get("state") == "active":
            out.append({"record": path.name, "run_id": index.get("run_id"), "state": "active", "ok": True,
                        "problems": [], "note": "the run is still going: sealed when it ends"})
            continue
        problems = files.check(path, digests.get(index.get("record") or path.name))
        out.append({"record": path.name, "run_id": index.get("run_id"), "state": index.get("state"),
                    "ok": not problems, "problems": problems})
    if name is None and folder is None:
        present = {p.name for p in files.folders(root)}
        for missing in sorted(set(digests) - present - removed):
            out.append({"record": missing, "run_id": None, "state": "missing", "ok": False,
                        "problems": ["the audit chain says this record was sealed, but it is gone and "
                                     "no retention removed it (deleted by hand?)"]})
    if name is not None and not targets:
        out.append({"record": name, "run_id": None, "state": "missing", "ok": False,
                    "problems": ["no such record in this home" + (" (removed by the retention)"
                                                                  if name in removed else "")]})
    return out
