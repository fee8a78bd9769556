"""BrowserHost: starts and ends the browsers the guard lends to runs.

An *anchor* is one Chromium the guard starts itself for a (run, profile) pair, or a throw-away
Chromium for a profile-less stage. It has no DevTools port: the guard launches it with
`--remote-debugging-pipe` and holds both pipe ends (`sfguard.supervisor.gate.cdp_pipe.CdpPipe`). Stages
never talk to it directly: they run their own agent-browser sessions attached with `--cdp` to
the CDP gate, which relays their WebSocket connections onto the pipe
(`open_stage_session` / `close_stage_session`).

launch:  profile dir (or a temp one) -> `chromium --remote-debugging-pipe ...` in its own process
         group (browsers/chromium.py; a headed one on a display granted by browsers/xdisplay.py)
         -> Browser.getVersion, target discovery and browser-wide proxy authentication over the
         pipe (Fetch, the credential stays here) -> its pid recorded as a ProcRecord.
close:   Browser.close over the pipe (graceful: cookies flushed) -> wait for the process to
         exit -> terminate_recorded() for anything still alive -> delete a throw-away profile.
alive:   the process runs AND its pipe is open; the pipe closing means the browser is dead.

With a browser user (a root guard: `AnchorSpec.user`, one of its pool, browsers/browser_pool.py)
the browser runs as that user with Chromium's sandbox on: its profile is handed to it, a HOME of
its own in the run's folder (browsers/launch_dirs.py), and the folders above are opened for the
browser users to cross (never to list).

Errors are AnchorError with messages free of secrets (no proxy credential).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from sfguard.errors import SfguardError
from sfguard.supervisor.browsers import agent_browser as ab
from sfguard.supervisor.browsers import browser_user as bu
from sfguard.supervisor.browsers import chromium, trust, xdisplay
from sfguard.supervisor.browsers.chromium import find_browser_process
from sfguard.supervisor.browsers.launch_dirs import LaunchDirs
from sfguard.supervisor.errors import BrowserStartError
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, PipeClosed
from sfguard.supervisor.home import HomeError, private_dir
from sfguard.supervisor.procs import ProcRecord, terminate_recorded, wait_gone
from sfguard.supervisor.writes import websockets

#: Bound for a browser to answer its pipe after start. Generous: the first start on a fresh
#: machine builds the font and shader caches (measured up to ~10 s under load).
LAUNCH_TIMEOUT = 60.0
COMMAND_TIMEOUT = 20.0
CLOSE_TIMEOUT = 15.0


class AnchorError(SfguardError):
    """An anchor or stage session could not be started or ended. No secrets in the message."""


@dataclass(frozen=True)
class AnchorSpec:
    """What to launch. `profile_dir=None` means a throw-away profile (a fresh temp folder
    under `temp_root`, deleted at close). `proxy_url=None` is refused unless `allow_direct`
    (tests only): a guarded browser always goes through its run's proxy."""
    session: str
    socket_dir: Path
    config_path: Path
    browser_path: str
    profile_dir: Path | None = None
    proxy_url: str | None = field(default=None, repr=False)
    headed: bool = False
    temp_root: Path | None = None
    allow_direct: bool = False
    #: the title of a headed browser's window (xdisplay.window_title: profile, site)
    window_title: str | None = None
    #: False: no extension at all, the guard's own neither (only with `allow_direct`: the
    #: benchmark's plain-browser baseline). A guarded browser always carries the guard's.
    guard_extension: bool = True
    #: the user it runs as (a root guard's: one of its browser users, its own while it runs)
    user: bu.BrowserUser | None = None


@dataclass
class Anchor:
    """A running anchor. `pipe` is the browser's DevTools connection (whoever holds it has the
    whole browser): never hand it, or anything read through it unfiltered, to a stage."""
    session: str
    pipe: CdpPipe = field(repr=False)
    proc: asyncio.subprocess.Process = field(repr=False)
    profile_dir: Path
    temp_profile: bool
    socket_dir: Path
    processes: list[ProcRecord]
    launch_seconds: float
    headed: bool = False
    home_dir: Path | None = None     # its own HOME (browser user, --ca-file), removed at close
    ext_dir: Path | None = None      # the WebSocket write gate's extension (writes/websockets.py)
    #: a root guard's headed browser: its grant of the display (xdisplay.grant, removed at close)
    xauth_file: Path | None = field(default=None, repr=False)
    blank_tab: str | None = field(default=None, repr=False)   # Chromium's start-up tab, until taken
    #: what the profile carried that would have run before the guard (chromium.set_guard_prefs):
    #: removed or kept from loading, said in the log and the audit chain
    carried: tuple[str, ...] = ()
    user: bu.BrowserUser | None = None   # the user it runs as (a root guard's browser user)
    downloads: Path | None = None        # its user's downloads folder (the stages' artifacts)

    @property
    def uids(self) -> tuple[int, ...]:
        return (self.user.uid,) if self.user is not None else ()

    def take_blank_tab(self) -> str | None:
        """The browser's start-up tab, once (the first stage session attaches to it: a new tab is
        the slowest step of a session start). None when taken, or not a plain about:blank tab."""
        tab, self.blank_tab = self.blank_tab, None
        return tab

    def record(self, kind: str) -> ProcRecord | None:
        return next((p for p in self.processes if p.kind == kind), None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def describe(self) -> dict:
        """A secret-free JSON view (for run state / status)."""
        return {"session": self.session, "temp_profile": self.temp_profile, "headed": self.headed,
                "processes": [p.to_json() for p in self.processes],
                "launch_seconds": round(self.launch_seconds, 3)}


@dataclass(frozen=True)
class StageSession:
    """A stage's agent-browser session attached with --cdp (its own pinned tab)."""
    session: str
    target_id: str | None
    processes: list[ProcRecord]


@dataclass(frozen=True)
class CloseReport:
    graceful: bool                 # Browser.close (or `close`) succeeded and the process exited by itself
    terminated: list[ProcRecord]   # processes that had to be signalled
    removed_files: list[str]
    seconds: float


@runtime_checkable
class BrowserHost(Protocol):
    """The seam for local or remote browsers (see docs/design.md 6)."""

    async def launch_anchor(self, spec: AnchorSpec) -> Anchor: ...
    async def close_anchor(self, anchor: Anchor, timeout: float = CLOSE_TIMEOUT) -> CloseReport: ...
    def alive(self, anchor: Anchor) -> bool: ...
    async def open_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT, *,
                                 nice: int = 0, target_id: str | None = None) -> StageSession: ...
    async def close_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT, *,
                                  graceful: bool = True) -> CloseReport: ...
    def use_pool(self, pool: object) -> None: ...


# --------------------------------------------------------------------------- helpers

def _write_tab_binding(socket_dir: Path, session: str, target_id: str) -> None:
    """Write the session's pin record (`agent_browser.pin_record`, 0600) before its first
    command. Measured on 0.41.2: a daemon that finds it attaches to that tab as its pinned one
    and creates no tab (`Target.getTargets`, `attachToTarget`, the enables: 130 ms for a session
    on an idle machine against 330-390 ms with the one or two `Target.createTarget` it makes
    otherwise, docs/agent-browser-notes.md). The record names a tab; the gate still decides
    what the session may reach."""
    try:
        data = ab.pin_record(target_id)
    except ValueError as exc:
        raise AnchorError(str(exc)) from None
    fd = os.open(socket_dir / f"{session}.target",
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _proxy_parts(proxy_url: str | None) -> tuple[int | None, tuple[str, str] | None]:
    """(port, (name, token)) of the run proxy URL http://NAME:TOKEN@127.0.0.1:PORT."""
    if proxy_url is None:
        return None, None
    ab.check_proxy_url(proxy_url)
    parts = urlsplit(proxy_url)
    return parts.port, (unquote(parts.username or ""), unquote(parts.password or ""))


async def _start_up_tab(pipe: CdpPipe) -> str | None:
    """The one tab a just-started browser keeps: the about:blank page its command line names.
    Every other page it has (a restored session, start-up pages: none should come, the guard's
    preferences forbid them) is closed, and from now on the pipe's warden closes any page that
    appears with no opener and that no client asked for (supervisor/gate/warden.py). None when
    there is no such blank page (not there yet): the warden still watches."""
    try:
        res = await pipe.call("Target.getTargets", timeout=5)
    except (CdpCallError, PipeClosed, TimeoutError):
        pipe.warden.arm(None)
        return None
    pages = [t for t in res.get("targetInfos", []) if isinstance(t, dict) and t.get("type") == "page"]
    keep = next((t.get("targetId") for t in pages if t.get("url") == "about:blank" and not t.get("openerId")
                 and isinstance(t.get("targetId"), str) and t.get("targetId")), None)
    pipe.warden.arm(keep)
    for t in pages:
        if t.get("targetId") != keep:
            pipe.warden.appeared(t)    # not the guard's: closed (and said)
    return keep


def _daemon_record(socket_dir: Path, session: str) -> ProcRecord | None:
    pid = ab.daemon_pid(socket_dir, session)
    return ProcRecord.of(pid, "daemon") if pid else None


def _session_env_parts(env: dict[str, str]) -> tuple[str, Path]:
    try:
        return env["AGENT_BROWSER_SESSION"], Path(env["AGENT_BROWSER_SOCKET_DIR"])
    except KeyError as exc:
        raise AnchorError(f"session env lacks {exc.args[0]}") from None


# --------------------------------------------------------------------------- local host

class LocalBrowserHost:
    """Anchors as Chromium processes on this machine (DevTools over a pipe); stage sessions as
agent-browser sessions attached to the CDP gate."""

    def __init__(self, agent_browser: str | os.PathLike | None = None, *,
                 launch_timeout: float = LAUNCH_TIMEOUT, command_timeout: float = COMMAND_TIMEOUT,
                 no_sandbox: bool | None = None, user: bu.BrowserUser | None = None,
                 ca: trust.CaBundle | None = None):
        self.binary = str(agent_browser) if agent_browser else None
        self.ca = ca or trust.CaBundle()    # authorities the browsers trust besides the system's
        self.launch_timeout = launch_timeout
        self.command_timeout = command_timeout
        # `user`: the user every browser runs as unless its spec names one (root only), the
        # sandbox on. Without one, as root Chromium refuses to start with its sandbox unless
        # told otherwise. `pool_uids` (use_pool): a root guard's browser users, the only ones
        # its browsers may run as.
        self.user = user
        self.pool_uids: frozenset[int] = frozenset()
        if user is not None:
            if no_sandbox:
                raise ValueError("a browser user runs its browsers with the sandbox on")
            self.no_sandbox = False
        else:
            self.no_sandbox = (os.geteuid() == 0) if no_sandbox is None else no_sandbox

    def use_pool(self, pool: object) -> None:
        """From now on every browser runs as one of `pool`'s users (`AnchorSpec.user`) with its
        sandbox on; a launch as anything else is refused (a root guard's start)."""
        self.pool_uids = frozenset(getattr(pool, "uids", ()))
        self.no_sandbox = False

    def _user_of(self, spec: AnchorSpec) -> bu.BrowserUser | None:
        user = spec.user if spec.user is not None else self.user
        if self.pool_uids and (user is None or user.uid not in self.pool_uids):
            raise AnchorError("refusing to launch a browser of a root guard as anything but one "
                              "of its browser users")
        return user

    def _bin(self) -> str:
        if self.binary is None:
            self.binary = ab.default_binary()
        return self.binary

    async def _run_ok(self, env, *args, timeout=None) -> str:
        return await ab.run_ok(env, *args, timeout=timeout or self.command_timeout, binary=self._bin())

    # ---- anchors

    def _checked(self, spec: AnchorSpec) -> tuple[bu.BrowserUser | None, int | None, tuple[str, str] | None]:
        """(the user it runs as, the proxy's port, its credential) of a spec that may launch."""
        if (spec.proxy_url is None or not spec.guard_extension) and not spec.allow_direct:
            raise AnchorError("refusing to launch a browser without the run's proxy or the guard's extension")
        if spec.headed and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
            raise AnchorError("a headed browser needs a display, but neither DISPLAY nor "
                              "WAYLAND_DISPLAY is set (run headless, or start the guard in a desktop session)")
        if spec.profile_dir is not None and not Path(spec.profile_dir).is_absolute():
            raise AnchorError("the profile dir must be an absolute path")
        if not Path(spec.browser_path).is_absolute():
            raise AnchorError("the browser path must be an absolute path")
        try:
            ab.check_session_name(spec.session)
            return (self._user_of(spec), *_proxy_parts(spec.proxy_url))
        except ValueError as exc:
            raise AnchorError(str(exc)) from None

    async def launch_anchor(self, spec: AnchorSpec) -> Anchor:
        user, proxy_port, proxy_auth = self._checked(spec)
        started = time.monotonic()
        socket_dir = private_dir(Path(spec.socket_dir))
        try:    # where a temp profile and a HOME go: the run's folder
            dirs = await LaunchDirs.prepare(spec.profile_dir, spec.session, Path(spec.temp_root or socket_dir.parent),
                                            socket_dir, user, self.ca, spec.guard_extension)
        except (HomeError, OSError, trust.TrustError) as exc:
            raise AnchorError(f"could not prepare the folders of anchor {spec.session}: {exc}") from None
        env = chromium.browser_env(profile_dir=dirs.profile_dir, home=dirs.home_dir if user is not None else None)
        if dirs.home_dir is not None:
            env["HOME"] = str(dirs.home_dir)     # where Chromium reads its NSS store (.pki/nssdb)
        try:   # a headed browser: the display granted to its user and checked as that user
            xauth_file = await xdisplay.prepare(env, spec.headed, user, dirs.home_dir)
        except (xdisplay.DisplayError, OSError) as exc:
            dirs.drop()
            raise AnchorError(f"could not show the window of anchor {spec.session}: {exc}") from None
        if find_browser_process(dirs.profile_dir, (user.uid,) if user else ()) is not None:
            # The lease should prevent this; this is the safety net (a second Chromium on a
            # profile in use would hand its work to the first one and exit).
            xdisplay.revoke(xauth_file)
            dirs.drop()
            raise AnchorError(f"the profile of session {spec.session} is already open in another browser")
        argv = chromium.chromium_args(browser_path=spec.browser_path, profile_dir=dirs.profile_dir,
                                      proxy_port=proxy_port, headed=spec.headed,
                                      no_sandbox=self.no_sandbox and user is None,
                                      window_title=spec.window_title, extension=dirs.ext_dir)
        proc, pipe, records, blank_tab = await self._spawn(spec.session, argv, env, dirs, user, proxy_auth,
                                                           xauth_file)
        return Anchor(session=spec.session, pipe=pipe, proc=proc, profile_dir=dirs.profile_dir,
                      temp_profile=dirs.temp_profile, socket_dir=socket_dir, processes=records,
                      launch_seconds=time.monotonic() - started, headed=spec.headed,
                      home_dir=dirs.home_dir, blank_tab=blank_tab, xauth_file=xauth_file, ext_dir=dirs.ext_dir,
                      carried=dirs.carried, user=user, downloads=dirs.downloads)

    async def _spawn(self, session: str, argv: list[str], env: dict[str, str], dirs: LaunchDirs,
                     user: bu.BrowserUser | None, proxy_auth: tuple[str, str] | None, xauth_file: Path | None,
                     ) -> tuple[asyncio.subprocess.Process, CdpPipe, list[ProcRecord], str | None]:
        """Start the browser as `user` and bring it up over its pipe: proxy authentication, the
        one start-up tab, the guard's extension and its rules before any page loads (no service
        worker can be registered in it, writes/websockets.py). On failure nothing is left."""
        proc = pipe = None
        records: list[ProcRecord] = []
        try:
            proc, reader, writer = await chromium.spawn(
                argv, env=env, cwd=str(dirs.profile_dir), user=user.uid if user else None,
                group=user.gid if user else None)
            rec = ProcRecord.of(proc.pid, "browser")
            records = [rec] if rec else []
            pipe = CdpPipe(reader, writer)
            await pipe.start(proxy_auth=proxy_auth, timeout=self.launch_timeout)
            blank_tab = await _start_up_tab(pipe)
            # the guard's extension and its rules, before any page loads: no service worker can
            # be registered in this browser (writes/websockets.py)
            if dirs.ext_dir is not None:
                pipe.websockets = websockets.WebSocketGate(pipe, dirs.ext_dir)
                await pipe.websockets.apply(websockets.dnr_rules(None))
        except (OSError, CdpCallError, PipeClosed, TimeoutError, BrowserStartError) as exc:
            what = "did not answer in time" if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) \
                else ("exited during start" if isinstance(exc, PipeClosed) else str(exc))
            if pipe is not None:
                await pipe.close()
            await asyncio.to_thread(terminate_recorded, records, 3.0)
            if proc is not None:
                with contextlib.suppress(TimeoutError):   # its helpers are ended next
                    await asyncio.wait_for(proc.wait(), 3)
            await asyncio.to_thread(chromium.end_helpers, dirs.profile_dir, 3.0, (user.uid,) if user else ())
            xdisplay.revoke(xauth_file)
            dirs.drop()
            raise AnchorError(f"could not launch anchor {session}: the browser {what}") from None
        return proc, pipe, records, blank_tab

    async def close_anchor(self, anchor: Anchor, timeout: float = CLOSE_TIMEOUT) -> CloseReport:
        started = time.monotonic()
        graceful = False
        if not anchor.pipe.closed.is_set():
            try:
                await anchor.pipe.call("Browser.close", timeout=min(timeout, 5.0))
                graceful = True
            except (CdpCallError, PipeClosed, TimeoutError):
                graceful = False
        remaining = max(1.0, timeout - (time.monotonic() - started))
        exited = False
        try:
            await asyncio.wait_for(anchor.proc.wait(), remaining)
            exited = True
        except TimeoutError:
            pass
        await anchor.pipe.close()
        # renderers and helpers of the group go with the main process; anything left is ended
        terminated = await asyncio.to_thread(terminate_recorded, anchor.processes, 5.0)
        with contextlib.suppress(TimeoutError):   # the helpers are ended next
            await asyncio.wait_for(anchor.proc.wait(), 3)
        # the crash handler lives outside the group and may outlive the browser by a moment
        helpers = await asyncio.to_thread(chromium.end_helpers, anchor.profile_dir, 3.0, anchor.uids)
        xdisplay.revoke(anchor.xauth_file)   # the browser user loses the display with its browser
        LaunchDirs(anchor.profile_dir, anchor.temp_profile, anchor.home_dir, anchor.ext_dir).drop()
        return CloseReport(graceful=graceful and exited and not terminated,
                           terminated=terminated + helpers, removed_files=[],
                           seconds=time.monotonic() - started)

    def alive(self, anchor: Anchor) -> bool:
        """True while the browser process runs and its DevTools pipe is open."""
        return (anchor.proc.returncode is None and not anchor.pipe.closed.is_set()
                and all(r.alive() for r in anchor.processes if r.kind == "browser"))

    # ---- stage sessions

    async def _disable_stream(self, env: dict[str, str], nice: int = 0) -> None:
        """Every agent-browser session starts an unauthenticated stream WebSocket on loopback:
        turn it off. One command: its JSON answer says whether streaming is now off
        (`{"disabled": true}`, measured on 0.41.2); a separate `stream status` would cost a
        second CLI start per stage."""
        data = await ab.run_json(env, "stream", "disable", timeout=self.command_timeout, binary=self._bin(),
                                 nice=nice)
        if data.get("disabled") is not True:
            raise AnchorError("the agent-browser stream server is still enabled after `stream disable`")

    async def open_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT, *,
                                 nice: int = 0, target_id: str | None = None) -> StageSession:
        """Start a stage's session (env from agent_browser.stage_env): its own pinned tab,
        stream disabled. Uses the env exactly as given. `nice`: its CLI and daemon start at
        that niceness (a session started ahead yields the CPU to a stage waiting now).
        `target_id`: a tab that already exists and is the stage's (the gate knows it as the
        stage's own); the session is bound to it instead of creating tabs of its own."""
        session, socket_dir = _session_env_parts(env)
        private_dir(socket_dir)
        try:
            if target_id is not None:
                _write_tab_binding(socket_dir, session, target_id)
            # The first command starts the stage's daemon and connects it through the gate;
            # `stream disable` as that first command keeps the stream server off for the
            # session's life (measured on 0.41.2: 0.18 s, vs 0.3-0.6 s for open + disable).
            # With a binding written above the daemon attaches to that tab and creates none;
            # without one it attaches to a page, then creates and pins a tab of its own.
            await self._disable_stream(env, nice)
        except (ab.AgentBrowserError, AnchorError, OSError) as exc:
            await self.close_stage_session(env, timeout=min(timeout, 10))
            raise AnchorError(f"could not open stage session {session}: {exc}") from None
        target = ab.pinned_target(socket_dir, session)
        if target_id is not None and target != target_id:
            await self.close_stage_session(env, timeout=min(timeout, 10))
            raise AnchorError(f"could not open stage session {session}: agent-browser did not "
                              "bind it to the tab it was given")
        rec = _daemon_record(socket_dir, session)
        return StageSession(session=session, target_id=target, processes=[rec] if rec else [])

    async def close_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT, *,
                                  graceful: bool = True) -> CloseReport:
        """End the session (`close`: a --cdp session disconnects and its daemon exits); end its
        daemon if it lingers; remove its socket-dir files. Chrome stays, and so do the stage's
        tabs: the gate closes them over the pipe (`CdpGate.close_stage_tabs`, on every path
        that ends a stage). A session bound to the stage's one tab could not close it itself
        anyway: agent-browser refuses to close a session's last tab.

        `graceful=False` (its browser is gone, e.g. before a restart): no commands, the
        session's daemon - whoever started it last, read from its pid file - is just ended."""
        started = time.monotonic()
        session, socket_dir = _session_env_parts(env)
        rec = _daemon_record(socket_dir, session)
        closed = False
        if rec is not None and rec.alive() and graceful:
            try:
                res = await ab.run(env, "close", timeout=timeout, binary=self._bin())
                closed = res.returncode == 0
            except ab.AgentBrowserError:
                closed = False
        records = [rec] if rec else []
        if graceful:
            await asyncio.to_thread(wait_gone, records, 3.0)
        terminated = await asyncio.to_thread(terminate_recorded, records, 5.0)
        removed = ab.remove_session_files(socket_dir, session)
        return CloseReport(graceful=closed and not terminated, terminated=terminated,
                           removed_files=removed, seconds=time.monotonic() - started)
