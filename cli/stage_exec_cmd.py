"""`sfguard stage-exec`: run a stage's command confined to its gate and its run's proxy.

Run by the pipeline runner (who can reach the control API) in front of a stage's command:

    sfguard stage-exec [--home DIR] --run RUN --stage STAGE [--] COMMAND [ARGS...]

It asks the guard for the stage's sandbox (GET /v1/runs/RUN/stages/STAGE/exec) and replaces
itself with bubblewrap, so COMMAND's exit status is stage-exec's. Every refusal (no guard,
wrong ids, ended stage, no sandbox on this machine, a workspace that is a guard folder) is one
line on stderr and exit 2; nothing ever runs unconfined. See supervisor/stage/sandbox.py.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a script (`python -I -S .../cli/stage_exec_cmd.py`): no site
    _up = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(_up, "supervisor")) and os.path.isfile(os.path.join(_up, "sfguard", "__init__.py")):
        # a checkout: its folders are the sub-packages of the sfguard namespace (pyproject's
        # package-dir, which the editable install's finder applies; -S loads no finder)
        sys.path.insert(0, _up)
        import sfguard
        sfguard.__path__.append(_up)
    else:  # installed: <site-packages>/sfguard/cli/stage_exec_cmd.py
        sys.path.insert(0, os.path.dirname(_up))

from sfguard.cli.errors import CliError  # noqa: E402 (after the path set-up)

#: the runner variables a stage gets (besides its own env and a private HOME)
PASSED_VARS = ("PATH", "LANG", "TERM")


def register(sub) -> None:
    from sfguard.cli.options import add_home
    p = sub.add_parser(
        "stage-exec", help="run a stage's command inside its sandbox (runner side)",
        description="Run COMMAND as the stage RUN/STAGE inside a bubblewrap sandbox whose only "
                    "ways out are the stage's CDP gate and its run's guard proxy. The current "
                    "directory is the stage's workspace (the one writable folder).")
    add_home(p)
    p.add_argument("--run", required=True, metavar="RUN_ID")
    p.add_argument("--stage", required=True, metavar="STAGE_ID")
    p.add_argument("argv", nargs="+", metavar="COMMAND [ARGS...]",
                   help="the stage's command (put -- before it when it has options)")
    p.set_defaults(func=run)


class _JsonContext:
    """What the C JSON scanner reads from its decoder (json.JSONDecoder's defaults; NaN and
    Infinity refused)."""
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name: str):
        raise ValueError(f"not JSON: {name}")


def _loads(data: bytes):
    """json.loads, without importing json: its module-level regexes import re and enum, which
    (with socket's enums) were half of this entry's Python start-up. The C scanner is the one
    json itself uses; json.loads is the fallback where it is missing."""
    text = data.decode("utf-8").strip()
    try:
        from _json import make_scanner
    except ImportError:
        import json
        return json.loads(text)
    try:
        # typeshed types the context as a make_scanner; the C scanner only reads the attributes
        # _JsonContext has (json.scanner passes a JSONDecoder the same way)
        value, end = make_scanner(_JsonContext())(text, 0)  # type: ignore[arg-type]
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("not JSON: trailing data")
    return value


def _unix_socket():
    """A unix stream socket; `_socket` is the C module `socket` wraps (it adds enums that cost
    a stage-exec start ~10 ms of imports)."""
    try:
        import _socket
    except ImportError:
        import socket
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    return _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)


def _ask_guard(home: str, run_id: str, stage_id: str) -> dict:
    """GET the exec answer over the control socket. A few lines of HTTP/1.0 instead of
    http.client, and no json or socket module (see _loads): stage-exec's start-up time is
    paid by every confined stage."""
    path = os.path.join(home, "guard.sock")
    s = _unix_socket()
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
        answer = _loads(body)
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


def _pin_fd(answer: dict) -> int | None:
    """agent-browser's pin record for the stage's tab, when the guard names one and the session
    name is plain: the bytes of supervisor/browsers/agent_browser.py `pin_record`, written here
    without importing that module (stage-exec's start-up time; a test holds the two equal)."""
    tab, session = answer.get("tab"), (answer.get("env") or {}).get("AGENT_BROWSER_SESSION")
    if not (isinstance(tab, str) and tab.isascii() and tab.isalnum() and isinstance(session, str)
            and session and set(session) <= ID_FIRST | set("-_")):
        return None
    return _data_fd(b'{"targetId":"%s","url":"about:blank","pinned":true}' % tab.encode())


ID_FIRST = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
ID_REST = ID_FIRST | set("._:-")


def _valid_id(value: str) -> bool:
    """models.RUN_ID (^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$), without importing re."""
    return 0 < len(value) <= 128 and value[0] in ID_FIRST and set(value) <= ID_REST


def run(args) -> int:
    return execute(args.home, args.run, args.stage, args.argv)


def sandbox_argv(bwrap: str, answer: dict, cwd: str, hide: list[str], config_fd: int,
                 command: list[str], pin_fd: int | None = None) -> list[str]:
    """bubblewrap's argv for the guard's exec answer: the sandbox, its mounts, the launcher
    (supervisor/stage/sandbox.py) and the stage's command. `config_fd` holds the pinned
    agent-browser config, `pin_fd` the stage's tab binding (both read by bubblewrap)."""
    from sfguard.supervisor.stage import sandbox

    bridges = answer["bridges"]
    argv = [bwrap, *sandbox.BASE_ARGS]
    for path in sandbox.hidden_paths(hide):
        argv += ["--tmpfs", path]
    # /tmp is a fresh tmpfs inside: a guard installed under /tmp (a checkout there) would lose
    # its agent-browser, so its folder comes back read-only (never one that holds guard files)
    tool_dir = sandbox.tool_dir_to_rebind(answer.get("agent_browser"),
                                          list(answer["hide"]) + [bridges["dir"]])
    if tool_dir:
        argv += ["--ro-bind", tool_dir, tool_dir]
    argv += ["--bind", cwd, cwd,
             "--ro-bind", bridges["gate_socket"], sandbox.INSIDE_GATE_SOCKET,
             "--ro-bind", bridges["proxy_socket"], sandbox.INSIDE_PROXY_SOCKET,
             "--perms", "0600", "--ro-bind-data", str(config_fd), sandbox.INSIDE_CONFIG,
             "--perms", "0700", "--dir", sandbox.INSIDE_SOCKET_DIR]
    if pin_fd is not None:   # the stage's tab, for the daemon the command may start (a writable copy)
        argv += ["--perms", "0600", "--file", str(pin_fd),
                 f"{sandbox.INSIDE_SOCKET_DIR}/{answer['env']['AGENT_BROWSER_SESSION']}.target"]
    argv += ["--perms", "0700", "--dir", sandbox.INSIDE_HOME,
             "--chdir", cwd, "--",
             "/bin/sh", "-c", sandbox.launcher_script(bridges["gate_port"], bridges["proxy_port"],
                                                      bound_tab=pin_fd is not None),
             "sfguard-stage", answer.get("agent_browser") or "", *command]
    return argv


def execute(home_flag: str | None, run_id: str, stage_id: str, command: list[str]) -> int:
    """Ask the guard, build the sandbox, exec bubblewrap (never returns unless refused)."""
    from sfguard.supervisor.stage import sandbox

    for label, value in (("--run", run_id), ("--stage", stage_id)):
        if not _valid_id(value):
            raise CliError(f"{label}: not a valid id: {value!r}")
    if not command:
        raise CliError("no command given: sfguard stage-exec --run RUN --stage STAGE -- COMMAND [ARGS...]")
    # the guard home as sfguard.supervisor.home.resolve_home finds it (flag, $SFGUARD_HOME, default)
    home = os.path.abspath(os.path.expanduser(
        home_flag or os.environ.get("SFGUARD_HOME") or "~/.stageflow/guard"))
    answer = _ask_guard(home, run_id, stage_id)
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
    pin_fd = _pin_fd(answer)
    argv = sandbox_argv(bwrap, answer, cwd, hide, config_fd, command, pin_fd)
    env = {k: os.environ[k] for k in PASSED_VARS if os.environ.get(k)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(answer["env"])
    env["HOME"] = sandbox.INSIDE_HOME
    if os.geteuid() == 0:
        try:
            os.setgroups([])
            os.setgid(int(answer["run_as"]["gid"]))  # set: checked above for root
            os.setuid(int(answer["run_as"]["uid"]))
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
    # Python ignores SIGPIPE and SIGXFSZ and an exec keeps that: the stage's command gets the
    # defaults a shell gives it (what subprocess's restore_signals does). _signal is the built-in
    # module `signal` wraps (signal's enums import enum, a cost every stage would pay)
    import _signal  # type: ignore[import-not-found]  # typeshed has no stub for the C module
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(_signal, name):
            _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(bwrap, argv, env)
    except OSError as exc:
        raise CliError(f"could not start bubblewrap: {exc}") from None
    return 2  # not reached


USAGE = "usage: stage_exec_cmd.py [--home DIR] --run RUN_ID --stage STAGE_ID [--] COMMAND [ARGS...]"


def fast_main(argv: list[str]) -> int:
    """The runner's entry (exec_prefix runs cli/stage_exec_entry.py, which calls this): the same
    command without argparse or site-packages."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in ("--home", "--run", "--stage") and i + 1 < len(argv):
            opts[a[2:]] = argv[i + 1]
            i += 2
            continue
        if a.startswith("--") and a.split("=", 1)[0] in ("--home", "--run", "--stage") and "=" in a:
            k, v = a[2:].split("=", 1)
            opts[k] = v
            i += 1
            continue
        if a.startswith("-"):
            print(f"sfguard stage-exec: error: unknown option {a}\n{USAGE}", file=sys.stderr)
            return 2
        break
    if "run" not in opts or "stage" not in opts:
        print(f"sfguard stage-exec: error: --run and --stage are required\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return execute(opts.get("home"), opts["run"], opts["stage"], argv[i:])
    except CliError as exc:
        print(f"sfguard stage-exec: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(fast_main(sys.argv[1:]))
