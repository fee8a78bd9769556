"""The sandbox's launcher (supervisor/stage/sandbox.py `launcher_script`) run by real bubblewrap
and socat, without a guard: two unix socket servers of the test's own stand in for the stage's
gate and proxy. What a stage observes: both bridges answer on its very first connection (the
launcher waited until they listened), nothing but the bridges and the launcher's own shells
runs beside it, a bridge that cannot start means exit 2 and the command never runs, and socat's
errors still reach the stage's stderr."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from sfguard.supervisor.stage import sandbox
from tests.stage_exec.conftest import STAGE_PYTHON, stage_user

GATE_PORT, PROXY_PORT = 41001, 41002   # inside the sandbox's own network namespace

#: the stage: connect to both bridges at once (no retry), read what answers, list the processes
PROBE = r"""
import os, socket, sys
for port in map(int, sys.argv[1:]):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(100)
            if not chunk:
                break
            data += chunk
        print(port, data.decode().strip() or "EOF", flush=True)
names = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0]
        except OSError:
            continue
        names.append(os.path.basename(cmd.decode()))
print("procs", " ".join(sorted(set(n for n in names if n))), flush=True)
"""


class UnixServer:
    """A unix socket the stage user may connect to; every connection gets `greeting` and is closed."""

    def __init__(self, path: Path, greeting: bytes):
        self.path, self.greeting = path, greeting
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(self.greeting)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def sockets(workspace):
    folder = workspace / "sockets"
    folder.mkdir(mode=0o755)
    gate = UnixServer(folder / "gate.sock", b"gate-here\n")
    proxy = UnixServer(folder / "proxy.sock", b"proxy-here\n")
    yield gate, proxy
    gate.close()
    proxy.close()


def launch(workspace: Path, gate: Path, proxy: Path, ports: tuple[int, int], *command: str,
           timeout: float = 60) -> subprocess.CompletedProcess:
    """bwrap with the sandbox's namespaces and mounts, the two sockets where the launcher expects
    them, and the launcher in front of `command`, as the stage user when we are root."""
    bwrap = sandbox.find_bwrap()
    if bwrap is None or sandbox.find_socat() is None:
        pytest.skip("bubblewrap and socat are needed")
    argv = [bwrap, *sandbox.BASE_ARGS, "--tmpfs", "/run", "--bind", str(workspace), str(workspace),
            "--ro-bind", str(gate), sandbox.INSIDE_GATE_SOCKET,
            "--ro-bind", str(proxy), sandbox.INSIDE_PROXY_SOCKET,
            "--chdir", str(workspace), "--",
            "/bin/sh", "-c", sandbox.launcher_script(*ports), "sfguard-stage", "", *command]
    kwargs: dict = {}
    user = stage_user()
    if user is not None:
        kwargs = {"user": user.uid, "group": user.gid, "extra_groups": []}
    return subprocess.run(argv, cwd=workspace, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def test_both_bridges_answer_the_first_connection_and_nothing_else_runs(workspace, sockets):
    gate, proxy = sockets
    (workspace / "probe.py").write_text(PROBE)
    # bash connects within a few ms of its start, before a socat started without waiting would
    # listen; the probe (Python) then lists what runs beside the stage
    first = (f"for p in {GATE_PORT} {PROXY_PORT}; do exec 3<>/dev/tcp/127.0.0.1/$p || exit 9; "
             f'read -r l <&3; echo "$p $l"; exec 3<&-; done; exec {STAGE_PYTHON} probe.py')
    command = ["/bin/bash", "-c", first] if os.path.exists("/bin/bash") else [
        STAGE_PYTHON, "probe.py", str(GATE_PORT), str(PROXY_PORT)]
    for _ in range(5):   # a race between the bridges starting and the command would show here
        r = launch(workspace, gate.path, proxy.path, (GATE_PORT, PROXY_PORT), *command)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[:2] == [f"{GATE_PORT} gate-here", f"{PROXY_PORT} proxy-here"], (lines, r.stderr)
        # the timer that bounds the wait is gone; the bridges and the launcher's shells remain
        procs = set(lines[2].split()[1:])
        assert procs <= {"bwrap", "sh", "socat"} and "socat" in procs, procs
        assert r.stderr == ""


@pytest.mark.parametrize("case", ["same port twice", "privileged port"])
def test_a_bridge_that_cannot_listen_means_exit_2_and_no_command(workspace, sockets, case):
    gate, proxy = sockets
    ports = (GATE_PORT, GATE_PORT) if case == "same port twice" else (GATE_PORT, 80)
    marker = workspace / "ran"
    r = launch(workspace, gate.path, proxy.path, ports, "touch", str(marker))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "the sandbox bridges did not start" in r.stderr
    assert " E " in r.stderr           # socat's own reason (bind: Address in use / Permission denied)
    assert not marker.exists()


def test_socat_errors_after_the_start_reach_the_stage_stderr(workspace, sockets):
    gate, proxy = sockets
    gate.close()   # the socket file stays, nobody accepts: what a stage sees once its gate closed
    (workspace / "probe.py").write_text(PROBE + "\nimport time; time.sleep(2)\n")
    r = launch(workspace, gate.path, proxy.path, (GATE_PORT, PROXY_PORT),
               STAGE_PYTHON, "probe.py", str(GATE_PORT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"{GATE_PORT} EOF"
    assert "Connection refused" in r.stderr and " E " in r.stderr, r.stderr
    assert " N " not in r.stderr       # the notices the launcher reads are not passed on
