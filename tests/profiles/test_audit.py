"""The audit log: chain intact, every kind of tampering found and named, CLI exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise

import pytest

from sfguard.supervisor.profiles.audit import AuditFieldError, LocalAuditSink
from sfguard.supervisor.profiles.keys import FileKeyProvider
from sfguard.supervisor.testing import FakeAuditSink
from tests.profiles.conftest import ROOT, sfguard


def fill(sink, n=6):
    for i in range(n):
        sink.record("profile_leased", scope="local", profile=f"p{i % 2}", run=f"run-{i}")


def local_sink(home):
    """The sink with the key provider the CLI uses on this machine (no keyring backend: the
    key file). Explicit, because another test module defines a keyring backend class, which
    makes `keyring` in this process pick it."""
    return LocalAuditSink(home, FileKeyProvider(home))


@pytest.fixture
def sink(tmp_path):
    s = local_sink(tmp_path / "home")
    fill(s)
    return s


def lines(sink):
    return sink.log_path.read_text().splitlines(keepends=True)


def write(sink, ls):
    sink.log_path.write_text("".join(ls))


def test_intact_log_verifies_and_is_private(sink):
    r = sink.verify()
    assert r.ok and r.records == 6
    assert oct(os.stat(sink.log_path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(sink.head_path).st_mode & 0o777) == "0o600"
    recs = [json.loads(x) for x in lines(sink)]
    assert [r["seq"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert all(b["prev"] == a["hash"] for a, b in pairwise(recs))


def _edit(ls):
    rec = json.loads(ls[2])
    rec["fields"]["run"] = "run-evil"
    ls[2] = json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n"
    return ls, 3


def _edit_and_rehash(ls):
    from sfguard.supervisor.profiles.audit import record_hash
    rec = json.loads(ls[2])
    rec["fields"]["run"] = "run-evil"
    rec["hash"] = record_hash(rec)
    ls[2] = json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n"
    return ls, 3                                  # the hash fits, the keyed MAC does not


def _delete(ls):
    del ls[3]
    return ls, 4


def _insert(ls):
    ls.insert(2, ls[1])
    return ls, 3


def _reorder(ls):
    ls[2], ls[3] = ls[3], ls[2]
    return ls, 3


def _truncate_tail(ls):
    return ls[:4], 5


def _cut_mid_record(ls):
    ls[-1] = ls[-1][:20]
    return ls, 6


def _garbage(ls):
    ls[1] = "not json\n"
    return ls, 2


CASES = {"edit": _edit, "edit+rehash": _edit_and_rehash, "delete": _delete, "insert": _insert,
         "reorder": _reorder, "truncate": _truncate_tail, "cut": _cut_mid_record, "garbage": _garbage}


@pytest.mark.parametrize("how", CASES)
def test_tampering_detected_and_named(sink, how):
    ls, bad_line = CASES[how](lines(sink))
    write(sink, ls)
    r = sink.verify()
    assert not r.ok
    assert r.line == bad_line, str(r)
    assert f"line {bad_line}" in str(r)


@pytest.mark.parametrize("how", ["edit", "truncate"])
def test_cli_verify_exit_code_names_record(sink, how):
    ls, bad_line = CASES[how](lines(sink))
    write(sink, ls)
    proc = sfguard("audit", "verify", home=sink.home)
    assert proc.returncode == 1
    assert f"line {bad_line}" in proc.stderr and proc.stdout == ""


def test_truncate_all_detected(sink):
    write(sink, [])
    r = sink.verify()
    assert not r.ok and "truncated" in r.reason


def test_append_after_truncation_keeps_break_visible(sink):
    write(sink, lines(sink)[:3])
    sink.record("profile_released", scope="local", profile="p0", run="run-9")
    assert not sink.verify().ok


def test_concurrent_appenders_keep_chain(tmp_path):
    home = tmp_path / "home"
    LocalAuditSink(home)
    code = ("import sys\nfrom sfguard.supervisor.profiles.audit import LocalAuditSink\n"
            "s=LocalAuditSink(sys.argv[1])\n"
            "for i in range(50): s.record('denials_aggregated', run='run-'+sys.argv[2], "
            "hosts={'a.example': i}, count=i)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(home), str(w)], cwd=ROOT, env=env)
             for w in range(4)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    r = local_sink(home).verify()
    assert r.ok and r.records == 200


@pytest.mark.parametrize("event,fields", [
    ("cookie_dumped", {}),
    ("profile_leased", {"cookie": "sid=secret"}),
    ("profile_leased", {"token": "abc"}),
    ("profile_leased", {"profile": "../x"}),
    ("profile_leased", {"run": "run 1; rm"}),
    ("denials_aggregated", {"hosts": {"a.example": -1}}),
    ("denials_aggregated", {"host": "evil.example/?c=sid=1"}),
    ("login_checked", {"reason": "Set-Cookie: sid=secret"}),
])
@pytest.mark.parametrize("make", [lambda p: LocalAuditSink(p / "h"), lambda p: FakeAuditSink()],
                         ids=["local", "fake"])
def test_refuses_unknown_events_and_fields(tmp_path, make, event, fields):
    s = make(tmp_path)
    with pytest.raises(AuditFieldError) as err:
        s.record(event, **fields)
    assert "secret" not in str(err.value)
    assert s.records() == []


def test_cli_show_filters_and_json(sink):
    proc = sfguard("audit", "show", "--profile", "p1", "--json", home=sink.home)
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [r["fields"]["run"] for r in recs] == ["run-1", "run-3", "run-5"]
    proc = sfguard("audit", "show", "--run", "run-2", home=sink.home)
    assert proc.returncode == 0 and "run=run-2" in proc.stdout and proc.stdout.count("\n") == 1
    proc = sfguard("audit", "show", "--profile", "../x", home=sink.home)
    assert proc.returncode == 2 and "invalid profile name" in proc.stderr


def test_cli_verify_intact_and_home_flag_wins(sink, tmp_path):
    proc = sfguard("audit", "verify", home=sink.home, env_home=tmp_path / "elsewhere")
    assert proc.returncode == 0 and "6 record(s)" in proc.stdout
    proc = sfguard("audit", "verify", env_home=sink.home)
    assert proc.returncode == 0 and "6 record(s)" in proc.stdout
