"""ProcRecord / terminate_recorded / scan_orphans against real processes we start."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from sfguard.supervisor.procs import ProcRecord, scan_orphans, terminate_recorded

SLEEPER = "import signal, sys, time\n{setup}\nprint('ready', flush=True)\ntime.sleep(60)\n"


def spawn(*extra: str, ignore_term: bool = False, env: dict | None = None) -> subprocess.Popen:
    """A sleeping Python process; returns once its signal setup is done."""
    setup = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else ""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER.format(setup=setup), *extra],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=5)


def test_record_round_trips_through_json(procs):
    p = spawn()
    procs.append(p)
    rec = ProcRecord.of(p.pid, "browser")
    again = ProcRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert again == rec and again.alive()


@pytest.mark.parametrize("data", [
    {"pid": 0, "create_time": 1.0, "kind": "browser"},
    {"pid": "12", "create_time": 1.0, "kind": "browser"},
    {"pid": 12, "create_time": "x", "kind": "browser"},
    {"pid": 12, "create_time": 1.0, "kind": "shell"},
])
def test_bad_records_are_refused(data):
    with pytest.raises(ValueError):
        ProcRecord.from_json(data)


def test_terminate_ends_a_recorded_process(procs):
    p = spawn()
    procs.append(p)
    ended = terminate_recorded([ProcRecord.of(p.pid, "other")], 5)
    assert [r.pid for r in ended] == [p.pid]
    assert p.wait(timeout=5) == -signal.SIGTERM


def test_terminate_kills_a_process_that_ignores_sigterm(procs):
    p = spawn(ignore_term=True)
    procs.append(p)
    terminate_recorded([ProcRecord.of(p.pid, "other")], 0.5)
    assert p.wait(timeout=5) == -signal.SIGKILL


def test_a_reused_pid_is_never_signalled(procs):
    """Same pid, different start time (what pid reuse looks like): left alone."""
    p = spawn()
    procs.append(p)
    real = ProcRecord.of(p.pid, "other")
    stale = ProcRecord(p.pid, real.create_time - 100.0, "other")
    assert terminate_recorded([stale], 0.5) == []
    time.sleep(0.2)
    assert p.poll() is None


def test_browser_record_ends_its_whole_process_group(procs):
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(c.pid, flush=True)\ntime.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    procs.append(leader)
    child = int(leader.stdout.readline())
    terminate_recorded([ProcRecord.of(leader.pid, "browser")], 5)
    assert leader.wait(timeout=5) != 0
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "child of the browser group survived"
        time.sleep(0.05)


def test_scan_finds_tool_processes_by_cmdline_or_environ_only_under_the_marker(procs, tmp_path):
    marker = tmp_path / "rt"
    sibling = tmp_path / "rt-other"
    by_cmd = spawn("--fake-chromium", f"--user-data-dir={marker}/p1")
    by_env = spawn("agent-browser-fake-daemon", env={**os.environ, "AGENT_BROWSER_SOCKET_DIR": f"{marker}/s"})
    other_dir = spawn("--fake-chromium", f"--user-data-dir={sibling}/p1")
    not_a_tool = spawn(f"{marker}/p1")
    procs.extend([by_cmd, by_env, other_dir, not_a_tool])
    found = {r.pid: r.kind for r in scan_orphans([marker])}
    assert found == {by_cmd.pid: "browser", by_env.pid: "daemon"}
    assert scan_orphans([]) == []
