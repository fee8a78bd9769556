"""Teardown: one path per level, each with a named outcome.

`end_stage(run, stage, outcome)`, `close_browser(run, browser)` and `end_run(run, outcome)`.
Every step runs even when an earlier one failed; failures are collected and reported.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.daemon.deferred import waits_for
from sfguard.supervisor.daemon.pacing import browser_budgets, forget_budget
from sfguard.supervisor.daemon.runs import (
    Browser,
    Run,
    RunOutcome,
    RunState,
    Stage,
    StageOutcome,
    StageState,
)
from sfguard.supervisor.daemon.stage_browser import BROWSER_ERRORS
from sfguard.supervisor.errors import BrowserStartError, swallowed
from sfguard.supervisor.procs import terminate_recorded
from sfguard.supervisor.profiles import rotation, store_ops
from sfguard.supervisor.protocols import ProfileError
from sfguard.supervisor.writes.modes import stage_left

if TYPE_CHECKING:
    from sfguard.supervisor.browsers.host import BrowserHost
    from sfguard.supervisor.daemon.browser_supply import BrowserSupply
    from sfguard.supervisor.daemon.crash import RunRecords
    from sfguard.supervisor.daemon.deferred import Deferred
    from sfguard.supervisor.daemon.stage_sessions import StageSessions
    from sfguard.supervisor.daemon.stages import Stages
    from sfguard.supervisor.gate.cdp_gate import CdpGate
    from sfguard.supervisor.profiles.store_ops import StoreCalls
    from sfguard.supervisor.profiles.stores import Stores
    from sfguard.supervisor.record.recorder import Recorder
    from sfguard.supervisor.stage.stage_bridge import BridgeHost
    from sfguard.supervisor.writes.approvals import Approvals

log = logging.getLogger("sfguard.guard")


class Teardown:
    """Given what it ends and what it reports to: the guard's runs, the stage state machine
    (advancing waiting stages), the browser supply (browser users given back), records, the
    browser host, stage sessions, the gate, the stage bridges, held writes, the profile stores
    and their calls, what a full disk put off; `run_ended` (retention), `flush_refusals` (the
    gate's aggregated denials) and `notify` (the guard's webhooks: a run that ends as failed)."""

    def __init__(self, *, runs: dict[str, Run], stages: Stages, supply: BrowserSupply,
                 records: RunRecords, host: BrowserHost, sessions: StageSessions, gate: CdpGate, bridges: BridgeHost,
                 approvals: Approvals, stores: Stores, calls: StoreCalls, deferred: Deferred,
                 run_ended: Callable[[Run], None], flush_refusals: Callable[[], None],
                 notify: Callable[[str, dict[str, Any]], None] | None = None, recorder: Recorder | None = None):
        self.runs, self.stages, self.supply, self.records, self.host = runs, stages, supply, records, host
        self.sessions, self.gate, self.bridges, self.approvals = sessions, gate, bridges, approvals
        self.stores, self.calls, self.deferred = stores, calls, deferred
        self.run_ended, self.flush_refusals, self.notify = run_ended, flush_refusals, notify
        self.recorder = recorder      # the run record: a stage's end, the run's end and seal

    async def end_stage(self, run: Run, stage: Stage, outcome: StageOutcome) -> list[str]:
        """Close the stage's tabs and session (with its own env), revoke its token, then drop
        its domains from its browser's allowlist; a throw-away browser is closed."""
        problems: list[str] = []
        if stage.state == StageState.ENDED:
            return problems
        was_ready = stage.state == StageState.READY
        stage.move(StageState.ENDED)
        stage.outcome = StageOutcome(outcome)
        if self.recorder is not None:
            self.recorder.stage(run.run_id, stage.stage_id, stage.attempt, "ended", outcome=str(stage.outcome))
        self.approvals.cancel(run.run_id, stage.stage_id)    # its held writes are denied, never sent
        if stage.gate_key:  # a stage-exec sandbox loses its gate and proxy at once
            await self.bridges.close(stage.gate_key, run.proxy)
        if stage.gate_key and was_ready:
            # 1. the stage's session ends, through its still valid token
            if stage.env_full:
                try:
                    await self.host.close_stage_session(stage.env_full)
                except BROWSER_ERRORS as exc:
                    log.debug("stage session close: %s", exc)
            # 2. the stage's tabs, over the raw connection
            with swallowed(log, f"stage {stage.stage_id}: closing its tabs"):
                await self.gate.close_stage_tabs(stage.gate_key)
            # 3. only then the token: revoking first would leave a session nobody can close
            await self.gate.revoke(stage.gate_key)
            # in a thread: the event loop also answers every browser's paused requests
            await asyncio.to_thread(terminate_recorded, stage.processes, 3)
        browser = run.browsers.get(stage.browser_key or "")
        if browser is not None:
            browser.stages.discard(stage.stage_id)
            with swallowed(log, f"stage {stage.stage_id}: its browser's write gate without it"):
                stage_left(run, browser)
            if browser.profile is None:
                problems += await self.close_browser(run, browser)
            elif run.proxy is not None and browser.client in run.proxy.clients:
                try:
                    await run.proxy.set_allow(browser.client, run.browser_allow(browser),
                                              browser_budgets(run, browser))   # the stage's budget goes
                except BrowserStartError as exc:
                    problems.append(str(exc))
        forget_budget(run.proxy, stage)
        with swallowed(log, f"run {run.run_id}: saving its record", (OSError,)):
            self.records.save(run)
        return problems

    async def close_browser(self, run: Run, browser: Browser) -> list[str]:
        problems: list[str] = []
        browser.closing = True
        # what its user may own: checked (taken back by root if still there) before the user
        # goes back to the pool
        owned = (browser.anchor.profile_dir, *([browser.anchor.home_dir] if browser.anchor.home_dir else [])) \
            if browser.anchor is not None else ()
        if browser.anchor is not None:
            await self.sessions.drop(browser.anchor)   # a spare no stage took
            try:
                await self.host.close_anchor(browser.anchor)
            except BROWSER_ERRORS as exc:
                problems.append(f"closing the browser of {browser.key}: {exc}")
                await asyncio.to_thread(terminate_recorded, browser.anchor.processes)
            browser.anchor = None
        if browser.profile is not None:
            try:
                await self.calls.run(rotation.close_profile, self.stores, browser.profile, run.run_id)
            except (ProfileError, OSError) as exc:   # a seal or store failure, a full disk, a key away
                wait = waits_for(exc)
                if wait:      # keep the login: resealed when space (or the key) is there
                    self.deferred.reseal_later(browser.profile, run.run_id, wait)
                    problems.append(f"resealing profile {browser.profile.name}: {wait[0]} ({exc}); "
                                    "its unsealed copy and this run's lease are kept, and the guard "
                                    f"reseals it as soon as {wait[1]}")
                else:
                    problems.append(f"resealing profile {browser.profile.name} failed: {exc}; "
                                    "the previous sealed copy is kept")
                    with swallowed(log, f"profile {browser.profile.name}: closing without saving"):
                        await self.calls.run(self.stores.store.close, browser.profile, save=False)
        if run.proxy is not None:
            try:
                await run.proxy.remove_client(browser.client)
            except BrowserStartError as exc:   # the proxy ends with the run: its old set is harmless
                log.info("run %s: the proxy kept the ended browser's credential: %s", run.run_id, exc,
                         extra={"run": run.run_id})
        run.browsers.pop(browser.key, None)
        user, browser.user = browser.user, None
        if user is not None:   # every process of its user ended, its files gone or resealed (or root's)
            await self.supply.release_user(user, owned)
        return problems

    async def end_run(self, run: Run, outcome: RunOutcome) -> None:
        outcome = RunOutcome(outcome)
        async with run.lock:
            if run.state != RunState.ACTIVE:
                return
            run.state, run.outcome = RunState.ENDING, outcome
        stage_outcome = (StageOutcome.SUCCEEDED if outcome == RunOutcome.SUCCEEDED
                         else StageOutcome.CANCELLED)
        for stage in list(run.stages.values()):
            if stage.state != StageState.ENDED:
                run.problems += await self.end_stage(run, stage, stage_outcome)
        self.approvals.cancel(run.run_id, reason="the run ended")
        for browser in list(run.browsers.values()):
            run.problems += await self.close_browser(run, browser)
        if run.proxy is not None:
            await run.proxy.stop()
        if self.deferred.holds(run.run_id):   # a reseal waits for space: so does the release
            self.deferred.release_later(run.run_id, outcome.value)
        else:
            _released, problems = await self.calls.run(store_ops.release_run, self.stores,
                                                    run.run_id, outcome.value)
            wait = self.deferred.no_space_problem(problems) if problems else None
            if wait:
                self.deferred.release_later(run.run_id, outcome.value, wait)
            run.problems += problems
        if run.workdir is not None:
            shutil.rmtree(run.workdir, ignore_errors=True)
        run.state = RunState.ENDED
        if self.recorder is not None:    # sealed: its index's digest goes into the audit chain
            await self.recorder.run_ended(run.run_id, str(outcome), run.problems)
        self.records.drop(run.run_id)
        self.run_ended(run)      # its record stays on disk; it leaves memory after the retention
        # hand the released profiles over at once, not at the next watchdog tick
        for other in list(self.runs.values()):
            if other.state == RunState.ACTIVE:
                for st in other.waiting_stages():
                    asyncio.get_running_loop().create_task(self.stages.advance(other, st))
        self.flush_refusals()
        if outcome == RunOutcome.FAILED and self.notify is not None:
            failed = sorted(s.stage_id for s in run.stages.values()
                            if s.outcome in (StageOutcome.FAILED, StageOutcome.TIMED_OUT) or s.error is not None)
            self.notify("run_failed", {"run": run.run_id, "outcome": str(outcome), "stages_failed": failed,
                                       "problems": len(run.problems)})
        log.info("run %s ended: %s%s", run.run_id, outcome,
                 f" ({len(run.problems)} problem(s))" if run.problems else "", extra={"run": run.run_id})
