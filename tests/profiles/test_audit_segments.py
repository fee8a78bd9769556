"""The audit log over months: it closes into segments that continue one chain; verify walks
them all and finds a removed, emptied, reordered, renamed or edited segment; old segments leave
only through `archive`, whose keyed anchor says where the kept chain starts; show and the CLI
read across segments."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sfguard.supervisor.profiles.audit import LocalAuditSink, canonical
from sfguard.supervisor.profiles.keys import FileKeyProvider

N = 60


def sink_of(home: Path, **kw) -> LocalAuditSink:
    return LocalAuditSink(home, FileKeyProvider(home), **kw)


@pytest.fixture
def home(tmp_path) -> Path:
    h = tmp_path / "home"
    s = sink_of(h, segment_bytes=2500)
    for i in range(N):
        s.record("profile_leased", scope="local", profile="shop", run=f"run-{i}")
    return h


def segs(home: Path) -> list[Path]:
    return sink_of(home).segments()


def verify(home: Path):
    return sink_of(home).verify()


def test_segments_continue_one_chain(home):
    files = segs(home)
    assert len(files) >= 3
    assert stat.S_IMODE((home / "audit.d").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    r = verify(home)
    assert r.ok and r.records == N, str(r)
    recs = sink_of(home).records()
    assert [x["seq"] for x in recs] == list(range(1, N + 1))
    assert [x["fields"]["run"] for x in sink_of(home).records(run="run-7")] == ["run-7"]
    # each segment is named after its first record and links to the one before
    for f in files:
        first = json.loads(f.read_text().splitlines()[0])
        assert first["seq"] == int(f.name[:12])


def test_a_segment_closes_by_age(tmp_path):
    h = tmp_path / "home"
    s = sink_of(h, segment_age_s=0)
    for i in range(3):
        s.record("profile_leased", scope="local", profile="shop", run=f"run-{i}")
    assert [p.name for p in s.segments()] == ["000000000001.log", "000000000002.log", "000000000003.log"]
    assert not s.log_path.exists() and s.verify().ok


def _remove_middle(home):
    segs(home)[1].unlink()


def _empty_middle(home):
    segs(home)[1].write_bytes(b"")


def _remove_first(home):
    segs(home)[0].unlink()


def _swap_names(home):
    a, b = segs(home)[0], segs(home)[1]
    tmp = a.with_name("x")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _rename_one(home):
    a = segs(home)[1]
    a.rename(a.with_name(f"{int(a.name[:12]) + 1:012d}.log"))


def _edit_middle(home):
    f = segs(home)[1]
    lines = f.read_text().splitlines(keepends=True)
    rec = json.loads(lines[1])
    rec["fields"]["run"] = "run-forged"
    lines[1] = canonical(rec).decode() + "\n"
    f.write_text("".join(lines))


def _stray_file(home):
    (home / "audit.d" / "notes.txt").write_text("x")


def _unkeyed_anchor(home):
    (home / "audit.anchor").write_text(json.dumps({"seq": 10, "hash": "0" * 64, "mac": "0" * 64}))


TAMPER = {
    "middle segment removed": (_remove_middle, "expected"),
    "middle segment emptied": (_empty_middle, "expected"),
    "first segment removed without archive": (_remove_first, "missing"),
    "two segments swapped": (_swap_names, ""),
    "a segment renamed": (_rename_one, "renamed"),
    "a record edited in a middle segment": (_edit_middle, "edited"),
    "a stray file among the segments": (_stray_file, "not a segment"),
    "an anchor written without the key": (_unkeyed_anchor, "anchor"),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampering_with_segments_is_found(home, case):
    change, word = TAMPER[case]
    change(home)
    r = verify(home)
    assert not r.ok, case
    assert word in str(r), str(r)


def test_an_edit_is_placed_in_its_segment(home):
    _edit_middle(home)
    r = verify(home)
    assert r.segment == f"audit.d/{segs(home)[1].name}" and r.line == 2, str(r)


def test_archive_moves_old_segments_with_a_keyed_anchor(home, tmp_path):
    before = segs(home)
    keep_from = int(before[2].name[:12])
    moved = sink_of(home).archive(keep_from, tmp_path / "cold")
    assert [p.name for p in moved] == [p.name for p in before[:2]]
    assert all((tmp_path / "cold" / p.name).exists() for p in before[:2])
    r = verify(home)
    assert r.ok, str(r)
    assert r.records == N + 1 - (keep_from - 1)     # the kept ones and the audit_archived record
    last = sink_of(home).records()[-1]
    assert last["event"] == "audit_archived" and last["fields"]["seq"] == keep_from
    # the anchor moves the start only where it says: one more segment gone is found
    segs(home)[0].unlink()
    assert not verify(home).ok


def test_archive_never_hides_damage(home, tmp_path):
    _edit_middle(home)
    with pytest.raises(Exception, match="does not verify"):
        sink_of(home).archive(N, tmp_path / "cold")
    assert not (tmp_path / "cold").exists()


def test_removing_the_anchor_after_an_archive_is_found(home, tmp_path):
    sink_of(home).archive(int(segs(home)[2].name[:12]), tmp_path / "cold")
    (home / "audit.anchor").unlink()
    r = verify(home)
    assert not r.ok and "missing" in str(r)


def test_cli_verify_show_and_archive_across_segments(home, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(home)],
                              capture_output=True, text=True, timeout=60, env=dict(os.environ))
    v = cli("audit", "verify")
    assert v.returncode == 0 and f"{N} record(s)" in v.stdout, v.stderr
    show = cli("audit", "show", "--json")
    assert show.returncode == 0 and len(show.stdout.splitlines()) == N
    keep = int(segs(home)[1].name[:12])
    a = cli("audit", "archive", "--keep-from", str(keep), "--to", str(tmp_path / "cold"))
    assert a.returncode == 0 and "archived 1 segment" in a.stdout, a.stdout + a.stderr
    assert cli("audit", "verify").returncode == 0
    _remove_middle(home)
    bad = cli("audit", "verify")
    assert bad.returncode == 1 and "broken" in bad.stderr
