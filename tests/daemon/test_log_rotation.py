"""The decision log over months: it rotates by size and by age, keeps N files, and no line a
writer acknowledged is lost while writers in other processes append and the log is rotated
under them; the metrics tail counts across a rotation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfguard.supervisor.daemon.log_rotation import Retention, rotate_if_due, rotated
from sfguard.supervisor.daemon.metrics import DecisionTail

WRITER = r"""
import sys, time
from sfguard.proxy_addons.decision_log import DecisionLog
log = DecisionLog(sys.argv[1])
n, tag = int(sys.argv[2]), sys.argv[3]
for i in range(n):
    log.write(run="r", client=tag, method="CONNECT", host=f"h{i}.test", port=443,
              decision="allow", reason="allowed_by_run", rule=None, addr=None)
    if i % 5 == 0:
        time.sleep(0.01)
log.close()
"""


def lines_of(path: Path, keep: int) -> list[str]:
    out = []
    for p in [*reversed(rotated(path, keep)), path]:
        if p.exists():
            out += p.read_text().splitlines()
    return out


def test_rotation_by_size_keeps_n_files(tmp_path):
    path = tmp_path / "decisions.log"
    r = Retention(max_bytes=4096, max_age_s=3600, keep=3)
    for round_ in range(6):
        path.write_text(json.dumps({"ts": time.time(), "round": round_}) + "\n" + "x" * 5000 + "\n")
        assert rotate_if_due(path, r)
    assert [p.name for p in rotated(path, 10)] == ["decisions.log.1", "decisions.log.2", "decisions.log.3"]
    assert json.loads((tmp_path / "decisions.log.1").read_text().splitlines()[0])["round"] == 5
    assert not rotate_if_due(path, r)              # nothing there now


def test_rotation_by_age(tmp_path):
    path = tmp_path / "decisions.log"
    r = Retention(max_bytes=10**9, max_age_s=3600, keep=2)
    path.write_text(json.dumps({"ts": "2026-01-01T00:00:00.000Z"}) + "\n")
    assert not rotate_if_due(path, r, now=time.mktime((2026, 1, 1, 0, 30, 0, 0, 0, 0)) - time.timezone)
    assert rotate_if_due(path, r, now=time.time())
    assert (tmp_path / "decisions.log.1").exists() and not path.exists()


@pytest.mark.parametrize("bad", [Retention(max_bytes=100), Retention(max_age_s=1), Retention(keep=0)])
def test_retention_settings_are_checked(bad):
    with pytest.raises(ValueError):
        bad.check()


@pytest.mark.parametrize("read_every", [1, 12], ids=["scrape_each_check", "rotations_between_scrapes"])
def test_no_acknowledged_line_is_lost_while_writers_append(tmp_path, read_every):
    path = tmp_path / "decisions.log"
    r = Retention(max_bytes=4096, max_age_s=3600, keep=1000)
    n = 1500
    tail = DecisionTail(path)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n), f"w{k}"],
                                env=dict(os.environ)) for k in range(2)]
    rotations = checks = 0
    deadline = time.monotonic() + 120
    while any(w.poll() is None for w in writers):
        assert time.monotonic() < deadline, "writers did not finish"
        rotations += rotate_if_due(path, r)
        checks += 1
        if checks % read_every == 0:       # a scrape now and then: several rotations between two
            tail.read()
        time.sleep(0.05)
    assert all(w.wait(30) == 0 for w in writers)
    tail.read()
    time.sleep(1.1)
    tail.read()
    got = [json.loads(x) for x in lines_of(path, 1000)]
    assert rotations >= 2
    for k in range(2):
        hosts = [g["host"] for g in got if g["client"] == f"w{k}"]
        assert hosts == [f"h{i}.test" for i in range(n)], f"writer w{k}: {len(hosts)} of {n} lines, in order"
    assert tail.counts[("allow", "allowed_by_run")] == 2 * n
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in [*rotated(path, 1000), path] if p.exists())
