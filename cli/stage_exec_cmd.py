"""`sfguard stage-exec`: run a stage's command confined to its gate and its run's proxy.

Run by the pipeline runner (who can reach the control API) in front of a stage's command:

    sfguard stage-exec [--home DIR] --run RUN --stage STAGE [--] COMMAND [ARGS...]

It asks the guard for the stage's sandbox (GET /v1/runs/RUN/stages/STAGE/exec) and replaces
itself with bubblewrap, so COMMAND's exit status is stage-exec's. Every refusal (no guard,
wrong ids, ended stage, no sandbox on this machine, a workspace that is a guard folder) is one
line on stderr and exit 2; nothing ever runs unconfined. See supervisor/sandbox.py.
"""
from __future__ import annotations

import os
import sys

from cli.main import CliError

#: the runner variables a stage gets (besides its own env and a private HOME)
PASSED_VARS = ("PATH", "LANG", "TERM")


def register(sub) -> None:
    p = sub.add_parser(
        "stage-exec", help="run a stage's command inside its sandbox (runner side)",
        description="Run COMMAND as the stage RUN/STAGE inside a bubblewrap sandbox whose only "
                    "ways out are the stage's CDP gate and its run's guard proxy. The current "
                    "directory is the stage's workspace (the one writable folder).")
    p.add_argument("--home", help="guard home (default $SFGUARD_HOME or ~/.stageflow/guard)")
    p.add_argument("--run", required=True, metavar="RUN_ID")
    p.add_argument("--stage", required=True, metavar="STAGE_ID")
    p.add_argument("command", nargs="+", metavar="COMMAND [ARGS...]",
                   help="the stage's command (put -- before it when it has options)")
    p.set_defaults(func=run)


def _ask_guard(home: str, run_id: str, stage_id: str) -> dict:
    """GET the exec answer over the control socket. A few lines of HTTP/1.0 instead of
    http.client: stage-exec's start-up time is paid by every confined stage."""
    import json
    import socket
    path = os.path.join(home, "guard.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(path)
        s.sendall(f"GET /v1/runs/{run_id}/stages/{stage_id}/exec HTTP/1.0\r\n"
                  "Host: localhost\r\n\r\n".encode())
        raw = b""
        while len(raw) < 1 << 20:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    except (FileNotFoundError, ConnectionRefusedError):
        raise CliError(f"no guard is running on {path}: start it with `sfguard start`") from None
    except PermissionError:
        raise CliError(f"the guard's control socket {path} is not open to this user "
                       "(start the guard with --api-group for a runner under another user)") from None
    except OSError as exc:
        raise CliError(f"the guard did not answer: {exc}") from None
    finally:
        s.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        answer = json.loads(body)
    except (IndexError, ValueError):
        raise CliError("the guard's answer was not understood") from None
    if status != 200:
        err = answer.get("error", {}) if isinstance(answer, dict) else {}
        raise CliError(f"{err.get('message') or f'the guard answered {status}'}"
                       f" [{err.get('code', status)}]")
    return answer


def _data_fd(data: bytes) -> int:
    r, w = os.pipe()
    os.write(w, data)  # a few bytes: fits the pipe buffer
    os.close(w)
    os.set_inheritable(r, True)
    return r


def run(args) -> int:
    import re
    from supervisor import sandbox

    for label, value in (("--run", args.run), ("--stage", args.stage)):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", value):
            raise CliError(f"{label}: not a valid id: {value!r}")
    # the guard home as supervisor.home.resolve_home finds it (flag, $SFGUARD_HOME, default)
    home = os.path.abspath(os.path.expanduser(
        args.home or os.environ.get("SFGUARD_HOME") or "~/.stageflow/guard"))
    answer = _ask_guard(home, args.run, args.stage)
    bwrap = sandbox.find_bwrap()
    if bwrap is None or sandbox.find_socat() is None:
        raise CliError("bubblewrap and socat are needed to run a stage confined; install them "
                       "(Debian: apt-get install bubblewrap socat). Nothing was run.")
    try:
        cwd = os.getcwd()
    except OSError:
        raise CliError("the current directory is gone; run stage-exec from the stage's workspace") from None
    runner_home = os.environ.get("HOME", "")
    hide = list(answer["hide"]) + ["/run", "/dev/shm", runner_home,
                                   os.environ.get("XDG_RUNTIME_DIR", "")]
    try:
        sandbox.check_workspace(cwd, list(answer["hide"]) + [answer["bridges"]["dir"]])
    except sandbox.SandboxError as exc:
        raise CliError(str(exc)) from None
    run_as = answer.get("run_as")
    if os.geteuid() == 0 and not run_as:
        raise CliError("stage-exec runs as root but the guard names no stage user to drop to; "
                       "refusing to run the stage as root")
    gate_sock, proxy_sock = answer["bridges"]["gate_socket"], answer["bridges"]["proxy_socket"]
    if not (os.path.exists(gate_sock) and os.path.exists(proxy_sock)):
        raise CliError("the stage's bridges are gone: has the stage ended?")
    config_fd = _data_fd(b"{}\n")
    argv = [bwrap, *sandbox.BASE_ARGS]
    for path in sandbox.hidden_paths(hide):
        argv += ["--tmpfs", path]
    argv += ["--bind", cwd, cwd,
             "--ro-bind", gate_sock, sandbox.INSIDE_GATE_SOCKET,
             "--ro-bind", proxy_sock, sandbox.INSIDE_PROXY_SOCKET,
             "--perms", "0600", "--ro-bind-data", str(config_fd), sandbox.INSIDE_CONFIG,
             "--perms", "0700", "--dir", sandbox.INSIDE_SOCKET_DIR,
             "--perms", "0700", "--dir", sandbox.INSIDE_HOME,
             "--chdir", cwd, "--",
             "/bin/sh", "-c", sandbox.launcher_script(answer["bridges"]["gate_port"],
                                                      answer["bridges"]["proxy_port"]),
             "sfguard-stage", answer.get("agent_browser") or "", *args.command]
    env = {k: os.environ[k] for k in PASSED_VARS if os.environ.get(k)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(answer["env"])
    env["HOME"] = sandbox.INSIDE_HOME
    if os.geteuid() == 0:
        try:
            os.setgroups([])
            os.setgid(int(run_as["gid"]))
            os.setuid(int(run_as["uid"]))
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise CliError(f"could not drop to the stage user: {exc}") from None
        if os.geteuid() == 0 or os.getuid() == 0:
            raise CliError("could not drop root; refusing to run the stage")
    # PATH entries the stage cannot use (hidden, or closed to the stage user) are dropped
    hidden = sandbox.hidden_paths(hide)
    env["PATH"] = ":".join(
        p for p in env["PATH"].split(":")
        if p and os.path.isabs(p) and os.access(p, os.X_OK)
        and not any(p == h or p.startswith(h.rstrip("/") + "/") for h in hidden)) or "/usr/bin:/bin"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(bwrap, argv, env)
    except OSError as exc:
        raise CliError(f"could not start bubblewrap: {exc}") from None
    return 2  # not reached
