"""One proxy process for the daemon and the operator: `python -m sfguard.supervisor.daemon.proxy_child` (what
the daemon starts per run, clients over stdin) and `sfguard proxy` (flags) answer alike and
write the same decision log, and a decision's line is on disk when its client has the answer."""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

from sfguard.supervisor.daemon.run_proxy import child_argv

from .conftest import ROOT, TOKEN_A, _pump, _readline, basic, connect, get, start_proxy, write_policy

A = basic("a", TOKEN_A)
TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class RunChild:
    """`python -O -m sfguard.supervisor.daemon.proxy_child`, started and fed exactly as the daemon's RunProxy."""

    def __init__(self, policy, log, resolve: list[str], send_clients: bool = True) -> None:
        # the daemon's own argv (optimised, -O), port 0 = a free one
        argv = child_argv(0, policy, log, dict(item.split("=", 1) for item in resolve))
        env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, bufsize=1)
        assert self.proc.stdin is not None
        self.stdin = self.proc.stdin
        self.out: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc, self.out), daemon=True).start()
        line = _readline(self.out, time.monotonic() + 30) or ""
        if not line.startswith("ready http://127.0.0.1:"):
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"no ready line: {line!r}")
        self.port = int(line.strip().rsplit(":", 1)[1])
        if send_clients:
            self.send_clients()

    def send_clients(self) -> None:
        self.stdin.write(json.dumps({"id": 7, "clients": [
            {"name": "a", "token": TOKEN_A, "allow": ["site-a.test"], "run": "r-1"}]}) + "\n")
        self.stdin.flush()
        assert json.loads(_readline(self.out, time.monotonic() + 30) or "null") == {"ack": 7}

    def stop(self) -> int:
        self.stdin.close()  # the daemon's end: stdin closes, the proxy stops
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise


@pytest.fixture
def policy_file(tmp_path, echo_server, http_server):
    return write_policy(tmp_path / "sites.yaml", private_allow=["127.0.0.1/32"],
                        ports=(80, 443, echo_server.port, http_server.port))


@pytest.fixture(params=["daemon", "operator"])
def entry(request, tmp_path, policy_file):
    """The same guard through each way in; yields (port, decision log path)."""
    log = tmp_path / f"{request.param}-decisions.log"
    resolve = ["site-a.test=127.0.0.1", "site-b.test=127.0.0.1"]
    if request.param == "daemon":
        child = RunChild(policy_file, log, resolve)
        yield child.port, log
        assert child.stop() == 0
    else:
        args = ["--allow", "site-a.test", "--policy", str(policy_file), "--client", f"a:{TOKEN_A}",
                "--decision-log", str(log), "--run", "r-1"]
        for item in resolve:
            args += ["--resolve", item]
        p = start_proxy(args, tmp_path)
        yield p.port, log
        assert p.stop() == 0


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


CASES = [
    # (what, request, expected status, expected decision-log line minus ts/port/addr/rule)
    ("tunnel allowed", "connect:site-a.test", 200,
     {"run": "r-1", "client": "a", "method": "CONNECT", "host": "site-a.test",
      "decision": "allow", "reason": "allowed_by_run"}),
    ("tunnel denied", "connect:site-b.test", 403,
     {"run": "r-1", "client": "a", "method": "CONNECT", "host": "site-b.test",
      "decision": "deny", "reason": "not_allowed"}),
    ("plain request allowed", "get:site-a.test", 200,
     {"run": "r-1", "client": "a", "method": "GET", "host": "site-a.test",
      "decision": "allow", "reason": "allowed_by_run"}),
]


@pytest.mark.parametrize("what,req,status,line", CASES, ids=[c[0] for c in CASES])
def test_both_ways_in_answer_and_log_alike_and_the_line_is_on_disk_with_the_answer(
        entry, echo_server, http_server, what, req, status, line):
    port, log = entry
    kind, host = req.split(":")
    if kind == "connect":
        reply = connect(port, f"{host}:{echo_server.port}", A)
        if reply.sock is not None:
            reply.sock.close()
    else:
        reply = get(port, f"http://{host}:{http_server.port}/x", A)
    assert reply.status == status
    # No waiting: the line was written before the proxy answered.
    got = _lines(log)
    assert len(got) == 1, got
    rec = got[0]
    assert {k: rec[k] for k in line} == line
    assert set(rec) == {"ts", "run", "client", "method", "host", "port", "decision", "reason",
                        "rule", "addr"}
    assert TS_RE.match(rec["ts"]), rec["ts"]
    assert rec["addr"] == ("127.0.0.1" if status == 200 else None)


def test_many_tunnels_leave_one_whole_line_each(entry, echo_server):
    port, log = entry
    for i in range(40):
        host = "site-a.test" if i % 2 else "site-b.test"
        reply = connect(port, f"{host}:{echo_server.port}", A)
        if reply.sock is not None:
            reply.sock.close()
    got = _lines(log)  # every line parses: no torn or merged lines
    assert [x["decision"] for x in got] == ["deny", "allow"] * 20


@pytest.mark.parametrize("argv,needle", [
    (["--resolve", "bad..host=127.0.0.1"], "bad..host"),
    (["--listen-port", "70000"], "70000"),
], ids=["malformed resolve host", "port out of range"])
def test_run_proxy_bad_start_arguments_exit_2_with_one_clear_line(tmp_path, policy_file, argv, needle):
    r = subprocess.run([sys.executable, "-m", "sfguard.supervisor.daemon.proxy_child", "--policy", str(policy_file),
                        "--decision-log", str(tmp_path / "d.log"), *argv],
                       cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("sfguard-run-proxy: error:") and needle in r.stderr


def test_run_proxy_stops_when_the_daemon_end_of_stdin_closes(tmp_path, policy_file):
    child = RunChild(policy_file, tmp_path / "d.log", [])
    started = time.monotonic()
    assert child.stop() == 0
    assert time.monotonic() - started < 15


def test_a_run_proxy_before_its_first_client_set_closes_connections_instead_of_answering_407(
        tmp_path, policy_file, http_server, echo_server):
    """A browser's cached credential must not meet a 407 while a restarted run proxy waits for
    its clients (Chromium would drop it, and the guard answers challenges only at first)."""
    log = tmp_path / "d.log"
    child = RunChild(policy_file, log, ["site-a.test=127.0.0.1"], send_clients=False)
    try:
        for req in (lambda: get(child.port, f"http://site-a.test:{http_server.port}/x", A),
                    lambda: connect(child.port, f"site-a.test:{echo_server.port}", A)):
            reply = req()
            assert (reply.status, reply.headers) == (0, {})   # closed, no answer at all
        assert [(x["method"], x["decision"], x["reason"], x["client"]) for x in _lines(log)] == [
            ("GET", "deny", "proxy_starting", None), ("CONNECT", "deny", "proxy_starting", None)]
        child.send_clients()
        assert get(child.port, f"http://site-a.test:{http_server.port}/x", A).status == 200
        assert get(child.port, f"http://site-a.test:{http_server.port}/x",
                   basic("a", "wrong-token")).status == 407
    finally:
        assert child.stop() == 0
