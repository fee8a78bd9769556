"""end_child / end_popen (the one terminate-wait-kill for children the guard holds) and
home.atomic_file (the one atomic write), against real processes and files."""
from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys

import psutil
import pytest

from sfguard.supervisor.home import atomic_file, atomic_write
from sfguard.supervisor.procs import end_child, end_popen

# A child that prints "ready" once its signal setup is done; with `grand`, it first starts a
# sleeping grandchild in its own process group and prints that pid.
CHILD = """
import signal, subprocess, sys, time
if {ignore_term}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if {grand}:
    g = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
    print(g.pid, flush=True)
print("ready", flush=True)
time.sleep(60)
"""

# (case, ignores SIGTERM, first wait, the signal that ends it)
CASES = [
    ("exits on SIGTERM", False, 5.0, signal.SIGTERM),
    ("ignores SIGTERM: killed after the wait", True, 0.5, signal.SIGKILL),
    ("wait 0: killed at once", False, 0, signal.SIGKILL),
]


def _code(ignore_term: bool, grand: bool = False) -> str:
    return CHILD.format(ignore_term=ignore_term, grand=grand)


@pytest.mark.parametrize("case, ignore_term, timeout, ended_by", CASES, ids=[c[0] for c in CASES])
async def test_end_child(case, ignore_term, timeout, ended_by):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _code(ignore_term),
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert (await asyncio.wait_for(proc.stdout.readline(), 10)).strip() == b"ready"
        assert await end_child(proc, timeout) is True
        assert proc.returncode == -ended_by
        assert await end_child(proc, timeout) is True  # an ended child: nothing more to do
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("case, ignore_term, timeout, ended_by", CASES, ids=[c[0] for c in CASES])
def test_end_popen(case, ignore_term, timeout, ended_by):
    proc = subprocess.Popen([sys.executable, "-c", _code(ignore_term)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert end_popen(proc, timeout) is True
        assert proc.returncode == -ended_by
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


async def test_end_child_group_ends_the_grandchildren_too():
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _code(True, grand=True),
                                                stdout=asyncio.subprocess.PIPE,
                                                start_new_session=True)
    grand = None
    try:
        grand = psutil.Process(int(await asyncio.wait_for(proc.stdout.readline(), 10)))
        assert (await asyncio.wait_for(proc.stdout.readline(), 10)).strip() == b"ready"
        assert await end_child(proc, 0.5, group=True) is True
        assert proc.returncode == -signal.SIGKILL
        gone, alive = psutil.wait_procs([grand], timeout=5)
        assert not alive, "the grandchild in the child's process group survived"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if grand is not None and grand.is_running():
            grand.kill()


def test_atomic_write_replaces_with_mode(tmp_path):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new", 0o600)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_atomic_file_error_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sealed"
    target.write_bytes(b"previous")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as fh:
            fh.write(b"half of the new")
            raise RuntimeError("the writer failed half-way")
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sealed"]
