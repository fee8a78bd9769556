"""The watchdog: every WATCH_INTERVAL it re-reads the site policy, moves waiting stages on,
restarts a run proxy that died (same port, same clients) and a browser that died (then its
stages get new gate tokens and sessions: the next GET of a stage answers the new env)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sfguard.supervisor.daemon.runs import Browser, Run, RunState, StageState, now_iso
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.procs import terminate_recorded

if TYPE_CHECKING:
    from sfguard.supervisor.browsers.host import BrowserHost
    from sfguard.supervisor.daemon.browser_supply import BrowserSupply
    from sfguard.supervisor.daemon.crash import RunRecords
    from sfguard.supervisor.daemon.deferred import Deferred
    from sfguard.supervisor.daemon.metrics import GuardMetrics
    from sfguard.supervisor.daemon.stage_attach import StageAttach
    from sfguard.supervisor.daemon.stage_sessions import StageSessions
    from sfguard.supervisor.daemon.stages import Stages
    from sfguard.supervisor.gate.cdp_gate import CdpGate

log = logging.getLogger("sfguard.guard")

WATCH_INTERVAL = 0.25


class Watchdog:
    """Given exactly what it watches and what it uses to repair: the guard's runs, the stage
    steps (advance; the supply's launch and users; attach), run records, the browser host, stage sessions, the
    gate, the work a full disk put off, the policy check, and the metrics (restarts counted)."""

    def __init__(self, *, runs: dict[str, Run], stages: Stages, supply: BrowserSupply, attaching: StageAttach,
                 records: RunRecords, host: BrowserHost, sessions: StageSessions, gate: CdpGate, deferred: Deferred,
                 check_policy: Callable[[], object], metrics: GuardMetrics | None = None):
        self.runs, self.stages, self.records, self.host = runs, stages, records, host
        self.supply, self.attaching = supply, attaching
        self.sessions, self.gate, self.deferred, self.check_policy = sessions, gate, deferred, check_policy
        self.metrics = metrics
        self.last_pass: float | None = None

    async def loop(self) -> None:
        self.last_pass = time.monotonic()           # running: ready from its start on
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            try:
                await self.once()
                self.last_pass = time.monotonic()     # readiness (supervisor/daemon/health.py)
            except Exception:   # a task's top: one failed pass must not end the watchdog
                log.exception("watchdog pass failed")

    async def once(self) -> None:
        self.check_policy()
        await self.supply.retry_users()      # a browser user a stuck process kept
        if await self.deferred.retry():        # a release landed: hand the profiles on
            for run in list(self.runs.values()):
                if run.state == RunState.ACTIVE:
                    for stage in run.waiting_stages():
                        await self.stages.advance(run, stage)
        for run in list(self.runs.values()):
            if run.state != RunState.ACTIVE:
                continue
            for stage in run.waiting_stages():
                await self.stages.advance(run, stage)
            if run.proxy is not None and run.proxy.proc is not None and not run.proxy.alive():
                log.warning("run %s: guard proxy died; restarting it on the same port", run.run_id,
                            extra={"run": run.run_id})
                run.proxy.restarts += 1
                if self.metrics is not None:
                    self.metrics.restarted("proxy")
                with swallowed(log, f"run {run.run_id}: stopping its dead proxy"):
                    await run.proxy.stop()
                await run.proxy.start()
                self.records.save(run)
            for browser in list(run.browsers.values()):
                if (browser.anchor is not None and not browser.closing and not browser.lock.locked()
                        and not self.host.alive(browser.anchor)):
                    await self.restart_browser(run, browser)

    async def restart_browser(self, run: Run, browser: Browser, by: str | None = None) -> None:
        """Replace a run's browser (it died; or `by` a person in the console asked): the old
        one's processes end, a new one starts on the same profile and proxy client."""
        async with browser.lock:
            if browser.closing or run.state != RunState.ACTIVE:
                return
            log.warning("run %s: browser %s %s; restarting it", run.run_id, browser.key,
                        f"restarted by {by}" if by else "died", extra={"run": run.run_id})
            dead = browser.anchor
            assert dead is not None
            await self.sessions.drop(dead)
            await asyncio.to_thread(terminate_recorded, dead.processes, 3)
            await dead.pipe.close()
            browser.restarts += 1
            if self.metrics is not None:
                self.metrics.restarted("browser")
            for sid in browser.stages:  # answer 202 until the new env works
                st = run.stages[sid]
                what = f"was restarted by {by}" if by else "stopped and was restarted"
                st.events.append({"ts": now_iso(), "event": "browser_restarted",
                                  "message": f"the stage's browser {what}: its tabs are gone and its gate "
                                  "URL changed; GET the stage for the new env"})
                if st.state == StageState.READY:
                    st.move(StageState.RELAUNCHING)
            browser.anchor = await self.supply.launch(run, browser,
                                                   dead.profile_dir if browser.profile else None)
            await self.reattach(run, browser)

    async def reattach(self, run: Run, browser: Browser) -> None:
        """After the browser was replaced: new gate tokens for its stages; the next GET of a
        stage returns the refreshed env."""
        for sid in sorted(browser.stages):
            stage = run.stages[sid]
            if stage.state in (StageState.READY, StageState.RELAUNCHING) and stage.gate_key:
                await self.gate.revoke(stage.gate_key)
                # the old session's daemon served the dead browser: end it with its files (a
                # new session is started below), so no agent-browser outlives the guard
                if stage.env_full:
                    with swallowed(log, f"stage {stage.stage_id}: closing the dead browser's session"):
                        await self.host.close_stage_session(stage.env_full, graceful=False)
                await asyncio.to_thread(terminate_recorded, stage.processes, 3)
                stage.move(StageState.PENDING)
                async with run.lock:
                    await self.attaching.attach(run, browser, stage)
        self.records.save(run)
