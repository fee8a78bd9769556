"""Everything about invoking the `agent-browser` CLI (0.41.2) for the guard.

Facts this module is built on (measured on this machine, see docs/agent-browser-notes.md):

* agent-browser no longer launches browsers for the guard (sfguard.supervisor.browsers.chromium does, with
  DevTools over a pipe); it is the stage's tool, attached with --cdp to the CDP gate.
* Every command of one session must carry a byte-identical environment, otherwise the daemon
  silently relaunches or reconnects. So the env of a stage session is computed ONCE
  (`stage_env`), stored by the caller, and every later command passes exactly that dict to `run`.
* agent-browser falls back to inherited `HTTP(S)_PROXY`, `ALL_PROXY`, `NO_PROXY` and to any
  `AGENT_BROWSER_*` variable, and reads `./agent-browser.json` from the working directory. The
  env is therefore built from scratch: a few plain variables are inherited, everything else is
  set by the guard, and `AGENT_BROWSER_CONFIG` pins an empty config file.
* Unix socket paths are limited to 103 bytes: `<socket dir>/<session>.sock` must fit.
* Without `AGENT_BROWSER_NO_VERSION_CHECK=1` agent-browser may fetch chromereleases.googleblog.com.

No function here logs; secrets (the proxy credential in the env, the CDP address in stdout)
never go into argv or exception messages.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from sfguard.errors import SfguardError
from sfguard.supervisor.home import atomic_write
from sfguard.supervisor.procs import end_child, niced

#: Plain variables a launch env may inherit from the guard's own environment.
INHERITED_VARS = ("PATH", "HOME", "LANG", "TMPDIR", "XDG_RUNTIME_DIR", "DISPLAY",
                  "WAYLAND_DISPLAY", "XAUTHORITY")
#: Longest unix socket path (sun_path is 108 bytes on Linux, 104 on macOS; agent-browser
#: documents 103 as the safe limit).
SOCKET_PATH_LIMIT = 103
#: Session names: what agent-browser accepts, restricted to ASCII.
SESSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", re.ASCII)
#: Chromium flags for a browser agent-browser launches itself (the proxy tests and benchmark
#: do; the guard starts its browsers with sfguard.supervisor.browsers.chromium).
CHROME_ARGS = (
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--disable-quic",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
)
#: Loopback goes through the proxy too (Chrome sends it DIRECT by default).
PROXY_BYPASS = "<-loopback>"
#: The pinned config file content.
PINNED_CONFIG = b"{}\n"
DEFAULT_TIMEOUT = 30.0


class AgentBrowserError(SfguardError):
    """An agent-browser command failed or timed out. The message names the command verb and a
    sanitised tail of stderr; it never contains env values or the CDP address."""

    def __init__(self, message: str, *, command: str = "", returncode: int | None = None):
        super().__init__(message)
        self.command = command
        self.returncode = returncode


@dataclass(frozen=True)
class Result:
    """Outcome of one agent-browser command. stdout may hold secrets (cdp-url, cookies):
    callers must not log it."""
    returncode: int
    stdout: str
    stderr: str

    def __iter__(self):  # allows `rc, out, err = await run(...)`
        return iter((self.returncode, self.stdout, self.stderr))


# --------------------------------------------------------------------------- env building

def check_session_name(session: str) -> str:
    if not isinstance(session, str) or not SESSION_PATTERN.fullmatch(session):
        raise ValueError(f"invalid agent-browser session name {ascii(session)[:80]}: use 1-64 "
                         "characters A-Z a-z 0-9 _ - starting with a letter or digit")
    return session


def check_socket_dir(socket_dir: str | os.PathLike, session: str) -> Path:
    """The socket dir must be absolute and short enough for `<dir>/<session>.sock`."""
    path = Path(socket_dir)
    if not path.is_absolute():
        raise ValueError("the agent-browser socket dir must be an absolute path")
    sock = os.fsencode(path / f"{session}.sock")
    if len(sock) > SOCKET_PATH_LIMIT:
        raise ValueError(f"socket path for session {session!r} is {len(sock)} bytes, over the "
                         f"{SOCKET_PATH_LIMIT}-byte unix socket limit: use a shorter socket dir")
    return path


def check_proxy_url(proxy_url: str) -> str:
    """Accept only http://NAME:TOKEN@127.0.0.1:PORT (the guard's per-run proxy).

    Errors never echo the URL (it carries the token)."""
    try:
        parts = urlsplit(proxy_url)
        port = parts.port
    except (ValueError, TypeError):
        raise ValueError("proxy URL is malformed (expected http://NAME:TOKEN@127.0.0.1:PORT)") from None
    if parts.scheme != "http" or parts.hostname != "127.0.0.1" or not port:
        raise ValueError("proxy URL must be http://NAME:TOKEN@127.0.0.1:PORT")
    if not parts.username or not parts.password:
        raise ValueError("proxy URL must carry the run's proxy credential (NAME:TOKEN@)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("proxy URL must not have a path, query or fragment")
    return proxy_url


def chrome_args(*, as_root: bool) -> str:
    """An AGENT_BROWSER_ARGS value: newline separated (agent-browser splits on newlines;
    commas would split only before another flag)."""
    args = (["--no-sandbox"] if as_root else []) + list(CHROME_ARGS)
    return "\n".join(args)


def _inherited(base_env: Mapping[str, str] | None) -> dict[str, str]:
    source = os.environ if base_env is None else base_env
    return {k: source[k] for k in INHERITED_VARS if source.get(k)}


def stage_env(
    *,
    session: str,
    socket_dir: str | os.PathLike,
    config_path: str | os.PathLike,
    cdp_url: str,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The env of a stage session attached to an anchor with --cdp (via the CDP gate URL).

    No profile, no proxy credential, no executable path: only the gate URL, the session, the
    socket dir, pin-tab, the pinned config and no idle timeout.
    """
    check_session_name(session)
    sock_dir = check_socket_dir(socket_dir, session)
    if not Path(config_path).is_absolute():
        raise ValueError("the config path must be an absolute path")
    env = _inherited(base_env)
    env.update({
        "AGENT_BROWSER_CDP": cdp_url,
        "AGENT_BROWSER_SESSION": session,
        "AGENT_BROWSER_SOCKET_DIR": str(sock_dir),
        "AGENT_BROWSER_PIN_TAB": "1",
        "AGENT_BROWSER_CONFIG": str(Path(config_path)),
        "AGENT_BROWSER_IDLE_TIMEOUT_MS": "0",
        "AGENT_BROWSER_NO_VERSION_CHECK": "1",
    })
    return env


def write_pinned_config(path: str | os.PathLike) -> Path:
    """Write the pinned empty agent-browser config `{}` (0600, atomic) unless it already is."""
    p = Path(path)
    try:
        if p.read_bytes() == PINNED_CONFIG and (p.stat().st_mode & 0o777) == 0o600 and not p.is_symlink():
            return p
    except OSError:
        pass
    atomic_write(p, PINNED_CONFIG, 0o600)
    return p


# --------------------------------------------------------------------------- running commands

_SECRETISH = [
    (re.compile(r"wss?://[^\s\"']+"), "ws://<redacted>"),
    (re.compile(r"(https?://)[^\s/@\"']+:[^\s/@\"']+@"), r"\1<redacted>@"),
]


_CHROME_LOG_PREFIX = re.compile(r"^\s*\[[0-9:/.]+:(?:ERROR|WARNING|FATAL|INFO):[^\]]*\]\s*")


def sanitize(text: str, limit: int = 400) -> str:
    """A short, secret-free summary of agent-browser output for error messages: its own
    message lines plus Chrome's log messages (without their pid/time prefix), deduplicated,
    with CDP addresses and URL credentials masked."""
    for pattern, repl in _SECRETISH:
        text = pattern.sub(repl, text)
    seen: list[str] = []
    for line in text.splitlines():
        line = _CHROME_LOG_PREFIX.sub("", line).strip().lstrip("\u2717").strip()
        if line and line not in seen and "zygote" not in line and "dbus" not in line:
            seen.append(line)
    summary = "; ".join(seen)
    return summary if len(summary) <= limit else summary[:limit] + "..."


async def run(
    env: Mapping[str, str],
    *args: str,
    timeout: float = DEFAULT_TIMEOUT,
    binary: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    nice: int = 0,
) -> Result:
    """Run one agent-browser command with exactly `env` (nothing else inherited).

    Hard timeout: on expiry the CLI process is killed by its pid and AgentBrowserError is
    raised. `cwd` defaults to the session's socket dir, so no ./agent-browser.json of some
    project directory can apply. Secrets travel in `env`, never in `args`. `nice`: the CLI
    (and a daemon it starts) runs at that niceness (through coreutils' `nice`, which execs it
    in the same process: no window where it runs at the guard's priority).
    """
    exe = str(binary) if binary else default_binary()
    workdir = str(cwd or env.get("AGENT_BROWSER_SOCKET_DIR") or "/")
    argv = niced([exe, *args], nice)
    proc = await asyncio.create_subprocess_exec(
        *argv, env=dict(env), cwd=workdir,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        await end_child(proc, 0, group=True)  # the CLI and the process group it leads
        raise AgentBrowserError(f"agent-browser {_verb(args)} timed out after {timeout:g}s",
                                command=_verb(args)) from None
    return Result(proc.returncode if proc.returncode is not None else -1,
                  out.decode(errors="replace"), err.decode(errors="replace"))


async def run_ok(env: Mapping[str, str], *args: str, timeout: float = DEFAULT_TIMEOUT,
                 binary: str | os.PathLike | None = None, nice: int = 0) -> str:
    """`run`, raising AgentBrowserError (sanitised) unless the command exits 0; returns stdout."""
    res = await run(env, *args, timeout=timeout, binary=binary, nice=nice)
    if res.returncode != 0:
        detail = sanitize(res.stderr or res.stdout)
        raise AgentBrowserError(f"agent-browser {_verb(args)} failed (exit {res.returncode}): {detail}",
                                command=_verb(args), returncode=res.returncode)
    return res.stdout


async def run_json(env: Mapping[str, str], *args: str, timeout: float = DEFAULT_TIMEOUT,
                   binary: str | os.PathLike | None = None, nice: int = 0) -> dict:
    """Run with `--json` and return the `data` object; raises AgentBrowserError on failure."""
    out = await run_ok(env, "--json", *args, timeout=timeout, binary=binary, nice=nice)
    try:
        doc = json.loads(out)
    except json.JSONDecodeError:
        raise AgentBrowserError(f"agent-browser {_verb(args)} returned no JSON",
                                command=_verb(args)) from None
    if not isinstance(doc, dict) or not doc.get("success"):
        raise AgentBrowserError(f"agent-browser {_verb(args)} reported failure", command=_verb(args))
    return doc.get("data") or {}


def _verb(args: tuple[str, ...] | list[str]) -> str:
    """The command name for messages: "open", "get cdp-url", "stream disable", ... (never its
    arguments, which may be URLs or text)."""
    words = [a for a in args if not a.startswith("-")]
    if not words:
        return ""
    return " ".join(words[:2]) if words[0] in ("get", "stream", "tab") else words[0]


def default_binary() -> str:
    """The agent-browser executable (sfguard.supervisor.browsers.tools rules: $SFGUARD_AGENT_BROWSER first)."""
    from sfguard.supervisor.browsers.tools import find_agent_browser
    tool = find_agent_browser()
    if not tool.found:
        raise AgentBrowserError(f"agent-browser not found ({tool.source}); {tool.hint}")
    return tool.path  # type: ignore[return-value]


# --------------------------------------------------------------------------- daemon files

def session_files(socket_dir: str | os.PathLike, session: str) -> list[Path]:
    """Files agent-browser keeps for `session` in the socket dir: .sock .pid .config .engine
    .stream .version (while running) and .target (left behind after close)."""
    d = Path(socket_dir)
    try:
        return sorted(p for p in d.iterdir() if p.name.startswith(session + ".")
                      and p.name[len(session) + 1:] in SESSION_FILE_SUFFIXES)
    except FileNotFoundError:
        return []


SESSION_FILE_SUFFIXES = frozenset({"sock", "pid", "config", "engine", "stream", "version", "target"})


def daemon_pid(socket_dir: str | os.PathLike, session: str) -> int | None:
    """The daemon pid agent-browser wrote to `<socket dir>/<session>.pid`, if any."""
    try:
        text = (Path(socket_dir) / f"{session}.pid").read_text().strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None


def is_target_id(value: object) -> bool:
    """A CDP target id as Chromium makes them: ASCII letters and digits only."""
    return isinstance(value, str) and value.isascii() and value.isalnum()


def pin_record(target_id: str) -> bytes:
    """agent-browser's tab binding `<session>.target`, in the form its daemon writes it
    (0.41.2). A daemon that finds it at start attaches to that tab as its pinned one and
    creates no tab (docs/agent-browser-notes.md, "the session is given its tab").
    cli/stage_exec_cmd.py writes the same bytes without importing this module."""
    if not is_target_id(target_id):
        raise ValueError("a target id is ASCII letters and digits")
    return b'{"targetId":"%s","url":"about:blank","pinned":true}' % target_id.encode()


def pinned_target(socket_dir: str | os.PathLike, session: str) -> str | None:
    """The tab the session is bound to (its `<session>.target`), if the record names one."""
    try:
        tab = json.loads((Path(socket_dir) / f"{session}.target").read_text()).get("targetId")
    except (OSError, ValueError, AttributeError):
        return None
    return tab if is_target_id(tab) else None


def remove_session_files(socket_dir: str | os.PathLike, session: str) -> list[str]:
    """Delete the session's daemon files; returns the names removed."""
    removed = []
    for p in session_files(socket_dir, session):
        try:
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            pass
    return removed
