"""The stage state machine: move a stage forward (browser user, lease, browser, attach) or
withdraw a waiting one, and wake waiting stages when a lease or a browser user comes free.

Its steps are services of their own: the lease and the browser (browser_supply.py), attaching
the stage to its browser through the gate (stage_attach.py); a stage's end is teardown.py's."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.daemon.runs import WAITING_STATES, Run, RunState, Stage, StageOutcome, StageState
from sfguard.supervisor.daemon.stage_browser import BROWSER_ERRORS, browser_failed
from sfguard.supervisor.errors import Conflict, GuardError, swallowed
from sfguard.supervisor.profiles import store_ops
from sfguard.supervisor.protocols import StoreUnavailable, Waiting

if TYPE_CHECKING:
    from sfguard.supervisor.browsers.browser_pool import BrowserPool
    from sfguard.supervisor.browsers.browser_user import BrowserUser
    from sfguard.supervisor.daemon.browser_supply import BrowserSupply
    from sfguard.supervisor.daemon.crash import RunRecords
    from sfguard.supervisor.daemon.metrics import GuardMetrics
    from sfguard.supervisor.daemon.stage_attach import StageAttach
    from sfguard.supervisor.profiles.store_ops import StoreCalls
    from sfguard.supervisor.profiles.stores import Stores
    from sfguard.supervisor.record.recorder import Recorder

log = logging.getLogger("sfguard.guard")


class Stages:
    """The stage state machine over its two steps."""

    def __init__(self, *, runs: dict[str, Run], stores: Stores, calls: StoreCalls, records: RunRecords,
                 metrics: GuardMetrics, recorder: Recorder, supply: BrowserSupply, attaching: StageAttach):
        self.runs, self.stores, self.calls, self.records = runs, stores, calls, records
        self.metrics, self.recorder, self.supply, self.attaching = metrics, recorder, supply, attaching
        supply.on_user_back.append(self.wake)
        self._wakes: set[asyncio.Task[None]] = set()

    async def advance(self, run: Run, stage: Stage) -> None:
        """Move a pending/waiting stage forward: a browser user (a new browser needs one), the
        lease, the browser, gate token, env."""
        t0 = time.monotonic()
        req = stage.browser_req
        self.recorder.stage(run.run_id, stage.stage_id, stage.attempt, "requested", profile=req.profile,
                            allow=list(req.allow_domains), writes=req.writes, headed=stage.headed)
        user: BrowserUser | None = None
        try:
            async with run.lock:
                if stage.state in (StageState.READY, StageState.ENDED, StageState.FAILED) \
                        or run.state != RunState.ACTIVE:
                    return
                key = self.supply.profile_key(run, req.profile) if req.profile is not None else None
                # a new browser needs a user of its own, taken before the lease (a run that waits
                # for a user holds no profile meanwhile), but only when the lease would be
                # granted: a stage that will wait for its profile takes none (it would hand one
                # back at every turn of the queue, waking every stage that waits for one)
                pool = self.supply.pool() if self.supply.needs_browser(run, key) else None
                if pool is not None and (key is None or await self.calls.run(self.supply.lease_open, key, run.run_id)):
                    user = await asyncio.to_thread(pool.take, f"run {run.run_id}")
                    if user is None:
                        return self.wait_for_user(run, stage, pool)
                stage.pool_wait = None
                if key is not None:
                    try:
                        result = await self.calls.run(store_ops.grant, self.stores, key, run.run_id,
                                                   self.supply.identity(run, key))
                    except StoreUnavailable as exc:   # shared store away: no grant now, ask again
                        stage.move(StageState.WAITING)
                        stage.waiting = None
                        stage.store_wait = (f"{exc}; the guard asks again and grants the profile "
                                            "when the database answers")
                        return
                    stage.store_wait = None
                    if isinstance(result, Waiting):
                        if stage.state != StageState.WAITING:
                            self.metrics.lease_waited()
                        stage.move(StageState.WAITING)
                        stage.waiting = result
                        self.recorder.stage(run.run_id, stage.stage_id, stage.attempt, "waiting",
                                            holder_run=result.holder_run or None)
                        return
                    if pool is not None and user is None:    # the lease came free meanwhile
                        user = await asyncio.to_thread(pool.take, f"run {run.run_id}")
                        if user is None:
                            return self.wait_for_user(run, stage, pool)
                    t1 = time.monotonic()
                    handed, user = user, None      # the browser owns it now (or gives it back)
                    browser = await self.supply.ensure_anchor(run, key, stage.headed, handed)
                else:
                    t1 = time.monotonic()
                    handed, user = user, None
                    browser = await self.supply.throwaway(run, stage, handed)
                t2 = time.monotonic()
                await self.attaching.attach(run, browser, stage)
                if stage.state == StageState.READY:
                    self.recorder.stage(run.run_id, stage.stage_id, stage.attempt, "ready", browser=browser.key)
                    self.metrics.stage_ready(time.monotonic() - t0)
                    # where a stage's start-up time goes (supervisor_bench measures the whole)
                    log.info("stage %s/%s ready in %.0f ms (lease %.0f, browser %.0f, session %.0f)",
                             run.run_id, stage.stage_id, (time.monotonic() - t0) * 1000,
                             (t1 - t0) * 1000, (t2 - t1) * 1000, (time.monotonic() - t2) * 1000,
                             extra={"run": run.run_id, "stage": stage.stage_id})
        except GuardError as exc:
            stage.move(StageState.FAILED)
            stage.error = exc
        except BROWSER_ERRORS as exc:
            log.warning("stage %s/%s could not get a browser: %s", run.run_id, stage.stage_id, exc,
                        extra={"run": run.run_id, "stage": stage.stage_id})
            stage.move(StageState.FAILED)
            stage.error = browser_failed(exc, "the guard could not start this stage's browser", None)
        finally:
            if stage.state == StageState.FAILED and stage.error is not None:
                self.recorder.stage(run.run_id, stage.stage_id, stage.attempt, "failed", error=stage.error.code)
            if user is not None:      # taken for a browser that was not started (a lease wait)
                await self.supply.release_user(user)
            with swallowed(log, f"run {run.run_id}: saving its record", (OSError,)):
                self.records.save(run)

    def wait_for_user(self, run: Run, stage: Stage, pool: BrowserPool) -> None:
        """The stage waits for a browser user (`browser_pool_full`); a browser's end wakes it."""
        stage.move(StageState.WAITING)
        stage.waiting, stage.pool_wait = None, pool.full_reason()
        self.recorder.stage(run.run_id, stage.stage_id, stage.attempt, "waiting", reason="browser_pool_full")

    def wake(self) -> None:
        """The stages waiting for a browser user are moved on (one came back)."""
        if any(st.pool_wait for r in self.runs.values() if r.state == RunState.ACTIVE
               for st in r.waiting_stages()):
            task = asyncio.get_running_loop().create_task(self.advance_waiting())
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)

    async def cancel_waiting(self, run: Run, stage: Stage) -> dict[str, Any]:
        """A waiting stage request withdrawn: it leaves the profile's queue and ends cancelled
        (409 stage_not_waiting once it has a browser: that is ended, not cancelled)."""
        stage_id = stage.stage_id
        async with run.lock:
            if stage.state in (StageState.ENDED, StageState.FAILED):
                return {"state": "ended", "outcome": stage.outcome or "failed"}
            if stage.state not in WAITING_STATES:
                raise Conflict("stage_not_waiting", f"stage {stage_id!r} is {stage.state}, not "
                               "waiting: end it with POST .../end", "stage_id")
            stage.move(StageState.ENDED)
            stage.outcome = StageOutcome.CANCELLED
            self.recorder.stage(run.run_id, stage_id, stage.attempt, "ended", outcome="cancelled")
            profile = stage.browser_req.profile
            others = [s for s in run.stages.values() if s is not stage and s.state in WAITING_STATES
                      and s.browser_req.profile == profile]
            if profile is not None and not others:
                key = self.supply.profile_key(run, profile)

                def leave_queue() -> None:
                    holder = self.stores.lease.holder(key)
                    if holder is None or holder.run != run.run_id:
                        self.stores.lease.release(key, run.run_id)   # the queue only (never a held lease)
                with contextlib.suppress(StoreUnavailable):  # away: its queue place lapses with
                    await self.calls.run(leave_queue)        # this guard's, or goes at run end
        log.info("stage %s/%s left the queue", run.run_id, stage_id,
                 extra={"run": run.run_id, "stage": stage_id})
        await self.advance_waiting()   # the places behind it move up now
        return {"state": "ended", "outcome": "cancelled"}

    async def advance_waiting(self) -> None:
        """Every waiting stage of every active run, once (a lease may have been released)."""
        for other in list(self.runs.values()):
            if other.state == RunState.ACTIVE:
                for st in other.waiting_stages():
                    await self.advance(other, st)
