"""Stage sessions: a stage's gate token plus its agent-browser session, and one spare per
shared anchor started ahead so that the next stage of the run does not wait for one.

Starting a stage's session (`BrowserHost.open_stage_session`: an agent-browser CLI and daemon
that connect through the gate, open and pin the stage's tab and turn the unauthenticated
stream server off) is the one slow step of a stage start: 0.2 s on a quiet machine, over a
second under load (bench/supervisor_bench.py). The rest (token, proxy allowlist, stage-exec
bridges) takes a few milliseconds. So for a shared anchor (a profile's browser, used by every
stage of the run that names the profile) the guard keeps one session started ahead:

  prestart(anchor)  registers a fresh gate token under a placeholder key (`RUN/~spare/ANCHOR`,
                    never a stage's key: `~` is not allowed in ids), and starts a session on it
                    in the background, with the env a stage would get.
  take(anchor, key) gives that spare to a stage: the gate registration (token, pinned tab, open
                    connection) is renamed to the stage's key. A spare still starting is waited
                    for (it is further along than a new one); a failed or dead one is dropped.
                    None when there is none: the caller starts a session itself.
  drop(anchor)      ends a spare nobody took (run end, browser closed or restarted): its tabs
                    closed, token revoked, daemon ended, session files removed.

A spare belongs to one anchor (keyed by the anchor's session name, which changes when a browser
is restarted) and is taken at most once, so a stage never gets another stage's token or tab. A
taken spare is an ordinary stage session from then on: stage end closes and revokes it as any.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sfguard.supervisor.browsers import agent_browser
from sfguard.supervisor.browsers.host import Anchor, AnchorError, BrowserHost
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.gate.cdp_gate import CdpGate, GateError
from sfguard.supervisor.procs import ProcRecord, renice_all_threads, terminate_recorded

log = logging.getLogger("sfguard.sessions")

#: the niceness a spare's session starts at, added to the guard's own (`nice`); a taken spare's
#: daemon gets the guard's priority back where the OS lets the guard raise it (root). 0: a
#: spare that starts late also delays the end of a short run, which waits for it.
SPARE_NICE = 0

#: how long `take` waits for a spare that is still starting (its own start is bounded by the
#: host's command timeout; this only caps the wait of one stage request)
TAKE_WAIT = 30.0


@dataclass
class StartedSession:
    """A gate registration with a running agent-browser session on it."""
    gate_key: str
    url: str = field(repr=False)                    # the gate URL with the token
    env_full: dict[str, str] = field(repr=False)    # the session's env (closing needs the same)
    processes: list[ProcRecord] = field(default_factory=list)
    tab: str | None = None                          # the stage's pinned tab

    @property
    def session(self) -> str:
        return self.env_full["AGENT_BROWSER_SESSION"]


def _result(task: asyncio.Task) -> StartedSession | None:
    """A finished spare task's session; None when it failed or was cancelled."""
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()


def _ready(task: asyncio.Task, on_ready: Callable[[], None]) -> None:
    if _result(task) is not None:
        with swallowed(log, "the spare session's ready callback"):
            on_ready()


def _session_name() -> str:
    return f"sfs-{secrets.token_hex(4)}"


class StageSessions:
    """Stage sessions of one guard: started on demand, or ahead (one spare per shared anchor)."""

    def __init__(self, gate: CdpGate, host: BrowserHost, socket_dir: Path, config_path: Path,
                 stage_keys: tuple[str, ...]):
        self.gate, self.host = gate, host
        self.socket_dir, self.config_path = socket_dir, config_path
        self.stage_keys = stage_keys   # the AGENT_BROWSER_* variables a stage gets
        self._spares: dict[str, asyncio.Task] = {}       # anchor session -> task -> StartedSession | None
        self._ending: set[asyncio.Task] = set()

    async def start(self, gate_key: str, anchor: Anchor, *, artifacts_dir: Path | None,
                    tab_quota: int, own_tab: str | None = None, nice: int = 0) -> StartedSession:
        """Register `gate_key` at the gate and start its session (its tab pinned, stream off).
        `own_tab`: a tab that is the stage's from the start (the browser's start-up tab).
        On failure nothing is left: the token is revoked and the session ended."""
        url = self.gate.add_stage(gate_key, anchor.pipe, {own_tab} if own_tab else None,
                                  artifacts_dir=artifacts_dir, tab_quota=tab_quota)
        full = agent_browser.stage_env(session=_session_name(), socket_dir=self.socket_dir,
                                       config_path=self.config_path, cdp_url=url)
        # the stage's variables and the inherited ones (PATH, HOME...), nothing the stage will
        # not carry: every command of a session must have the same env
        env = {k: v for k, v in full.items()
               if k in self.stage_keys or not k.startswith("AGENT_BROWSER_")}
        bound = False
        try:
            # The session is bound to one tab that is the stage's before it starts: the
            # browser's start-up tab, else one the gate creates now. Left to itself,
            # agent-browser attaches to a page (creating one when the stage has none) and then
            # creates its pinned tab: two tab creations, the slowest Chromium work of a session.
            tab = own_tab or await self.gate.create_stage_tab(gate_key, visible=anchor.headed)
            opened = await self.host.open_stage_session(env, nice=nice, target_id=tab)
            bound = True
        finally:
            if not bound:
                await self.gate.revoke(gate_key, close_tabs=True)   # tabs of no stage
        return StartedSession(gate_key, url, env, list(opened.processes), tab)

    # -- spares -------------------------------------------------------------------------------
    def prestart(self, run_id: str, anchor: Anchor, *, artifacts_dir: Path | None,
                 tab_quota: int, on_ready: Callable[[], None] | None = None) -> None:
        """Start a spare for `anchor` in the background, unless one exists or is starting."""
        task = self._spares.get(anchor.session)
        if task is not None and not (task.done() and _result(task) is None):
            return
        key = f"{run_id}/~spare/{anchor.session}"
        task = asyncio.get_running_loop().create_task(
            self._spare(key, anchor, artifacts_dir, tab_quota))
        self._spares[anchor.session] = task
        if on_ready is not None:
            # called once the task is done, so that `spare_records` (read by on_ready to write
            # the run's crash record) already sees the ready spare
            task.add_done_callback(lambda t: _ready(t, on_ready))

    async def _spare(self, key: str, anchor: Anchor, artifacts_dir: Path | None,
                     tab_quota: int) -> StartedSession | None:
        try:
            return await self.start(key, anchor, artifacts_dir=artifacts_dir, tab_quota=tab_quota,
                                    nice=SPARE_NICE)
        except (AnchorError, GateError, OSError, ValueError) as exc:
            log.info("spare stage session for %s not started: %s", anchor.session, exc)
            return None
        except Exception:   # a task's top: a spare is only ahead of time; a stage that finds none starts its own
            log.exception("spare stage session for %s not started", anchor.session)
            return None

    def spare_records(self, anchor: Anchor) -> tuple[list[ProcRecord], list[str]]:
        """The processes and session name of the anchor's ready spare (for the crash record)."""
        task = self._spares.get(anchor.session)
        started = _result(task) if task is not None and task.done() else None
        return ([], []) if started is None else (list(started.processes), [started.session])

    async def take(self, anchor: Anchor, gate_key: str, tab_quota: int) -> StartedSession | None:
        """The anchor's spare, now registered as `gate_key`; None when there is no usable one."""
        task = self._spares.pop(anchor.session, None)
        if task is None:
            return None
        try:
            started = await asyncio.wait_for(asyncio.shield(task), TAKE_WAIT)
        except asyncio.CancelledError:   # the request was cancelled: nobody gets this spare
            self._end_when_done(task)
            raise
        except TimeoutError:   # too slow (a failed one answers None): the stage starts its own
            self._end_when_done(task)
            return None
        if started is None:
            return None
        alive = all(r.alive() for r in started.processes) and not anchor.pipe.closed.is_set()
        if not alive:
            await self.end(started)
            return None
        try:
            self.gate.rekey(started.gate_key, gate_key, tab_quota)
        except GateError:
            await self.end(started)
            return None
        started.gate_key = gate_key
        for rec in started.processes:   # the stage's own now: back to the guard's priority
            renice_all_threads(rec.pid, os.getpriority(os.PRIO_PROCESS, 0))
        return started

    def _end_when_done(self, task: asyncio.Task) -> None:
        """A spare taken out of the table but given to no stage: ended once it has started."""
        async def end() -> None:
            started = await task    # None when it failed (_spare logs why); cancelled: this ends too
            if started is not None:
                await self.end(started)
        ending = asyncio.get_running_loop().create_task(end())
        self._ending.add(ending)   # the loop keeps only weak references to tasks
        ending.add_done_callback(self._ending.discard)

    async def drop(self, anchor: Anchor) -> None:
        """End the anchor's spare, if any (waits for one that is still starting)."""
        task = self._spares.pop(anchor.session, None)
        if task is not None:
            await self._drop(task)

    async def drop_all(self) -> None:
        """At guard stop: every spare ended; one that cannot be does not stop the others."""
        for session in list(self._spares):
            with swallowed(log, f"dropping the spare session {session}"):
                await self._drop(self._spares.pop(session))

    async def _drop(self, task: asyncio.Task) -> None:
        try:
            started = await asyncio.wait_for(asyncio.shield(task), TAKE_WAIT)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):   # _spare itself never raises
                await task
            started = None
        if started is not None:
            await self.end(started)

    async def end(self, started: StartedSession) -> None:
        """A session nobody will use (a spare not taken, a stage start that failed after it):
        its tabs closed over the pipe, its token revoked (the connection cut), its daemon ended
        and its files removed. No agent-browser command."""
        with swallowed(log, "closing a spare session's tabs"):
            await self.gate.close_stage_tabs(started.gate_key)
        await self.gate.revoke(started.gate_key)
        with swallowed(log, "closing a spare session"):
            await self.host.close_stage_session(started.env_full, graceful=False)
        await asyncio.to_thread(terminate_recorded, started.processes, 3)
