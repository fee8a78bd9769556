"""A run record's files: appended as the run goes, read back after a crash, and every edit
found against the digest the audit chain keeps (issue 48)."""
from __future__ import annotations

import json
import os
import stat
import time

import pytest

from sfguard.supervisor.record import catalog, files


def make(tmp_path, n=5, shots=1):
    folder = files.new_folder(tmp_path / "records", "run-1")
    w = files.RecordWriter(folder)
    for i in range(n):
        w.append({"kind": "command", "t": float(i), "ts": "2030-01-01T00:00:00.000Z", "method": f"Page.m{i}"})
    for i in range(shots):
        w.add_shot(f"{i + 1:05d}.jpg", b"\xff\xd8jpeg" + bytes([i]))
    w.close()
    index = {"record": folder.name, "run_id": "run-1", "state": "ended", "entries": w.seq, "head": w.head,
             "shots": dict(w.shots), "started": time.time(), "ended": time.time()}
    return folder, files.write_index(folder, index)


def test_modes_and_reading_back(tmp_path):
    folder, _ = make(tmp_path)
    for p in [folder, folder / files.SHOTS]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    for p in [folder / files.TIMELINE, folder / files.INDEX, folder / files.SHOTS / "00001.jpg"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    entries, head, problems = files.read_entries(folder)
    assert [e["seq"] for e in entries] == [1, 2, 3, 4, 5] and problems == []
    assert head == files.read_index(folder)["head"]


def _edit_line(folder):
    lines = (folder / files.TIMELINE).read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"Page.m2", b"Page.mX")
    (folder / files.TIMELINE).write_bytes(b"".join(lines))


def _drop_line(folder):
    lines = (folder / files.TIMELINE).read_bytes().splitlines(keepends=True)
    (folder / files.TIMELINE).write_bytes(b"".join(lines[:1] + lines[2:]))


def _rechain(folder):
    """An edit that recomputes every hash after it: the chain holds, the index does not."""
    entries, _, _ = files.read_entries(folder)
    entries[1]["method"] = "Page.forged"
    head, out = files.GENESIS, b""
    for e in entries:
        body = files.canonical(e)
        head = files.link(head, body)
        out += body[:-1] + b',"h":"' + head.encode() + b'"}\n'
    (folder / files.TIMELINE).write_bytes(out)


def _edit_index(folder):
    index = files.read_index(folder)
    index["outcome"] = "succeeded"
    (folder / files.INDEX).write_bytes(files.canonical(index) + b"\n")


def _rewrite_index_too(folder):
    _rechain(folder)
    index = files.read_index(folder)
    index["head"] = files.read_entries(folder)[1]
    (folder / files.INDEX).write_bytes(files.canonical(index) + b"\n")


def _edit_shot(folder):
    (folder / files.SHOTS / "00001.jpg").write_bytes(b"\xff\xd8other")


def _drop_shot(folder):
    (folder / files.SHOTS / "00001.jpg").unlink()


EDITS = [(_edit_line, "does not match the chain"), (_drop_line, "does not match the chain"),
         (_rechain, "the timeline ends at"), (_edit_index, "does not match its digest"),
         (_rewrite_index_too, "does not match its digest"), (_edit_shot, "does not match its hash"),
         (_drop_shot, "is missing")]


@pytest.mark.parametrize("edit,found", EDITS, ids=[e[0].__name__ for e in EDITS])
def test_every_edit_is_found_against_the_audited_digest(tmp_path, edit, found):
    folder, sha = make(tmp_path)
    assert files.check(folder, sha) == []          # the positive control: untouched, nothing found
    edit(folder)
    problems = files.check(folder, sha)
    assert any(found in p for p in problems), problems


def test_a_record_cut_by_a_kill_is_read_up_to_its_last_whole_line(tmp_path):
    folder = files.new_folder(tmp_path / "records", "run-1")
    w = files.RecordWriter(folder)
    for i in range(3):
        w.append({"kind": "command", "n": i})
    with open(folder / files.TIMELINE, "ab") as fh:
        fh.write(b'{"kind":"comm')          # a write the kill cut
    entries, head, problems = files.read_entries(folder)
    assert [e["n"] for e in entries] == [0, 1, 2] and "incomplete" in problems[0]
    assert files.on_disk(folder).seq == 3 and files.on_disk(folder).head == head


def test_a_run_id_used_again_gets_a_record_of_its_own(tmp_path):
    root = tmp_path / "records"
    a, b = files.new_folder(root, "r1"), files.new_folder(root, "r1")
    assert (a.name, b.name) == ("r1", "r1~2")


def test_prune_removes_old_ended_records_and_the_oldest_beyond_the_total(tmp_path):
    root = tmp_path / "records"
    now = time.time()
    for name, ended, state in [("old", now - 30 * 86400, "ended"), ("mid", now - 86400, "ended"),
                               ("new", now - 60, "ended"), ("live", None, "active")]:
        folder = files.new_folder(root, name)
        (folder / "blob").write_bytes(b"x" * 1000)
        files.write_index(folder, {"record": name, "state": state, "started": (ended or now) - 10, "ended": ended})
    removed = files.prune(root, 14 * 86400, max_total=2500, now=now, active=frozenset({"live"}))
    assert removed == ["old", "mid"]
    assert sorted(p.name for p in root.iterdir()) == ["live", "new"]


def test_verify_names_a_sealed_record_deleted_by_hand_but_not_one_the_retention_removed(tmp_path):
    root = tmp_path / "records"
    folder, sha = make(tmp_path)
    audit = [{"event": "run_recorded", "fields": {"record": "run-1", "record_sha256": sha}},
             {"event": "run_recorded", "fields": {"record": "gone", "record_sha256": "ab" * 32}},
             {"event": "run_recorded", "fields": {"record": "pruned", "record_sha256": "cd" * 32}},
             {"event": "run_record_removed", "fields": {"record": "pruned"}}]
    results = {r["record"]: r for r in catalog.verify(root, audit)}
    assert results["run-1"]["ok"] and not results["gone"]["ok"] and "pruned" not in results
    assert "deleted by hand" in results["gone"]["problems"][0]


def test_an_entry_line_is_canonical_json_with_its_hash(tmp_path):
    folder, _ = make(tmp_path, n=1, shots=0)
    line = (folder / files.TIMELINE).read_bytes().splitlines()[0]
    entry = json.loads(line)
    h = entry.pop("h")
    assert files.link(files.GENESIS, files.canonical(entry)) == h
    assert os.stat(folder / files.TIMELINE).st_size == len(line) + 1
