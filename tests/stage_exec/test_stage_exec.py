"""`sfguard stage-exec` against a real guard daemon (fake agent-browser, fake CDP endpoint, real
CDP gate, real run proxy, real bubblewrap): exit status, env isolation, refusals, bridges."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon.conftest import ROOT, Daemon
from tests.stage_exec.conftest import SENTINEL, STAGE_PYTHON, runner_env, stage_exec, stage_exec_argv, start_fake_daemon

STAGE_KEYS = {"AGENT_BROWSER_CDP", "AGENT_BROWSER_SESSION", "AGENT_BROWSER_SOCKET_DIR",
              "AGENT_BROWSER_PIN_TAB", "AGENT_BROWSER_CONFIG", "AGENT_BROWSER_IDLE_TIMEOUT_MS"}
PROXY_KEYS = {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"}


def ready_stage(d, run="r1", sid="s1", profile=None, allow=("site-a.test",)):
    if d.call("GET", f"/v1/runs/{run}")[0] == 404:
        assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    browser = {"headed": False, "allow_domains": list(allow)}
    if profile:
        browser["profile"] = profile
    status, answer = d.call("POST", f"/v1/runs/{run}/stages",
                            {"stage_id": sid, "attempt": 1, "browser": browser})
    assert status == 200, answer
    return answer


def test_stage_answer_carries_the_exec_prefix_and_it_runs_the_stage(daemon, workspace):
    answer = ready_stage(daemon)
    prefix = answer["exec_prefix"]
    assert prefix[1:3] == ["-I", "-S"] and prefix[3].endswith("cli/stage_exec_entry.py")
    assert prefix[4:] == ["--home", str(daemon.home), "--run", "r1", "--stage", "s1", "--"]
    # resume: the identical answer
    assert daemon.call("GET", "/v1/runs/r1/stages/s1") == (200, answer)
    # what a runner does: prefix + the stage's command, from the workspace, nothing else
    r = subprocess.run(prefix + ["sh", "-c", "echo $AGENT_BROWSER_SESSION; exit 5"], cwd=workspace,
                       env=runner_env(daemon.home), capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (5, answer["env"]["AGENT_BROWSER_SESSION"]), r.stderr
    # and its refusals look like the CLI's
    r = subprocess.run(prefix[:6] + ["--run", "r1", "--stage", "nope", "--", "true"], cwd=workspace,
                       env=runner_env(daemon.home), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no stage 'nope'" in r.stderr


@pytest.mark.parametrize("code", [0, 1, 7, 113])
def test_exit_status_is_the_commands(daemon, workspace, code):
    ready_stage(daemon)
    r = stage_exec(daemon.home, workspace, "r1", "s1", "sh", "-c", f"exit {code}")
    assert r.returncode == code, r.stderr


@pytest.mark.parametrize("entry", ["fast entry", "console"])
def test_the_stage_gets_default_sigpipe_and_sigxfsz(daemon, workspace, entry):
    """Python ignores SIGPIPE and SIGXFSZ; a stage must not inherit that through the exec
    (`yes | head -1` would end on an error instead of the signal)."""
    answer = ready_stage(daemon)
    cmd = ["sh", "-c", "grep SigIgn /proc/self/status; yes | head -1 >/dev/null"]
    argv = (answer["exec_prefix"] + cmd if entry == "fast entry"
            else stage_exec_argv(daemon.home, "r1", "s1", *cmd))
    r = subprocess.run(argv, cwd=workspace, env=runner_env(daemon.home), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ignored = int(r.stdout.split()[1], 16)
    assert ignored & (1 << (13 - 1)) == 0 and ignored & (1 << (25 - 1)) == 0, r.stdout  # SIGPIPE, SIGXFSZ
    assert "Broken pipe" not in r.stderr, r.stderr


def test_command_not_found_and_options_after_the_separator(daemon, workspace):
    ready_stage(daemon)
    r = stage_exec(daemon.home, workspace, "r1", "s1", "no-such-command-here")
    assert r.returncode == 127
    r = stage_exec(daemon.home, workspace, "r1", "s1", "sh", "-c", 'printf "%s|" "$@"', "x", "--run", "-e")
    assert (r.returncode, r.stdout) == (0, "--run|-e|"), r.stderr


def test_env_is_the_stage_env_and_nothing_of_the_runner(daemon, workspace):
    answer = ready_stage(daemon)
    r = stage_exec(daemon.home, workspace, "r1", "s1", STAGE_PYTHON, "-c",
                   "import os, json; print(json.dumps(dict(os.environ)))")
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert SENTINEL not in r.stdout and "runner-proxy.invalid" not in r.stdout
    assert set(env) - {"PWD", "SHLVL", "_"} == STAGE_KEYS | PROXY_KEYS | {
        "PATH", "LANG", "TERM", "HOME", "AGENT_BROWSER_PROXY"}
    assert env["AGENT_BROWSER_PROXY"] == ""
    assert env["AGENT_BROWSER_CDP"] == answer["env"]["AGENT_BROWSER_CDP"]  # same token path
    assert env["AGENT_BROWSER_SESSION"] == answer["env"]["AGENT_BROWSER_SESSION"]
    assert env["AGENT_BROWSER_SOCKET_DIR"] != answer["env"]["AGENT_BROWSER_SOCKET_DIR"]
    assert env["HOME"] != os.environ.get("HOME") and env["TERM"] == "dumb"
    proxies = {env[k] for k in PROXY_KEYS}
    assert len(proxies) == 1 and next(iter(proxies)).startswith("http://")
    assert "@127.0.0.1:" in next(iter(proxies))
    # the proxy credential is the stage's own: not in the stage answer, not in the run state
    cred = next(iter(proxies)).split("//", 1)[1].split("@", 1)[0]
    assert cred not in json.dumps(answer)
    assert cred not in json.dumps(daemon.call("GET", "/v1/runs/r1")[1])


def test_workspace_writable_rest_read_only_tmp_private(daemon, workspace):
    ready_stage(daemon)
    (workspace / "input.txt").write_text("from the runner")
    script = ("set -e; cat input.txt; echo out > result.txt; echo t > /tmp/t; "
              "if touch /etc/sfg-probe 2>/dev/null; then echo ETC-WRITABLE; fi; "
              f"touch {ROOT}/sfg-probe 2>/dev/null || true; "
              "ls /tmp")
    r = stage_exec(daemon.home, workspace, "r1", "s1", "sh", "-c", script)
    assert r.returncode == 0, r.stderr
    assert "from the runner" in r.stdout and "WRITABLE" not in r.stdout
    assert (workspace / "result.txt").read_text() == "out\n"
    # the checkout is read-only (under /tmp the sandbox may show an empty stand-in folder on its
    # own tmpfs, where the agent-browser folder is bound back; nothing reaches the real one)
    assert not (ROOT / "sfg-probe").exists()
    assert not Path("/tmp/t").exists() or Path("/tmp/t").stat().st_mtime < time.time() - 60


@pytest.mark.parametrize("run,sid,needle", [
    ("nope", "s1", "no run 'nope'"),
    ("r1", "nope", "no stage 'nope'"),
    ("../x", "s1", "not a valid id"),
    ("r1", "s1/../../x", "not a valid id"),
])
def test_wrong_ids_exit_2_with_a_clear_error(daemon, workspace, run, sid, needle):
    ready_stage(daemon)
    r = stage_exec(daemon.home, workspace, run, sid, "true")
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_ended_stage_exit_2(daemon, workspace):
    ready_stage(daemon)
    assert daemon.call("POST", "/v1/runs/r1/stages/s1/end", {"outcome": "succeeded"})[0] == 200
    r = stage_exec(daemon.home, workspace, "r1", "s1", "true")
    assert r.returncode == 2 and "has ended" in r.stderr, r.stderr


def test_no_guard_exit_2(tmp_path, workspace):
    r = stage_exec(tmp_path / "nohome", workspace, "r1", "s1", "true")
    assert r.returncode == 2 and "no guard is running" in r.stderr, r.stderr


def test_workspace_may_not_be_a_guard_folder(daemon, workspace):
    ready_stage(daemon)
    r = subprocess.run(stage_exec_argv(daemon.home, "r1", "s1", "true"), cwd=daemon.home,
                       env=runner_env(daemon.home), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "guard folder" in r.stderr, r.stderr


WATCH = r"""
import socket, sys, time
gate, proxy = int(sys.argv[1]), int(sys.argv[2])
def ask(port, req):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.sendall(req)
            s.settimeout(3)
            return bool(s.recv(100))
    except OSError:
        return False
# one connection opened before the stage ends and kept open
held = socket.create_connection(("127.0.0.1", proxy), timeout=3)
held.sendall(b"GET http://site-a.test/ HTTP/1.1\r\nHost: site-a.test\r\n\r\n")
held.settimeout(5)
first = held.recv(4096)
print("held-first", bool(first), flush=True)
for _ in range(400):
    g = ask(gate, b"GET /json/version HTTP/1.0\r\n\r\n")
    p = ask(proxy, b"GET http://site-a.test/ HTTP/1.0\r\n\r\n")
    print("state", g, p, flush=True)
    if not g and not p:
        break
    time.sleep(0.1)
held.settimeout(5)
try:
    rest = held.recv(4096)
    while rest:
        rest = held.recv(4096)
    print("held-closed", flush=True)
except OSError as exc:
    print("held-error", type(exc).__name__, flush=True)
"""


def test_stage_end_cuts_gate_and_proxy_of_a_running_command(daemon, workspace):
    ready_stage(daemon)
    info = daemon.call("GET", "/v1/runs/r1/stages/s1/exec")[1]
    (workspace / "watch.py").write_text(WATCH)
    proc = subprocess.Popen(stage_exec_argv(daemon.home, "r1", "s1", STAGE_PYTHON, "watch.py",
                                            str(info["bridges"]["gate_port"]),
                                            str(info["bridges"]["proxy_port"])),
                            cwd=workspace, env=runner_env(daemon.home), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("state True True"):
                break
        assert "held-first True" in lines and lines[-1] == "state True True", (
            lines, proc.stderr.read() if proc.poll() is not None else "")
        assert daemon.call("POST", "/v1/runs/r1/stages/s1/end", {"outcome": "succeeded"})[0] == 200
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    tail = out.strip().splitlines()
    assert "state False False" in tail and tail[-1] in ("held-closed", "held-error ConnectionResetError"), (out, err)
    assert not Path(info["bridges"]["dir"]).exists()
    assert proc.returncode == 0


def test_control_socket_default_0600_and_api_group(tmp_path, fake_cdp, workspace):
    import grp
    group = grp.getgrgid(os.getgid()).gr_name if os.geteuid() != 0 else "nogroup"
    home = (tmp_path / "home").absolute()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--api-group", group)
    try:
        st = os.stat(home / "guard.sock")
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam(group).gr_gid
        hst = os.stat(home)
        assert stat.S_IMODE(hst.st_mode) == 0o710 and hst.st_gid == st.st_gid
        # nothing a stage needs sits beside the socket: the home holds guard files only
        names = {p.name for p in home.iterdir()}
        assert not any(n.endswith(".sock") and n != "guard.sock" for n in names)
        for p in home.rglob("*"):
            if p.is_file() and not p.is_symlink():
                assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
    finally:
        d.finish()
    # a stopped guard leaves no bridge folder behind
    from sfguard.supervisor.home import runtime_path
    from sfguard.supervisor.stage.stage_bridge import bridge_root_for
    assert not bridge_root_for(runtime_path(home)).exists()
    bad = Daemon(home, env, tmp_path / "daemon2.log")
    bad.start("--api-group", "no-such-group-sfg", expect_ready=False)
    assert bad.proc.wait(60) == 2


def test_no_sandbox_here_means_refusal_not_unconfined(tmp_path, fake_cdp, workspace):
    """A machine where bubblewrap cannot build the sandbox (here: a bwrap that fails like one
    without user namespaces): start says so, stage-exec refuses with exit 2, nothing runs."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    (fake_bin / "bwrap").chmod(0o755)
    d = start_fake_daemon(tmp_path, fake_cdp, path_prefix=f"{fake_bin}:")
    home = d.home
    try:
        assert "stage sandbox (stage-exec): UNAVAILABLE" in d.banner
        ready_stage(d)
        marker = workspace / "ran"
        r = stage_exec(home, workspace, "r1", "s1", "touch", str(marker))
        assert r.returncode == 2 and "refuses to run a stage unconfined" in r.stderr, r.stderr
        assert not marker.exists()
    finally:
        d.finish()


def test_doctor_reports_the_sandbox():
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "doctor"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = [l for l in r.stdout.splitlines() if "stage sandbox" in l]
    assert line and line[0].startswith("ok "), r.stdout


@pytest.mark.parametrize("tool, forbidden, expect", [
    ("/tmp/ci/node_modules/agent-browser/bin/ab", [], "/tmp/ci/node_modules/agent-browser/bin"),
    ("/usr/bin/ab", [], None),                                   # outside /tmp: visible already
    (None, [], None),
    ("relative/ab", [], None),
    ("/tmp/ci/node_modules/agent-browser/bin/ab", ["/tmp/ci"], None),            # inside a guard folder
    ("/tmp/ci/node_modules/agent-browser/bin/ab", ["/tmp/ci/node_modules/agent-browser/bin/x"], None),
])
def test_agent_browser_under_tmp_is_bound_back_only_outside_guard_folders(tmp_path, tool, forbidden, expect):
    from sfguard.supervisor.stage import sandbox
    if tool and tool.startswith("/tmp/ci/"):
        real = tmp_path / "ci" / "node_modules" / "agent-browser" / "bin"
        real.mkdir(parents=True)
        tool = str(real / "ab")
        forbidden = [f.replace("/tmp/ci", str(tmp_path / "ci")) for f in forbidden]
        expect = expect and expect.replace("/tmp/ci", str(tmp_path / "ci"))
    assert sandbox.tool_dir_to_rebind(tool, forbidden) == expect


@pytest.mark.parametrize("tab,session,same", [
    ("A1B2C3D4E5F6", "sfs-0a1b2c3d", True),
    ("../x", "sfs-0a1b2c3d", False),          # not a target id: no record at all
    ("A\u00e91", "sfs-0a1b2c3d", False),       # letters, but not ASCII
    ("A1B2", "../sfs", False),                # a session name that is a path
    (None, "sfs-0a1b2c3d", False),            # the stage closed its tab
])
def test_stage_exec_writes_the_guards_pin_record(tab, session, same):
    """stage-exec formats the pin record itself (start-up time): the bytes are the guard's."""
    from sfguard.cli.stage_exec_cmd import _pin_fd
    from sfguard.supervisor.browsers import agent_browser
    fd = _pin_fd({"tab": tab, "env": {"AGENT_BROWSER_SESSION": session}})
    if not same:
        assert fd is None
        return
    try:
        assert os.read(fd, 4096) == agent_browser.pin_record(tab)
    finally:
        os.close(fd)
    assert json.loads(agent_browser.pin_record(tab)) == {"targetId": tab, "url": "about:blank", "pinned": True}
