"""Starting Chromium the guard's way: DevTools over a pipe, never a port.

`chromium_args` is the command line; `spawn` starts the browser with its DevTools pipe on fds
3 (browser reads) and 4 (browser writes) and returns the process and the guard's pipe ends.

The flags: what agent-browser 0.41.2 passed when it launched anchors (read from
/proc/PID/cmdline of a browser `agent-browser open` started, see docs/agent-browser-notes.md),
minus what only made sense for it (`--remote-debugging-port=0`, `--load-extension=`,
`--enable-remote-extensions`, `--show-component-extension-options`), plus the guard's own:
`--remote-debugging-pipe`, the run proxy with `<-loopback>` bypass (no credential on the
command line: the guard answers the proxy's challenge over the pipe), WebRTC limited to
proxied UDP, no QUIC. `--no-sandbox` only when asked for (a browser started by root as
root, outside the guard: the guard under root starts its browsers as the browser user,
supervisor/browsers/browser_user.py, with the sandbox on).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import psutil

from sfguard.supervisor.procs import ProcRecord, scan_orphans, terminate_recorded, wait_gone
from sfguard.supervisor.profiles.sealing import SESSION_FILES

#: The flags agent-browser 0.41.2 launched Chromium with, kept because they still serve.
AGENT_BROWSER_FLAGS = (
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-backgrounding-occluded-windows",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-hang-monitor",
    "--disable-popup-blocking",
    "--disable-prompt-on-repost",
    "--disable-sync",
    "--disable-pings",
    "--media-router=0",
    "--disable-features=Translate",
    # agent-browser sends WebMCP.enable on every page session; Chromium 156 needs these.
    "--enable-features=NetworkService,NetworkServiceInProcess,WebMCPTesting,DevToolsWebMCPSupport",
    "--metrics-recording-only",
    # Profiles made by agent-browser-launched anchors use the basic store; keep it readable.
    "--password-store=basic",
    "--use-mock-keychain",
    "--enable-gpu-rasterization",
    "--enable-unsafe-swiftshader",
    "--hide-scrollbars",
    "--window-size=1280,720",
)
#: The guard's own flags, for every browser it starts.
GUARD_FLAGS = (
    "--remote-debugging-pipe",
    # the guard loads its WebSocket write-gate extension over the pipe (supervisor/writes/
    # websockets.py); Chromium allows Extensions.loadUnpacked only with this flag and a pipe
    "--enable-unsafe-extension-debugging",
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--disable-quic",
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    # No shared workers: declarativeNetRequest does not see a WebSocket a shared worker opens,
    # so the write gate could not refuse it (measured on Chromium 156; writes/websockets.py).
    # Measured: `SharedWorker` is then undefined in pages and frames (http, blob: and data:).
    "--disable-shared-workers",
)
PROXY_BYPASS = "<-loopback>"
#: a profile's service worker registrations (and their scripts), under Default/
SERVICE_WORKER_DIR = "Service Worker"
#: Crash reports, inside the profile dir.
CRASH_DIR = "Crash Reports"
#: DevTools pipe fds inside the browser (Chromium's fixed numbers).
PIPE_READ_FD, PIPE_WRITE_FD = 3, 4


def chromium_args(*, browser_path: str | os.PathLike, profile_dir: Path, proxy_port: int | None,
                  headed: bool, no_sandbox: bool, window_title: str | None = None,
                  extension: Path | None = None) -> list[str]:
    """The command line of a guarded browser. `extension`: the guard's own extension folder, the
    only extension it may load (a profile's own never load: `--disable-extensions-except`)."""
    argv = [str(browser_path), *AGENT_BROWSER_FLAGS, *GUARD_FLAGS,
            f"--user-data-dir={profile_dir}"]
    argv.append(f"--disable-extensions-except={extension}" if extension is not None else "--disable-extensions")
    if not headed:
        argv.append("--headless=new")
    elif window_title:
        # the window's whole title (X11 WM_NAME): which guard, profile and site it is
        argv.append(f"--window-name={window_title}")
    if proxy_port is not None:
        argv += [f"--proxy-server=http://127.0.0.1:{int(proxy_port)}",
                 f"--proxy-bypass-list={PROXY_BYPASS}"]
    if no_sandbox:
        argv.append("--no-sandbox")
    argv.append("about:blank")
    return argv


#: Preferences the guard owns in every profile, set before its browser starts:
#: - the password manager off, so a password a person types into a guarded window is never
#:   saved in the profile, and never filled into a login form a stage later reads;
#: - preloading off (`net.network_prediction_options` 2, "never"): speculation-rules prefetch
#:   and prerender fetch where the browser's interception does not look (measured on Chromium
#:   156), so a GET the site policy names a write could go that way past the write gate;
#: - no page of the browser's own choosing at start (issue 52): no session restore, no start-up
#:   pages (`session.restore_on_startup` 5, `session.startup_urls` empty), the last exit clean
#:   (no "restore pages" after a crash), developer mode off (no unpacked extension loads);
#: - the entry of the guard's own extension removed (loaded per run, never by itself).
#: What else a profile carries that would run before the guard (session files, extensions) is
#: removed or kept from loading: see `set_guard_prefs` and `--disable-extensions-except`.
GUARD_PREFS = {"credentials_enable_service": False, "profile": {"password_manager_enabled": False},
               "net": {"network_prediction_options": 2}}
#: `session.restore_on_startup`: 5 opens only the new tab page (the guard's command line names
#: about:blank, which takes its place); 1 (restore) and 4 (start-up URLs) are what it replaces
RESTORE_NOTHING = 5


def _carried(data: dict) -> list[str]:
    """What in a profile's Preferences would open or run something before the guard."""
    from sfguard.supervisor.writes.websockets import EXTENSION_ID  # noqa: PLC0415
    found = []
    session = _part(data, "session")
    if session.get("restore_on_startup") not in (None, RESTORE_NOTHING):
        found.append(f"session.restore_on_startup={session.get('restore_on_startup')!s:.10}")
    if session.get("startup_urls"):
        urls = session["startup_urls"]
        found.append(f"session.startup_urls ({len(urls) if isinstance(urls, list) else 1})")
    profile = _part(data, "profile")
    if profile.get("exit_type") not in (None, "Normal") or profile.get("exited_cleanly") is False:
        found.append("profile.exit_type (a crash: pages to restore)")
    exts = _part(data, "extensions")
    theirs = [k for k, v in _part(exts, "settings").items() if k != EXTENSION_ID and isinstance(v, dict)
              and v.get("location") not in (5, 10)]     # 5, 10: Chromium's own component extensions
    if theirs:
        found.append(f"extensions ({len(theirs)}, never loaded)")
    if _part(exts, "ui").get("developer_mode"):
        found.append("extensions.ui.developer_mode")
    return found


def _part(data: dict, key: str) -> dict:
    value = data.get(key)
    return dict(value) if isinstance(value, dict) else {}


def _guarded(data: dict) -> dict:
    """`data` (a profile's Preferences) with the guard's own preferences in force."""
    from sfguard.supervisor.writes.websockets import EXTENSION_ID  # noqa: PLC0415
    out = dict(data)
    out["credentials_enable_service"] = False
    out["profile"] = {**_part(out, "profile"), "password_manager_enabled": False, "exit_type": "Normal",
                      "exited_cleanly": True}
    out["net"] = {**_part(out, "net"), "network_prediction_options": 2}
    out["session"] = {**_part(out, "session"), "restore_on_startup": RESTORE_NOTHING, "startup_urls": []}
    exts = _part(out, "extensions")
    settings = exts.get("settings")
    if isinstance(settings, dict) and EXTENSION_ID in settings:
        exts["settings"] = {k: v for k, v in settings.items() if k != EXTENSION_ID}
    exts["ui"] = {**_part(exts, "ui"), "developer_mode": False}
    out["extensions"] = exts
    return out


def set_guard_prefs(profile_dir: Path, owner: tuple[int, int] | None = None) -> list[str]:
    """The guard's preferences in `profile_dir/Default/Preferences` (atomic: temp, fsync, rename,
    no symlink followed), the profile's service worker registrations and saved session removed.
    `owner`: uid and gid for what is written (the browser user's). Returns what the profile
    carried that would have opened or run something before the guard (for the log and audit)."""
    pdir = os.open(profile_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            os.mkdir("Default", 0o700, dir_fd=pdir)
            if owner is not None:
                os.chown("Default", *owner, dir_fd=pdir, follow_symlinks=False)
        except FileExistsError:
            pass
        ddir = os.open("Default", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pdir)
    finally:
        os.close(pdir)
    try:
        # No service worker registered in an earlier run starts in this one (a guarded browser
        # refuses new ones: writes/websockets.py), and no saved session's tabs come back.
        # Sealing leaves both out already; this also covers a profile a crash left unsealed.
        carried = []
        for name in (SERVICE_WORKER_DIR, *sorted(SESSION_FILES)):
            if _remove_at(ddir, name) and name != SERVICE_WORKER_DIR:
                carried.append(f"saved session ({name})")
        data: dict = {}
        try:
            fd = os.open("Preferences", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=ddir)
            with os.fdopen(fd, "rb") as fh:
                loaded = json.loads(fh.read(16 * 1024 * 1024) or b"{}")
            data = loaded if isinstance(loaded, dict) else {}
        except FileNotFoundError:
            pass
        except ValueError:
            data = {}     # Chromium would discard an unreadable file too
        carried += _carried(data)
        guarded = _guarded(data)
        if guarded == data:
            return carried
        tmp = f".Preferences.sfguard-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=ddir)
        placed = False
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(json.dumps(guarded, separators=(",", ":")).encode())
                fh.flush()
                os.fsync(fh.fileno())
            if owner is not None:
                os.chown(tmp, *owner, dir_fd=ddir, follow_symlinks=False)
            os.rename(tmp, "Preferences", src_dir_fd=ddir, dst_dir_fd=ddir)
            placed = True
        finally:
            if not placed:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=ddir)
        return carried
    finally:
        os.close(ddir)


def _remove_at(dir_fd: int, name: str) -> bool:
    """Remove a file or folder `name` in `dir_fd` (never following a link); True if it was there."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)
    return True


def browser_env(base: dict[str, str] | None = None, *,
                profile_dir: str | os.PathLike | None = None,
                home: str | os.PathLike | None = None,
                xauthority: str | os.PathLike | None = None) -> dict[str, str]:
    """A scrubbed environment: no proxy variables (Chromium would not use them with
    --proxy-server, but nothing inherited should matter), only plain session variables.

    With `profile_dir`, crash reports go inside the profile (`BREAKPAD_DUMP_LOCATION`, which
    Chromium's crash handler takes as its `--database`): a dump holds the browser's memory,
    live cookies included, so it stays where the profile is sealed or deleted, never in
    ~/.config/chromium. The handler then also names the profile on its command line, which
    is how `end_helpers` finds it (it double-forks out of the browser's process group).

    With `home` (a browser user's own folder): HOME and TMPDIR are that folder, and nothing
    that points into the guard user's own folders is passed (its runtime dir, caches, config,
    X authority file): the browser writes only where its user may. `xauthority`: the grant
    file of its display (supervisor/browsers/xdisplay.py), the only X authority it gets."""
    src = os.environ if base is None else base
    keep: tuple[str, ...] = ("PATH", "HOME", "LANG", "TMPDIR", "XDG_RUNTIME_DIR", "DISPLAY", "WAYLAND_DISPLAY",
            "XAUTHORITY", "FONTCONFIG_PATH", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
    if home is not None:
        keep = ("PATH", "LANG", "DISPLAY", "WAYLAND_DISPLAY", "FONTCONFIG_PATH")
    env = {k: src[k] for k in keep if src.get(k)}
    if home is not None:
        env["HOME"] = env["TMPDIR"] = os.fspath(home)
    if xauthority is not None:
        env["XAUTHORITY"] = os.fspath(xauthority)
    if profile_dir is not None:
        env["BREAKPAD_DUMP_LOCATION"] = os.path.join(os.fspath(profile_dir), CRASH_DIR)
    return env


def end_helpers(profile_dir: str | os.PathLike, timeout: float = 3.0,
                uids: tuple[int | None, ...] = (), grace: float = 5.0) -> list[ProcRecord]:
    """End what a closed browser left running outside its process group: processes naming
    its profile (the crash handler, which may outlive the browser), of this user or of
    `uids` (the browser user). The crash handler ends by itself once its browser is gone, so
    it is given `grace` seconds first; only what is still alive then is signalled. Blocking;
    returns the records it had to signal."""
    left = scan_orphans([profile_dir], uids)
    if left and not wait_gone(left, grace):
        return terminate_recorded(left, timeout)
    return []


async def spawn(argv: list[str], *, env: dict[str, str], cwd: str,
                user: int | None = None, group: int | None = None,
                ) -> tuple[asyncio.subprocess.Process, asyncio.StreamReader, asyncio.WriteTransport]:
    """Start the browser with its DevTools pipe. Returns (process, reader of fd 4, writer to
    fd 3). The browser leads its own session and process group."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # Move the child's ends above 4 so the dup2 below cannot clobber one with the other.
    hi_r, hi_w = _dup_high(to_browser_r), _dup_high(from_browser_w)
    for fd in (to_browser_r, from_browser_w):
        os.close(fd)

    def child_fds() -> None:  # runs in the child between fork and exec
        os.dup2(hi_r, PIPE_READ_FD)
        os.dup2(hi_w, PIPE_WRITE_FD)

    spawned = False
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=child_fds,
            pass_fds=(PIPE_READ_FD, PIPE_WRITE_FD), user=user, group=group,
            extra_groups=[] if user is not None else None)
        spawned = True
    finally:
        os.close(hi_r)      # the child's ends: the child has its copies, or there is no child
        os.close(hi_w)
        if not spawned:
            os.close(to_browser_w)
            os.close(from_browser_r)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=256 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                 os.fdopen(from_browser_r, "rb", buffering=0))
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol,
                                                 os.fdopen(to_browser_w, "wb", buffering=0))
    return proc, reader, transport


def _dup_high(fd: int) -> int:
    import fcntl
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)


def singleton_lock_pid(profile_dir: Path) -> int | None:
    """The Chrome pid from the profile's `SingletonLock` symlink (`<hostname>-<pid>`), if the
    link exists and names this host."""
    try:
        target = os.readlink(profile_dir / "SingletonLock")
    except OSError:
        return None
    host, _, pid = target.rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    return int(pid)


def _is_main_browser(proc: psutil.Process, profile_dir: Path) -> bool:
    """A Chrome main process (no --type=) using `profile_dir` as user-data-dir."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    want = f"--user-data-dir={profile_dir}"
    return want in cmd and not any(a.startswith("--type=") for a in cmd)


def find_browser_process(profile_dir: Path, uids: tuple[int | None, ...] = ()) -> ProcRecord | None:
    """The live Chrome main process of `profile_dir` (SingletonLock first, then a psutil scan
    of this user's processes and those of `uids`, e.g. the browser user)."""
    pid = singleton_lock_pid(profile_dir)
    if pid is not None:
        try:
            proc = psutil.Process(pid)
            if _is_main_browser(proc, profile_dir):
                return ProcRecord(pid, proc.create_time(), "browser")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    owners = {os.getuid(), *(u for u in uids if u is not None)}
    for pid in pids_with_arg(f"--user-data-dir={profile_dir}"):
        try:
            proc = psutil.Process(pid)
            if proc.uids().real in owners and _is_main_browser(proc, profile_dir):
                return ProcRecord(proc.pid, proc.create_time(), "browser")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


def pids_with_arg(arg: str) -> list[int]:
    """Processes whose command line contains `arg`: read straight from /proc (a
    psutil scan of every process costs tens of milliseconds on each browser launch); psutil's
    scan where there is no /proc."""
    want = arg.encode()
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return [p.pid for p in psutil.process_iter(["cmdline"]) if arg in (p.info["cmdline"] or [])]
    found = []
    for name in entries:
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        if want in raw:   # a candidate: _is_main_browser checks the words (psutil parses them)
            found.append(int(name))
    return found
