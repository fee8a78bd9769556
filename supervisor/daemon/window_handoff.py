"""A `local_window` handoff's life: open while the person logs in through the visible window,
then ended, and the window with it.

A window handoff ends when its time is up (`expired`: `timeout_s`, default 15 minutes), when
its login stage ends or fails, or when its run ends (`ended`). At its end the anchor goes back
to headless (relaunched on the same profile folder: the login the person made stays), unless a
stage of the run that still uses the browser asked for `headed: true`. `GET
/v1/runs/{id}/handoff` answers its state like a live view's; `handoff_closed` goes to the audit
chain with the outcome."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sfguard.supervisor.daemon.runs import Browser, Run, RunState, StageState
from sfguard.supervisor.daemon.stage_browser import BROWSER_ERRORS
from sfguard.supervisor.errors import GuardError
from sfguard.supervisor.protocols import ProfileError
from sfguard.supervisor.states import HandoffPhase, handoff_move

log = logging.getLogger("sfguard.handoff")

#: a window handoff nobody ends is over after this many seconds (the live view's default too)
WINDOW_TIMEOUT = 900.0
WATCH_STEP = 0.25


@dataclass
class WindowHandoff:
    run_id: str
    profile: str
    browser_key: str
    stage_id: str | None
    site: str
    deadline: float
    created: float = field(default_factory=time.monotonic)
    state: HandoffPhase = HandoffPhase.OPEN
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task | None = None
    finishing: bool = False

    def public(self) -> dict[str, Any]:
        return {"state": self.state, "kind": "local_window", "site": self.site, "profile": self.profile}


class WindowHandoffs:
    """The open and recent window handoffs, one per run (the newest). Given what it uses: the
    guard's runs, how to audit an end (`audit(outcome, fields)`), how to put a browser back
    to headless (`headless(run, browser)`), and the guard's webhooks (`notify`)."""

    def __init__(self, runs: Mapping[str, Run], audit: Callable[[str, dict[str, Any]], Awaitable[None]],
                 headless: Callable[[Run, Browser], Awaitable[None]],
                 notify: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.runs, self.audit, self.headless, self.notify = runs, audit, headless, notify
        self.items: dict[str, WindowHandoff] = {}

    def open(self, run: Run, browser: Browser, profile: str, site: str, stage_id: str | None,
             timeout_s: float | None) -> WindowHandoff:
        old = self.items.get(run.run_id)
        if old is not None and old.watcher is not None:
            old.watcher.cancel()          # replaced by this one; its window is this one's
        h = WindowHandoff(run.run_id, profile, browser.key, stage_id, site,
                          time.monotonic() + float(timeout_s or WINDOW_TIMEOUT))
        self.items[run.run_id] = h
        h.watcher = asyncio.get_running_loop().create_task(self._watch(h))
        return h

    async def _watch(self, h: WindowHandoff) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while h.state == HandoffPhase.OPEN:
                await asyncio.sleep(WATCH_STEP)
                run = self.runs.get(h.run_id)
                stage = run.stages.get(h.stage_id) if (run is not None and h.stage_id) else None
                if run is None or run.state != RunState.ACTIVE:
                    await self.finish(h, "ended")
                elif stage is not None and stage.state in (StageState.ENDED, StageState.FAILED):
                    await self.finish(h, "ended")
                elif time.monotonic() >= h.deadline:
                    await self.finish(h, "expired")

    async def finish(self, h: WindowHandoff, outcome: str) -> None:
        """Audit the end, put the anchor back to headless, then answer the new state (a runner
        that long-polls it finds the window gone)."""
        if h.state != HandoffPhase.OPEN or h.finishing:
            return
        h.finishing = True
        run = self.runs.get(h.run_id)
        fields: dict[str, Any] = dict(profile=h.profile, run=h.run_id, by="guard", mode="local_window")
        if h.stage_id:
            fields["stage"] = h.stage_id
        try:
            await self.audit(outcome, fields)
        except (GuardError, ProfileError, OSError) as exc:   # the store away or refusing: the window still goes
            log.warning("handoff_closed of run %s not audited: %s", h.run_id, type(exc).__name__)
        if run is not None and run.state == RunState.ACTIVE:
            browser = run.browsers.get(h.browser_key)
            wanted = browser is not None and any(
                run.stages[s].headed for s in browser.stages
                if s in run.stages and run.stages[s].state not in (StageState.ENDED, StageState.FAILED))
            if browser is not None and browser.headed and not wanted:
                try:
                    await self.headless(run, browser)
                except BROWSER_ERRORS as exc:   # the browser stays as it is; the watchdog keeps it
                    log.warning("the login window of run %s did not go back to headless: %s",
                                h.run_id, type(exc).__name__)
        h.state = handoff_move(h.state, outcome)
        log.info("login window of run %s ended: %s", h.run_id, outcome, extra={"run": h.run_id})
        if self.notify is not None:
            self.notify("handoff_ended", {"kind": "local_window", "run": h.run_id, "stage": h.stage_id,
                                          "profile": h.profile, "site": h.site, "outcome": outcome})
        h.changed.set()

    async def close_all(self) -> None:
        for h in list(self.items.values()):
            if h.watcher is not None:
                h.watcher.cancel()
