"""`sfguard runs export RUN --out FILE`: a run record as one self-contained zip archive.

    <record>/timeline.jsonl   the timeline as the guard wrote it (hash chain included)
    <record>/index.json       the index whose digest the audit chain keeps
    <record>/shots/...        the screenshots
    <record>/index.html       a static page of the timeline with its screenshots: open it in
                              any browser, without the guard (no script, nothing fetched)

Written whole (a temp file renamed over FILE, mode 0600): an export cut short leaves no file.
"""
from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import jinja2

from sfguard.supervisor.home import atomic_write
from sfguard.supervisor.record import files, view

HERE = Path(__file__).resolve().parent


def page(index: dict[str, Any], entries: list[dict[str, Any]]) -> str:
    """The static page of a record (its screenshots named `shots/NAME` beside it)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE)), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    index = {"record": "", "run_id": "", "host": "", "pipeline": None, "profiles": [], "stages": [],
             "outcome": None, "state": None, **index}
    return env.get_template("export.html").render(index=index, rows=view.rows(entries), count=len(entries),
                                                  line=view.summary_line(index))


def export(folder: Path, out: Path) -> dict[str, Any]:
    """Write the archive of the record in `folder` to `out`; what it holds."""
    index = files.read_index(folder) or {"run_id": folder.name, "record": folder.name}
    entries, _head, problems = files.read_entries(folder)
    buf = io.BytesIO()
    base = folder.name
    shots = sorted(p for p in (folder / files.SHOTS).glob("*") if p.is_file() and not p.is_symlink())
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in (files.TIMELINE, files.INDEX):
            path = folder / name
            if path.is_file():
                z.writestr(f"{base}/{name}", path.read_bytes())
        for p in shots:
            z.writestr(f"{base}/{files.SHOTS}/{p.name}", p.read_bytes(), zipfile.ZIP_STORED)
        z.writestr(f"{base}/index.html", page(index, entries))
    atomic_write(out, buf.getvalue())
    return {"out": str(out), "entries": len(entries), "screenshots": len(shots), "problems": problems,
            "bytes": len(buf.getvalue())}
