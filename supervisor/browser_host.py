"""BrowserHost: starts and ends the browsers the guard lends to runs.

An *anchor* is one agent-browser session that owns one Chrome for a (run, profile) pair, or a
throw-away Chrome for a profile-less stage. Stages never talk to it directly: they run their own
agent-browser sessions attached with `--cdp` to the CDP gate in front of the anchor
(`open_stage_session` / `close_stage_session`).

`LocalBrowserHost` runs agent-browser on this machine. Lifecycle of an anchor:

launch:  pinned config + private socket dir -> env computed once (agent_browser.anchor_env)
         -> `open about:blank` -> `stream disable` (+ verify with `stream status`)
         -> `get cdp-url` (kept in memory only) -> record daemon pid (`<session>.pid`) and
         Chrome pid (profile's `SingletonLock` -> `<host>-<pid>`, else psutil by
         --user-data-dir) as ProcRecords (pid + create_time).
close:   `close` with the stored env (graceful: cookies flushed) -> wait for Chrome to exit
         -> terminate_recorded() for anything still alive -> remove the session's socket-dir
         files -> delete a throw-away profile.

Errors are AnchorError with messages free of secrets (no proxy credential, no CDP address).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import psutil

from supervisor import agent_browser as ab
from supervisor.home import private_dir
from supervisor.sweep import ProcRecord, terminate_recorded, wait_gone

LAUNCH_TIMEOUT = 60.0
#: Visited once through the proxy right after launch (the proxy answers 407, agent-browser
#: answers with the run's credential, Chrome caches it; the proxy then denies the host).
#: Measured: without it, the first real navigation through an authenticating proxy ended on
#: chrome-error://chromewebdata/ in ~1 of 12-25 launches although `open` reported success.
WARMUP_URL = "http://sfguard-warmup.invalid/"
COMMAND_TIMEOUT = 20.0
CLOSE_TIMEOUT = 15.0


class AnchorError(Exception):
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


@dataclass
class Anchor:
    """A running anchor. `env` (holds the proxy credential) and `cdp_url` (the RAW CDP address)
    are secrets: never log, persist in API answers or hand to a stage."""
    session: str
    env: dict[str, str] = field(repr=False)
    cdp_url: str = field(repr=False)
    profile_dir: Path
    temp_profile: bool
    socket_dir: Path
    processes: list[ProcRecord]
    launch_seconds: float
    headed: bool = False

    def record(self, kind: str) -> ProcRecord | None:
        return next((p for p in self.processes if p.kind == kind), None)

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
    graceful: bool                 # agent-browser `close` succeeded and the browser exited by itself
    terminated: list[ProcRecord]   # processes that had to be signalled
    removed_files: list[str]
    seconds: float


@runtime_checkable
class BrowserHost(Protocol):
    """The seam for local or remote browsers (see DESIGN 6)."""

    async def launch_anchor(self, spec: AnchorSpec) -> Anchor: ...
    async def close_anchor(self, anchor: Anchor, timeout: float = CLOSE_TIMEOUT) -> CloseReport: ...
    def alive(self, anchor: Anchor) -> bool: ...
    async def open_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT) -> StageSession: ...
    async def close_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT) -> CloseReport: ...


# --------------------------------------------------------------------------- helpers

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


def find_browser_process(profile_dir: Path) -> ProcRecord | None:
    """The live Chrome main process of `profile_dir` (SingletonLock first, then a psutil scan)."""
    pid = singleton_lock_pid(profile_dir)
    if pid is not None:
        try:
            proc = psutil.Process(pid)
            if _is_main_browser(proc, profile_dir):
                return ProcRecord(pid, proc.create_time(), "browser")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    uid = os.getuid()
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.info["uids"] and proc.info["uids"].real == uid and _is_main_browser(proc, profile_dir):
                return ProcRecord(proc.pid, proc.create_time(), "browser")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


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
    """Anchors as agent-browser sessions on this machine."""

    def __init__(self, agent_browser: str | os.PathLike | None = None, *,
                 launch_timeout: float = LAUNCH_TIMEOUT, command_timeout: float = COMMAND_TIMEOUT):
        self.binary = str(agent_browser) if agent_browser else None
        self.launch_timeout = launch_timeout
        self.command_timeout = command_timeout

    def _bin(self) -> str:
        if self.binary is None:
            self.binary = ab.default_binary()
        return self.binary

    async def _run_ok(self, env, *args, timeout=None) -> str:
        return await ab.run_ok(env, *args, timeout=timeout or self.command_timeout, binary=self._bin())

    # ---- anchors

    async def launch_anchor(self, spec: AnchorSpec) -> Anchor:
        if spec.proxy_url is None and not spec.allow_direct:
            raise AnchorError("refusing to launch a browser without the run's proxy")
        if spec.headed and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
            # agent-browser would start a private Xvfb nobody sees (we set NO_XVFB, so Chrome
            # would just fail): say why up front.
            raise AnchorError("a headed browser needs a display, but neither DISPLAY nor "
                              "WAYLAND_DISPLAY is set (run headless, or start the guard in a desktop session)")
        started = time.monotonic()
        socket_dir = private_dir(Path(spec.socket_dir))
        ab.write_pinned_config(spec.config_path)
        temp_profile = spec.profile_dir is None
        if temp_profile:
            root = private_dir(Path(spec.temp_root or socket_dir.parent))
            profile_dir = Path(tempfile.mkdtemp(prefix=f"tp-{spec.session[:20]}-", dir=root))
        else:
            profile_dir = Path(spec.profile_dir)
            if not profile_dir.is_absolute():
                raise AnchorError("the profile dir must be an absolute path")
            private_dir(profile_dir)
        try:
            env = ab.anchor_env(session=spec.session, socket_dir=socket_dir,
                                config_path=spec.config_path, browser_path=spec.browser_path,
                                profile_dir=profile_dir, proxy_url=spec.proxy_url, headed=spec.headed)
        except ValueError as exc:
            self._drop_temp(profile_dir, temp_profile)
            raise AnchorError(str(exc)) from None
        existing = find_browser_process(profile_dir)
        if existing is not None:
            # A second launch on a profile in use would fail and delete the live anchor's
            # DevToolsActivePort. The lease should prevent this; this is the safety net.
            self._drop_temp(profile_dir, temp_profile)
            raise AnchorError(f"the profile of session {spec.session} is already open in another browser")
        if ab.daemon_pid(socket_dir, spec.session) and _daemon_record(socket_dir, spec.session):
            self._drop_temp(profile_dir, temp_profile)
            raise AnchorError(f"an agent-browser session named {spec.session} is already running")

        records: list[ProcRecord] = []
        try:
            await self._run_ok(env, "open", "about:blank", timeout=self.launch_timeout)
            records = self._collect(socket_dir, spec.session, profile_dir)
            await self._disable_stream(env)
            if spec.proxy_url is not None:
                await self._warm_up_proxy_auth(env)
            cdp_url = (await self._run_ok(env, "get", "cdp-url")).strip()
            if not cdp_url.startswith("ws://127.0.0.1:"):
                raise AnchorError("agent-browser returned an unexpected CDP address form")
            records = self._collect(socket_dir, spec.session, profile_dir)
            if not any(r.kind == "browser" for r in records):
                raise AnchorError("the browser process of the anchor could not be identified")
        except (ab.AgentBrowserError, AnchorError, OSError) as exc:
            records = records or self._collect(socket_dir, spec.session, profile_dir)
            await self._cleanup_failed(env, records, socket_dir, spec.session)
            self._drop_temp(profile_dir, temp_profile)
            raise AnchorError(f"could not launch anchor {spec.session}: {exc}") from None
        return Anchor(session=spec.session, env=env, cdp_url=cdp_url, profile_dir=profile_dir,
                      temp_profile=temp_profile, socket_dir=socket_dir, processes=records,
                      launch_seconds=time.monotonic() - started, headed=spec.headed)

    def _collect(self, socket_dir: Path, session: str, profile_dir: Path) -> list[ProcRecord]:
        recs = [r for r in (_daemon_record(socket_dir, session), find_browser_process(profile_dir)) if r]
        return recs

    async def _disable_stream(self, env: dict[str, str]) -> None:
        """Every session starts an unauthenticated stream WebSocket on loopback: turn it off
        and verify."""
        await self._run_ok(env, "stream", "disable")
        status = await ab.run_json(env, "stream", "status", timeout=self.command_timeout, binary=self._bin())
        if status.get("enabled") is not False:
            raise AnchorError("the agent-browser stream server is still enabled after `stream disable`")

    async def _warm_up_proxy_auth(self, env: dict[str, str]) -> None:
        """One request through the proxy so Chrome holds the proxy credential before any stage
        navigates; its outcome (a denial) does not matter. Then back to about:blank."""
        try:
            await ab.run(env, "open", WARMUP_URL, timeout=self.command_timeout, binary=self._bin())
        except ab.AgentBrowserError:
            pass
        await self._run_ok(env, "open", "about:blank")

    async def _cleanup_failed(self, env, records, socket_dir: Path, session: str) -> None:
        try:
            await ab.run(env, "close", timeout=10, binary=self._bin())
        except (ab.AgentBrowserError, OSError):
            pass
        extra = _daemon_record(socket_dir, session)  # a failed launch leaves its daemon running
        await asyncio.to_thread(terminate_recorded, [*records, *([extra] if extra else [])], 5.0)
        ab.remove_session_files(socket_dir, session)

    @staticmethod
    def _drop_temp(profile_dir: Path, temp_profile: bool) -> None:
        if temp_profile:
            shutil.rmtree(profile_dir, ignore_errors=True)

    async def close_anchor(self, anchor: Anchor, timeout: float = CLOSE_TIMEOUT) -> CloseReport:
        started = time.monotonic()
        graceful = False
        daemon = anchor.record("daemon")
        if daemon is not None and daemon.alive():
            try:
                res = await ab.run(anchor.env, "close", timeout=timeout, binary=self._bin())
                graceful = res.returncode == 0
            except ab.AgentBrowserError:
                graceful = False
        remaining = max(1.0, timeout - (time.monotonic() - started))
        browser_gone = await asyncio.to_thread(
            wait_gone, [r for r in anchor.processes if r.kind == "browser"], remaining)
        # The daemon exits ~1 s after `close` returns; give it a moment before signalling.
        await asyncio.to_thread(wait_gone, anchor.processes, 3.0 if graceful else 0.0)
        terminated = await asyncio.to_thread(terminate_recorded, anchor.processes, 5.0)
        removed = ab.remove_session_files(anchor.socket_dir, anchor.session)
        if anchor.temp_profile:
            shutil.rmtree(anchor.profile_dir, ignore_errors=True)
        return CloseReport(graceful=graceful and browser_gone and not terminated,
                           terminated=terminated, removed_files=removed,
                           seconds=time.monotonic() - started)

    def alive(self, anchor: Anchor) -> bool:
        """True while both the agent-browser daemon and Chrome of the anchor run."""
        kinds = {r.kind for r in anchor.processes if r.alive()}
        return {"daemon", "browser"} <= kinds

    # ---- stage sessions

    async def open_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT) -> StageSession:
        """Start a stage's session (env from agent_browser.stage_env): its own pinned tab,
        stream disabled. Uses the env exactly as given."""
        session, socket_dir = _session_env_parts(env)
        private_dir(socket_dir)
        try:
            # The first command starts the stage's daemon and connects it through the gate;
            # `stream disable` as that first command keeps the stream server off for the
            # session's life (measured on 0.41.2: 0.18 s, vs 0.3-0.6 s for open + disable).
            # The stage's own first `open` then creates and pins its tab.
            await self._disable_stream(env)
        except (ab.AgentBrowserError, AnchorError) as exc:
            await self.close_stage_session(env, timeout=min(timeout, 10))
            raise AnchorError(f"could not open stage session {session}: {exc}") from None
        target = None
        try:
            target = json.loads((socket_dir / f"{session}.target").read_text()).get("targetId")
        except (OSError, ValueError, AttributeError):
            pass
        rec = _daemon_record(socket_dir, session)
        return StageSession(session=session, target_id=target, processes=[rec] if rec else [])

    async def close_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT) -> CloseReport:
        """Close the stage's tab first (`close` on a --cdp session only disconnects), then the
        session; end its daemon if it lingers; remove its socket-dir files. Chrome stays."""
        started = time.monotonic()
        session, socket_dir = _session_env_parts(env)
        rec = _daemon_record(socket_dir, session)
        graceful = True
        if rec is not None and rec.alive():
            for args in (("tab", "close"), ("close",)):
                try:
                    res = await ab.run(env, *args, timeout=timeout, binary=self._bin())
                    graceful = graceful and res.returncode == 0
                except ab.AgentBrowserError:
                    graceful = False
        else:
            graceful = False
        records = [rec] if rec else []
        await asyncio.to_thread(wait_gone, records, 3.0)
        terminated = await asyncio.to_thread(terminate_recorded, records, 5.0)
        removed = ab.remove_session_files(socket_dir, session)
        return CloseReport(graceful=graceful and not terminated, terminated=terminated,
                           removed_files=removed, seconds=time.monotonic() - started)
