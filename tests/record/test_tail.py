"""The decision log followed as it grows, across its rotation (issue 48)."""
from __future__ import annotations

import asyncio
import json
import os

from sfguard.supervisor.daemon.log_rotation import Retention, rotate_if_due
from sfguard.supervisor.record.tail import Tail, follow


def line(n: int, run: str = "r1") -> bytes:
    return json.dumps({"ts": "2030-01-01T00:00:00.000Z", "run": run, "n": n}).encode() + b"\n"


def test_lines_from_the_end_whole_ones_only_and_across_a_rotation(tmp_path):
    log = tmp_path / "decisions.log"
    log.write_bytes(line(0))                     # before the tail: not read
    tail = Tail(log)
    with open(log, "ab") as fh:
        fh.write(line(1) + line(2)[:10])         # a line half written
    assert [json.loads(x)["n"] for x in tail.lines()] == [1]
    with open(log, "ab") as fh:
        fh.write(line(2)[10:] + line(3))
    assert [json.loads(x)["n"] for x in tail.lines()] == [2, 3]
    with open(log, "ab") as fh:
        fh.write(line(4))                        # written just before the rename
    assert rotate_if_due(log, Retention(max_bytes=4096, max_age_s=60, keep=3), now=4e9)
    with open(log, "ab") as fh:
        fh.write(line(5))
    assert [json.loads(x)["n"] for x in tail.lines()] == [4, 5]
    tail.close()


def test_a_log_not_made_yet_is_read_from_its_start(tmp_path):
    log = tmp_path / "decisions.log"
    tail = Tail(log)
    assert tail.lines() == []
    log.write_bytes(line(1))
    assert [json.loads(x)["n"] for x in tail.lines()] == [1]
    tail.close()


async def test_follow_hands_each_run_line_on(tmp_path):
    log = tmp_path / "decisions.log"
    log.write_bytes(b"")
    got: list[dict] = []
    task = asyncio.get_running_loop().create_task(follow(log, got.append, poll=0.05))
    await asyncio.sleep(0.2)
    with open(log, "ab") as fh:
        fh.write(line(1) + b"not json\n" + json.dumps({"run": None}).encode() + b"\n" + line(2, "r2"))
    for _ in range(40):
        if len(got) >= 2:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert [(d["run"], d["n"]) for d in got] == [("r1", 1), ("r2", 2)]
    assert os.path.exists(log)
