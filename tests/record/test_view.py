"""A record as a person reads it: the order things happened in, pictures beside what they show,
links both ways, filters; the export archive (issue 48)."""
from __future__ import annotations

import json
import zipfile

import pytest

from sfguard.supervisor.record import export, files, view

ENTRIES = [
    {"seq": 1, "t": 1.0, "ts": "2030-01-01T00:00:01.000Z", "kind": "stage_ready", "stage": "a", "attempt": 1},
    {"seq": 2, "t": 2.0, "ts": "2030-01-01T00:00:02.000Z", "kind": "command", "stage": "a", "method": "Page.navigate",
     "url": "http://b.test/"},
    # a proxy line arrives later (the decision log is read every 250 ms) but happened first
    {"seq": 4, "t": 2.1, "ts": "2030-01-01T00:00:02.100Z", "kind": "proxy", "stage": "a", "verdict": "deny",
     "reason": "not_allowed", "host": "b.test", "port": 80, "method": "GET", "links": {"command": 2}},
    {"seq": 3, "t": 2.5, "ts": "2030-01-01T00:00:02.500Z", "kind": "loaded", "stage": "a", "url": "http://b.test/"},
    {"seq": 5, "t": 2.6, "ts": "2030-01-01T00:00:02.600Z", "kind": "screenshot", "stage": "a", "why": "navigation",
     "shot": "00001.jpg", "links": {"for": 3}},
    {"seq": 6, "t": 3.0, "ts": "2030-01-01T00:00:03.000Z", "kind": "write", "stage": "b", "verdict": "held",
     "method": "POST", "host": "a.test", "port": 443, "path": "/buy", "approval": "ap_1",
     "links": {"shot": "00002.png"}},
    {"seq": 7, "t": 4.0, "ts": "2030-01-01T00:00:04.000Z", "kind": "write", "stage": "b", "verdict": "approved",
     "method": "POST", "host": "a.test", "port": 443, "path": "/buy", "by": "console:ana", "links": {"held": 6}},
    {"seq": 8, "t": 5.0, "ts": "2030-01-01T00:00:05.000Z", "kind": "command", "stage": "b",
     "method": "Storage.getCookies", "refused": "cookie dump"},
]


def test_rows_follow_the_order_things_happened_and_link_both_ways():
    rows = view.rows(ENTRIES)
    assert [r["seq"] for r in rows] == [1, 2, 4, 3, 6, 7, 8]      # the picture beside the load it shows
    assert [r["seq"] for r in view.rows(ENTRIES, kind="screenshot")] == [5]
    by = {r["seq"]: r for r in rows}
    assert by[2]["from"] == [4] and by[4]["to"] == [2]          # the navigation and its refusal
    assert by[3]["shots"] == ["00001.jpg"]                       # a load with its picture
    assert by[6]["shots"] == ["00002.png"] and by[6]["from"] == [7] and by[7]["to"] == [6]
    assert "approved" in by[7]["text"] and "console:ana" in by[7]["text"]


@pytest.mark.parametrize("filters,want", [
    ({"stage": "b"}, [6, 7, 8]), ({"kind": "write"}, [6, 7]), ({"kind": "stage"}, [1]),
    ({"only_refused": True}, [4, 8]), ({"stage": "a", "only_refused": True}, [4]),
])
def test_filters(filters, want):
    assert [r["seq"] for r in view.rows(ENTRIES, **filters)] == want


def test_the_same_plain_command_sent_again_at_once_is_one_row():
    ping = {"kind": "command", "stage": "a", "method": "Browser.getVersion"}
    got = view.rows([{**ping, "seq": i, "t": float(i)} for i in range(1, 4)] +
                    [{**ping, "seq": 4, "t": 4.0, "refused": "x"}, {**ping, "seq": 5, "t": 5.0}])
    assert [(r["seq"], r["repeat"]) for r in got] == [(1, 3), (4, 1), (5, 1)]
    assert len(view.rows([{**ping, "seq": i, "t": float(i)} for i in range(1, 4)], fold=False)) == 3


def test_the_moment_of_a_decision_line_is_the_nearest_entry():
    rows = view.rows(ENTRIES)
    assert view.nearest(rows, "2030-01-01T00:00:02.110Z") == 4


def test_the_export_is_one_archive_that_needs_nothing_else(tmp_path):
    folder = files.new_folder(tmp_path / "records", "r1")
    w = files.RecordWriter(folder)
    for e in ENTRIES:
        w.append({k: v for k, v in e.items() if k != "seq"})
    w.add_shot("00001.jpg", b"\xff\xd8a")
    w.add_shot("00002.png", b"\x89PNGb")
    w.close()
    files.write_index(folder, {"record": "r1", "run_id": "r1", "host": "h", "state": "ended", "stages": ["a", "b"],
                               "profiles": ["acct"], "started": 1.0, "ended": 2.0, "pipeline": "p.yaml"})
    out = export.export(folder, tmp_path / "r1.zip")
    assert out["entries"] == len(ENTRIES) and out["screenshots"] == 2
    with zipfile.ZipFile(tmp_path / "r1.zip") as z:
        names = set(z.namelist())
        html = z.read("r1/index.html").decode()
        lines = z.read("r1/timeline.jsonl").decode().splitlines()
    assert {"r1/timeline.jsonl", "r1/index.json", "r1/shots/00001.jpg", "r1/shots/00002.png", "r1/index.html"} <= names
    assert len(lines) == len(ENTRIES) and json.loads(lines[0])["kind"] == "stage_ready"
    assert 'src="shots/00001.jpg"' in html and "Storage.getCookies REFUSED" in html
    assert "<script" not in html and "http://" not in html.split("<table", 1)[0].split("<style>")[0]


@pytest.mark.parametrize("filters,want", [
    ({"text": "nightly ana"}, True), ({"text": "nightly bob"}, False), ({"pipeline": "NIGHT"}, True),
    ({"profile": "ana"}, True), ({"profile": "an"}, False), ({"outcome": "failed"}, True),
    ({"outcome": "succeeded"}, False), ({"since": 1000.0}, True), ({"since": 2001.0}, False),
    ({"until": 2001.0}, True), ({"until": 2000.0}, False),
])
def test_a_listing_is_searched_by_words_pipeline_profile_outcome_and_dates(filters, want):
    line = view.summary_line({"record": "r9", "run_id": "r9", "host": "h", "pipeline": "nightly.yaml",
                              "profiles": ["ana"], "stages": ["s"], "state": "ended", "outcome": "failed",
                              "started": 2000.0, "ended": 2100.0})
    assert view.matches(line, **filters) is want
