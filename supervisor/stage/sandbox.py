"""The stage sandbox (layer 3 of stage containment): bubblewrap, the stage user, the argv.

`sfguard stage-exec` runs a stage's command inside bubblewrap (`bwrap`): new user, PID, IPC,
UTS, network and mount namespaces; the file system read-only except the stage's workspace (the
current directory) and a private /tmp; fresh /proc and /dev; the guard home, the runtime
folders, the bridge folders, /run and the runner's home hidden under empty tmpfs mounts. Inside,
socat listens on 127.0.0.1 and forwards to the two unix sockets the guard serves for that stage
(supervisor/stage/stage_bridge.py): the CDP gate and the run's proxy. Nothing else leaves.

Where the runner is root, the stage is dropped to a dedicated unprivileged OS user before
bubblewrap starts (a user namespace alone would not do: files are checked against the real uid
outside, so root-owned 0600 files would stay readable). bubblewrap then runs unprivileged and
binds the workspace and the two sockets from file descriptors opened before the drop, so the
stage user needs no path into root's folders.
"""
from __future__ import annotations

import os
import pwd

from sfguard.errors import SfguardError

DEFAULT_STAGE_USER = "sfguard-stage"
#: where the bridges and the pinned config appear inside the sandbox (/run is a fresh tmpfs)
INSIDE_DIR = "/run/sfguard"
INSIDE_GATE_SOCKET = f"{INSIDE_DIR}/gate.sock"
INSIDE_PROXY_SOCKET = f"{INSIDE_DIR}/proxy.sock"
INSIDE_CONFIG = f"{INSIDE_DIR}/ab-config.json"
INSIDE_SOCKET_DIR = "/tmp/ab"      # the stage's agent-browser daemon lives and dies in here
INSIDE_HOME = "/tmp/home"
#: the namespaces and mounts every sandbox gets (measured with bubblewrap 0.8)
BASE_ARGS = ("--unshare-all", "--die-with-parent", "--new-session",
             "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp")
PROBE_TIMEOUT = 20.0


class SandboxError(SfguardError):
    """The sandbox cannot be built here; stage-exec refuses rather than run unconfined."""


class StageUser:
    """The unprivileged OS user stages run as under a root guard. (A plain class: this module
    is on stage-exec's start-up path, which stays clear of heavy imports.)"""

    def __init__(self, name: str, uid: int, gid: int):
        self.name, self.uid, self.gid = name, uid, gid

    def __repr__(self) -> str:
        return f"StageUser({self.name!r}, {self.uid}, {self.gid})"

    def __eq__(self, other) -> bool:
        return isinstance(other, StageUser) and (self.name, self.uid, self.gid) == (
            other.name, other.uid, other.gid)

    def to_json(self) -> dict:
        return {"user": self.name, "uid": self.uid, "gid": self.gid}


def _which(name: str) -> str | None:
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        path = os.path.join(d, name)
        if d and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_bwrap() -> str | None:
    return _which("bwrap")


def find_socat() -> str | None:
    return _which("socat")


def lookup_user(name: str) -> StageUser | None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    return StageUser(pw.pw_name, pw.pw_uid, pw.pw_gid)


def ensure_stage_user(name: str = DEFAULT_STAGE_USER) -> StageUser:
    """The stage user, created as a system user without home or shell when missing (root only)."""
    return ensure_system_user(name, "stage")


def ensure_system_user(name: str, role: str) -> StageUser:
    """An unprivileged system user (own group, no home, no shell), created when missing (root
    only). `role` names it in errors ("stage", "browser"). SandboxError when it cannot be."""
    user = lookup_user(name)
    if user is not None:
        if user.uid == 0 or user.gid == 0:
            raise SandboxError(f"{role} user {name!r} has uid or gid 0; it must be unprivileged")
        return user
    if os.geteuid() != 0:
        raise SandboxError(f"{role} user {name!r} does not exist and only root can create it")
    import subprocess
    useradd = _which("useradd") or "/usr/sbin/useradd"
    try:
        out = subprocess.run([useradd, "--system", "--user-group", "--no-create-home",
                              "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"could not create the {role} user {name!r}: {exc}") from None
    user = lookup_user(name)
    if user is None:
        raise SandboxError(f"could not create the {role} user {name!r}: "
                           f"{(out.stderr or out.stdout).strip()[:200]}")
    return user


def probe(user: StageUser | None = None) -> tuple[bool, str]:
    """Does bubblewrap build the stage sandbox here? Runs a tiny `bwrap ... true` (as `user`
    when given and we are root). Answers (works, one line of detail)."""
    import subprocess
    bwrap, socat = find_bwrap(), find_socat()
    if bwrap is None:
        return False, "bubblewrap (bwrap) not found: install it (Debian: apt-get install bubblewrap)"
    if socat is None:
        return False, "socat not found: install it (Debian: apt-get install socat)"
    kwargs: dict = {}
    who = ""
    if user is not None and os.geteuid() == 0:
        kwargs = {"user": user.uid, "group": user.gid, "extra_groups": []}
        who = f" as {user.name}"
    try:
        out = subprocess.run([bwrap, *BASE_ARGS, "--", "/bin/true"], capture_output=True,
                             text=True, timeout=PROBE_TIMEOUT, env={"PATH": "/usr/bin:/bin"},
                             cwd="/", **kwargs)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap could not run: {type(exc).__name__}: {exc}"
    if out.returncode != 0:
        why = (out.stderr or "").strip().splitlines()
        return False, ("bwrap cannot build the sandbox here (user namespaces disabled?): "
                       + (why[-1][:200] if why else f"exit {out.returncode}"))
    return True, f"bubblewrap works{who} ({bwrap}; socat {socat})"


def group_id(name: str) -> int:
    import grp  # here, not at the top: an extension module stage-exec's start-up does not need
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise SandboxError(f"no group {name!r} on this machine") from None


def hidden_paths(paths: list[str]) -> list[str]:
    """Existing absolute paths to cover with tmpfs, outermost first, nested ones dropped."""
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths if p and os.path.isabs(p)}, key=len):
        if p == "/" or p == "/tmp" or p.startswith("/tmp/") or not os.path.isdir(p):
            continue  # /tmp is a fresh tmpfs in every sandbox already
        if any(p == h or p.startswith(h.rstrip("/") + "/") for h in out):
            continue
        out.append(p)
    return out


def tool_dir_to_rebind(tool: str | None, forbidden: list[str]) -> str | None:
    """The folder of the guard's agent-browser when it lies under /tmp (hidden by the sandbox's
    own /tmp), to bind back read-only; None when it needs nothing or would uncover a guard
    folder (the folder is, contains or lies inside one)."""
    if not tool or not os.path.isabs(tool):
        return None
    folder = os.path.dirname(os.path.realpath(tool))
    if not folder.startswith("/tmp/") or not os.path.isdir(folder):
        return None
    for f in forbidden:
        f = os.path.normpath(f)
        if folder == f or folder.startswith(f.rstrip("/") + "/") or f.startswith(folder.rstrip("/") + "/"):
            return None
    return folder


def check_workspace(cwd: str, forbidden: list[str]) -> None:
    """The workspace becomes writable inside: never /, never a guard folder, never above one."""
    cwd = os.path.normpath(cwd)
    if cwd == "/":
        raise SandboxError("the current directory is /: run stage-exec from the stage's workspace")
    for f in forbidden:
        f = os.path.normpath(f)
        if cwd == f or cwd.startswith(f.rstrip("/") + "/") or f.startswith(cwd.rstrip("/") + "/"):
            raise SandboxError(f"the current directory {cwd} is or contains a guard folder; "
                               "run stage-exec from the stage's workspace")


#: how long the launcher waits for its two bridges to listen before it refuses (exit 2)
BRIDGE_START_TIMEOUT = 10


def launcher_script(gate_port: int, proxy_port: int, bound_tab: bool = False) -> str:
    """The first process inside (`sh -c SCRIPT sfguard-stage AGENT_BROWSER COMMAND...`): start
    the two socat bridges, wait (bounded) until both listen, run the stage's command; if it
    started an agent-browser daemon, end it (`close`); exit with the command's status.

    `bound_tab`: stage-exec put a pin record naming the stage's own tab in the in-sandbox socket
    folder, so a daemon the command starts works in that tab (the stage's tab, which stays for
    its next command and is closed at stage end). Without one the daemon made a tab of its own,
    which is closed first (a --cdp `close` alone only disconnects) so that repeated stage-execs
    do not pile up tabs.

    The wait blocks instead of polling, because start-up time is what a runner pays per stage
    and on two busy cores a polling loop took the CPU the bridges needed to start (the
    launcher saw them listen 20-30 ms after they did): each socat runs with `-d -d`, whose
    notice "listening on" it writes right after listen(2); a reader shell per bridge turns
    that line into "up" (or "down" when socat ends first) on a pipe the launcher reads, then
    keeps passing socat's errors (E/F lines, what socat prints without -d) to the stage's
    stderr and drops the notices. A timer (`sleep`, killed once both are up) bounds the wait;
    the launcher reads its pipe to the end, so COMMAND starts with no timer left beside it.
    Everything is dash builtins but socat and that one sleep."""
    relay = 'case $l in *"] "[EF]" "*) printf "%s\\n" "$l" >&2;; esac'
    return f"""ab=$1; shift
bridge() {{
  socat -d -d TCP-LISTEN:$1,bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:$2 </dev/null 2>&1 >/dev/null | {{
    s=down
    while read -r l; do case $l in *" N listening on "*) s=up; break;; esac; {relay}; done
    echo $s 2>/dev/null; exec >/dev/null
    while read -r l; do {relay}; done
  }} &
}}
{{ bridge {int(gate_port)} {INSIDE_GATE_SOCKET}; bridge {int(proxy_port)} {INSIDE_PROXY_SOCKET}
  {{ sleep {BRIDGE_START_TIMEOUT} & echo "t $!"; wait $! && echo timeout; }} 2>/dev/null & }} | {{
  n=0 t=
  while read -r w; do
    case $w in "t "*) t=${{w#t }};; up) n=$((n+1));; *) break;; esac
    [ $n = 2 ] && [ -n "$t" ] && break
  done
  [ -n "$t" ] && kill $t 2>/dev/null
  [ $n = 2 ] || exit 1
  while read -r w; do :; done  # the end of the pipe: the timer and its sleep are gone
}} || {{ echo 'sfguard stage-exec: the sandbox bridges did not start' >&2; exit 2; }}
"$@"; rc=$?
set -- {INSIDE_SOCKET_DIR}/*
if [ -n "$ab" ] && [ -e "$1" ]; then
  {'' if bound_tab else 'timeout 15 "$ab" tab close >/dev/null 2>&1; '}timeout 15 "$ab" close >/dev/null 2>&1
fi
exit $rc
"""
