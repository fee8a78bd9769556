"""A clean stop of the guard (SIGINT or SIGTERM, as Ctrl-C and systemd send them) while a
`sfguard stage-exec` command holds its gate and proxy bridges open logs no ERROR and no
traceback: an operator's "alert on ERROR" rule must not fire on every restart (issue 46)."""
from __future__ import annotations

import json
import signal
import subprocess

import pytest

from tests.stage_exec.conftest import STAGE_PYTHON, runner_env, stage_exec_argv
from tests.stage_exec.test_stage_exec import ready_stage

#: opens one connection through each bridge, says so, and keeps them open until cut
HOLD = r"""
import socket, sys, time
gate, proxy = int(sys.argv[1]), int(sys.argv[2])
held = []
for port, req in ((gate, b"GET /json/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
                  (proxy, b"GET http://site-a.test/ HTTP/1.1\r\nHost: site-a.test\r\n\r\n")):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(req)
    s.settimeout(5)
    s.recv(100)
    held.append(s)
print("holding", flush=True)
for s in held:
    s.settimeout(60)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
print("cut", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_clean_stop_with_stage_exec_open_logs_no_error(daemon, workspace, sig, log_format):
    daemon.stop()
    daemon.log.write_text("")
    daemon.start("--log-format", log_format)
    ready_stage(daemon)
    info = daemon.call("GET", "/v1/runs/r1/stages/s1/exec")[1]
    (workspace / "hold.py").write_text(HOLD)
    proc = subprocess.Popen(stage_exec_argv(daemon.home, "r1", "s1", STAGE_PYTHON, "hold.py",
                                            str(info["bridges"]["gate_port"]),
                                            str(info["bridges"]["proxy_port"])),
                            cwd=workspace, env=runner_env(daemon.home), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding", proc.stderr.read() if proc.poll() else ""
        assert daemon.stop(sig) == 0
        out, _err = proc.communicate(timeout=60)
        assert "cut" in out                 # the guard's stop cut the stage's connections
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = daemon.log.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "the guard logged nothing"
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        bad = [r for r in records if r["level"] in ("ERROR", "CRITICAL") or "exc" in r]
    else:
        bad = [line for line in lines if " ERROR " in line or " CRITICAL " in line
               or "Traceback" in line or "CancelledError" in line]
    assert bad == [], "\n".join(map(str, bad))

