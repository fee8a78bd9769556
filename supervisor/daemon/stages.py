"""Browsers and stages: move a stage forward (lease, browser, gate token, env) and give runs
their browsers (a leased profile's anchor, or a throw-away one) behind the run's proxy."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sfguard.policy.writes import WriteRules
from sfguard.supervisor import models
from sfguard.supervisor.browsers import xdisplay
from sfguard.supervisor.browsers.host import Anchor, AnchorSpec
from sfguard.supervisor.daemon.pacing import PageLoads, browser_budgets, pace_key, pace_view, stage_budget
from sfguard.supervisor.daemon.run_proxy import short_id
from sfguard.supervisor.daemon.runs import WAITING_STATES, Browser, Run, RunState, Stage, StageOutcome, StageState
from sfguard.supervisor.daemon.shared_proxy import AnyPool, AnyRunProxy
from sfguard.supervisor.daemon.stage_browser import BROWSER_ERRORS, browser_failed
from sfguard.supervisor.errors import BadRequest, BrowserStartError, Conflict, GuardError, Unavailable, swallowed
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, PipeClosed
from sfguard.supervisor.home import private_dir
from sfguard.supervisor.profiles import store_ops
from sfguard.supervisor.profiles.local_store import pipeline_profile_name
from sfguard.supervisor.protocols import ProfileKey, StoreUnavailable, Waiting
from sfguard.supervisor.writes.modes import guard_writes, rewire_writes, stage_write_modes
from sfguard.supervisor.writes.websockets import guard_websockets

if TYPE_CHECKING:
    from sfguard.policy.engine import SitePolicy
    from sfguard.policy.watch import PolicyWatcher
    from sfguard.supervisor.browsers.browser_pool import BrowserPool
    from sfguard.supervisor.browsers.browser_user import BrowserUser
    from sfguard.supervisor.browsers.host import BrowserHost
    from sfguard.supervisor.browsers.tools import Tool
    from sfguard.supervisor.daemon.crash import RunRecords
    from sfguard.supervisor.daemon.metrics import GuardMetrics
    from sfguard.supervisor.daemon.stage_sessions import StageSessions
    from sfguard.supervisor.gate.cdp_gate import CdpGate
    from sfguard.supervisor.profiles.store_ops import StoreCalls
    from sfguard.supervisor.profiles.stores import Stores
    from sfguard.supervisor.record.recorder import Recorder
    from sfguard.supervisor.stage.stage_bridge import BridgeHost
    from sfguard.supervisor.writes.held import WriteApprover

    WriteRecorder = Callable[[str, dict[str, object]], None]

log = logging.getLogger("sfguard.guard")

#: The whole stage env (docs/design.md 4.3): nothing else reaches a stage.
STAGE_ENV_KEYS = ("AGENT_BROWSER_CDP", "AGENT_BROWSER_SESSION", "AGENT_BROWSER_SOCKET_DIR",
                  "AGENT_BROWSER_PIN_TAB", "AGENT_BROWSER_CONFIG", "AGENT_BROWSER_IDLE_TIMEOUT_MS")
class Stages:
    """The stage state machine and the browsers behind it, over the guard's parts."""

    def __init__(self, *, runs: dict[str, Run], scope: str, stores: Stores, calls: StoreCalls,
                 store_call: Callable[..., Awaitable[Any]], records: RunRecords, metrics: GuardMetrics,
                 policy_watch: PolicyWatcher, host: BrowserHost, browser_tool: Tool,
                 pool: Callable[[], BrowserPool | None], gate: CdpGate,
                 sessions: StageSessions, bridges: BridgeHost, proxies: AnyPool, runtime: Path,
                 socket_dir: Path, config_path: Path, write_approver: WriteApprover,
                 write_gate_timeout: float, write_record: WriteRecorder, recorder: Recorder):
        """Given exactly what it uses: the guard's runs and scope, the profile store (and its
        calls off the event loop), run records and metrics, the policy in force, the browser host
        and tool, the browser user (set when the guard starts), the gate, stage sessions and
        bridges, the proxy pool, the runtime folders, the write gates' approver and log, and
        the run record (supervisor/record: what each stage did). `pool`: a root guard's browser
        users (set when the guard starts), one per browser."""
        self.recorder = recorder
        self.runs, self.scope, self.stores, self.store, self.calls = runs, scope, stores, stores.store, calls
        self.store_call, self.records, self.metrics, self.policy_watch = store_call, records, metrics, policy_watch
        self.host, self.browser_tool, self.pool, self.gate = host, browser_tool, pool, gate
        self.sessions, self.bridges, self.proxies, self.runtime = sessions, bridges, proxies, runtime
        self.socket_dir, self.config_path = socket_dir, config_path
        self.write_approver, self.write_gate_timeout, self.write_record = (
            write_approver, write_gate_timeout, write_record)
        # HTTPS page loads, kept in the browser (the gate asks it; each pipe tells it)
        self.page_loads = PageLoads(runs, lambda: self.site_policy, getattr(proxies, "pace", None), gate)
        gate.pace = self.page_loads
        self._wakes: set[asyncio.Task[None]] = set()

    @property
    def site_policy(self) -> SitePolicy:
        """The policy in force (the last good one)."""
        return self.policy_watch.policy

    # -- names ---------------------------------------------------------------------------------
    def profile_key(self, run: Run, name: str) -> ProfileKey:
        if name == models.PIPELINE_PROFILE:
            if not run.pipeline:
                raise BadRequest("no_pipeline", "profile '@pipeline' needs a run created with "
                                 "a pipeline path", "browser.profile")
            name = pipeline_profile_name(run.pipeline)
        return ProfileKey(self.scope, name)

    @staticmethod
    def identity(run: Run, key: ProfileKey) -> str | None:
        """A profile made for `@pipeline` keeps its workflow identity (PLAT-322): the same on
        every host, since it depends only on the normalised pipeline path."""
        return (pipeline_profile_name(run.pipeline) if run.pipeline
                and key.name == pipeline_profile_name(run.pipeline) else None)

    def browser_allow(self, run: Run, browser: Browser) -> list[str]:
        out: set[str] = set()
        for sid in browser.stages:
            st = run.stages.get(sid)
            if st is not None:
                out.update(st.browser_req.allow_domains)
        return sorted(out)

    # -- the stage state machine ---------------------------------------------------------------
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
                key = self.profile_key(run, req.profile) if req.profile is not None else None
                # a new browser needs a user of its own, taken before the lease (a run that waits
                # for a user holds no profile meanwhile), but only when the lease would be
                # granted: a stage that will wait for its profile takes none (it would hand one
                # back at every turn of the queue, waking every stage that waits for one)
                pool = self.pool() if self.needs_browser(run, key) else None
                if pool is not None and (key is None or await self.calls.run(self.lease_open, key, run.run_id)):
                    user = await asyncio.to_thread(pool.take, f"run {run.run_id}")
                    if user is None:
                        return self.wait_for_user(run, stage, pool)
                stage.pool_wait = None
                if key is not None:
                    try:
                        result = await self.calls.run(store_ops.grant, self.stores, key, run.run_id,
                                                   self.identity(run, key))
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
                    browser = await self.ensure_anchor(run, key, stage.headed, handed)
                else:
                    t1 = time.monotonic()
                    handed, user = user, None
                    browser = await self.throwaway(run, stage, handed)
                t2 = time.monotonic()
                await self.attach(run, browser, stage)
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
                await self.release_user(user)
            with swallowed(log, f"run {run.run_id}: saving its record", (OSError,)):
                self.records.save(run)

    def wait_for_user(self, run: Run, stage: Stage, pool: BrowserPool) -> None:
        """The stage waits for a browser user (`browser_pool_full`); a browser's end wakes it."""
        stage.move(StageState.WAITING)
        stage.waiting, stage.pool_wait = None, pool.full_reason()
        self.recorder.stage(run.run_id, stage.stage_id, stage.attempt, "waiting", reason="browser_pool_full")

    def lease_open(self, key: ProfileKey, run_id: str) -> bool:
        """Whether `run_id` would be granted `key` now: it holds it, or nobody does and nobody
        is queued before it (a store call: run it off the event loop). An unreachable store: no."""
        try:
            holder = self.stores.lease.holder(key)
            if holder is not None:
                return holder.run == run_id
            queue = self.stores.lease.queue(key)
        except StoreUnavailable:
            return False
        return not queue or queue[0].run == run_id

    def needs_browser(self, run: Run, key: ProfileKey | None) -> bool:
        """A stage of `key` (None: profile-less) needs a new browser in `run`."""
        browser = run.browsers.get(key.name) if key is not None else None
        return browser is None or browser.anchor is None

    async def take_user(self, run: Run) -> BrowserUser | None:
        """A browser user for a new browser of `run` (None without a pool). Unavailable when
        every user is in use (a login check or handoff: asked again by the runner)."""
        pool = self.pool()
        if pool is None:
            return None
        user = await asyncio.to_thread(pool.take, f"run {run.run_id}")
        if user is None:
            raise Unavailable("browser_failed", pool.full_reason(), "profile")
        return user

    async def retry_users(self) -> None:
        """Users kept out of the pool by a process that would not end: tried again."""
        pool = self.pool()
        if pool is None or not pool.stuck():
            return
        if await asyncio.to_thread(pool.retry_stuck):
            self.wake()

    def wake(self) -> None:
        """The stages waiting for a browser user are moved on (one came back)."""
        if any(st.pool_wait for r in self.runs.values() if r.state == RunState.ACTIVE
               for st in r.waiting_stages()):
            task = asyncio.get_running_loop().create_task(self.advance_waiting())
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)

    async def release_user(self, user: BrowserUser | None, leftovers: tuple[Path, ...] = ()) -> None:
        """Give a browser user back (its processes ended, `leftovers` it may still own taken back
        by root); the stages waiting for one are moved on."""
        pool = self.pool()
        if user is None or pool is None:
            return
        if await asyncio.to_thread(pool.give_back, user, leftovers):
            self.wake()

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
                key = self.profile_key(run, profile)

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

    def write_rules(self) -> WriteRules:
        """The live site policy's writes section (read at each request: hot reload)."""
        return self.site_policy.writes

    def write_owner(self, browser: Browser):
        """frame id -> the stage id whose tab it is, on this browser (the gate knows)."""
        def owner(frame_id: object) -> str | None:
            key = self.gate.stage_of_target(browser.anchor.pipe, frame_id) if browser.anchor else None
            parts = key.split("/") if key else []
            return parts[1] if len(parts) == 3 and not parts[1].startswith("~") else None
        return owner

    def policy_changed(self) -> None:
        """A reloaded site policy: write floors and exceptions in force for every live browser."""
        rewire_writes([r for r in self.runs.values() if r.state == RunState.ACTIVE], self.site_policy,
                      self.write_approver, self.write_gate_timeout, self.write_record, self.write_rules)

    async def attach(self, run: Run, browser: Browser, stage: Stage) -> None:
        assert run.proxy is not None and run.workdir is not None and browser.anchor is not None
        browser.stages.add(stage.stage_id)
        stage.browser_key = browser.key
        stage.write_modes = stage_write_modes(self.site_policy, stage.browser_req.writes,
                                              list(stage.browser_req.allow_domains))
        stage.started = time.time()        # its budget's active minutes count from here
        stage.pace, stage.budget = pace_view(self.site_policy, stage)
        # the browser's rules first (its write gate, its extension's rules), then its proxy lets
        # it reach the stage's hosts: nothing leaves a browser before the guard's rules are in
        # force (a new browser's proxy client is held until this set_allow)
        guard_writes(run, browser, stage, self.write_approver, self.write_gate_timeout, self.write_record,
                     self.write_rules, self.write_owner(browser))
        # the record's own view of the browser's stage tabs, before the stage's session opens one
        await self.recorder.browser(run.run_id, browser.anchor.pipe, browser.profile.name if browser.profile else None)
        await guard_websockets(browser.anchor)   # before the stage gets the browser
        self.page_loads.watch(run, browser)      # its HTTPS page loads counted (daemon/pacing.py)
        await run.proxy.set_allow(browser.client, self.browser_allow(run, browser), browser_budgets(run, browser))
        gate_key = f"{run.run_id}/{stage.stage_id}/{stage.attempt}"
        # downloads: a browser user's own folder (in its HOME), else the run's
        anchor, quota = browser.anchor, self.site_policy.tab_quota
        artifacts = anchor.downloads or run.workdir / "artifacts"
        # The stage's session (a gate token, an agent-browser session through it with the
        # stage's tab pinned and the unauthenticated stream server off): a shared anchor's
        # spare, started ahead, when there is one; else one started now. A shared anchor then
        # starts the spare for its next stage (supervisor/daemon/stage_sessions.py).
        started = await self.sessions.take(anchor, gate_key, quota) if browser.profile else None
        # The next stage's session starts beside this stage's own. On 2 cores the two share
        # the CPU: measured in one sitting (supervisor_bench, 5 rounds, load ~4), beside it the
        # first stage was 1.92x a bare launch and a second stage requested at once ready in
        # 40 ms; after it, 1.23x and 791 ms. Started after it, a spare is also still starting
        # when a short run ends, and the run's end waits for it: the test suite took minutes
        # longer (docs/agent-browser-notes.md, "First stage").
        if browser.profile is not None:
            def save_unless_ended() -> None:
                if run.state != RunState.ENDED:
                    self.records.save(run)
            self.sessions.prestart(run.run_id, anchor, artifacts_dir=artifacts, tab_quota=quota,
                                on_ready=save_unless_ended)
        if started is None:
            # the browser's start-up tab, while no stage has had it: agent-browser attaches to
            # it instead of creating a first tab of its own (docs/agent-browser-notes.md)
            started = await self.sessions.start(gate_key, anchor, artifacts_dir=artifacts,
                                              tab_quota=quota, own_tab=anchor.take_blank_tab())
        if anchor.headed and started.tab:   # a person at the screen sees the stage's tab
            with contextlib.suppress(PipeClosed, CdpCallError, TimeoutError):
                await anchor.pipe.call("Target.activateTarget", {"targetId": started.tab}, timeout=5)
        # The stage's bridges for `sfguard stage-exec` (closed at stage end, like the token).
        bridged = False
        try:
            await self.bridges.open(gate_key, started.url, run.proxy, stage.browser_req.allow_domains,
                                    stage.browser_req.writes, pace=(pace_key(run, browser), stage_budget(stage)))
            bridged = True
        finally:
            if not bridged:
                await self.sessions.end(started)
        if stage.state == StageState.ENDED:
            # ended (POST .../end) while its browser was being made: nothing of it may stay open
            browser.stages.discard(stage.stage_id)
            await self.bridges.close(gate_key, run.proxy)
            await self.sessions.end(started)
            if browser.profile is not None and browser.client in run.proxy.clients:
                await run.proxy.set_allow(browser.client, self.browser_allow(run, browser),
                                          browser_budgets(run, browser))
            log.info("stage %s/%s ended before it was ready", run.run_id, stage.stage_id,
                     extra={"run": run.run_id, "stage": stage.stage_id})
            return
        stage.gate_key = gate_key
        # The stage gets exactly the docs/design.md 4.3 variables; the guard started the session, and
        # closes it later, with the same ones (plus PATH/HOME...): both sides carry one env.
        stage.env = {k: started.env_full[k] for k in STAGE_ENV_KEYS}
        stage.env_full = dict(started.env_full)
        stage.processes = list(started.processes)
        stage.move(StageState.READY)
        stage.waiting = None

    # -- browsers ------------------------------------------------------------------------------
    async def ensure_proxy(self, run: Run) -> AnyRunProxy:
        """The run's proxy: the pool's warm spare when one is ready (a proxy child takes ~0.7 s
        to start), else a new one; then a new spare is started in the background."""
        if run.proxy is None:
            run.workdir = private_dir(self.runtime / f"r-{short_id()}")
            run.proxy = await self.proxies.take(run.run_id)
            self.records.save(run)
            self.proxies.refill()
        return run.proxy

    async def launch(self, run: Run, browser: Browser, profile_dir: Path | None) -> Anchor:
        """Start `browser` (a first launch, a restart, a relaunch headed) as its user."""
        proxy = await self.ensure_proxy(run)
        assert run.workdir is not None
        if self.browser_tool.path is None:
            raise BrowserStartError("no browser found (install Chromium or set SFGUARD_BROWSER)")
        spec = AnchorSpec(session=f"sfa-{short_id()}", socket_dir=self.socket_dir,
                          config_path=self.config_path, browser_path=self.browser_tool.path,
                          profile_dir=profile_dir, proxy_url=proxy.url_for(browser.client),
                          headed=browser.headed, temp_root=run.workdir, user=browser.user,
                          window_title=xdisplay.window_title(
                              browser.profile.name if browser.profile else None, browser.site))
        return await self.host.launch_anchor(spec)

    async def ensure_anchor(self, run: Run, key: ProfileKey, headed: bool,
                            user: BrowserUser | None = None) -> Browser:
        """The run's browser on `key`, started when it has none. `user`: the browser user taken
        for it (given back when not needed or when the start fails); one is taken when needed."""
        browser = run.browsers.get(key.name)
        if browser is not None and browser.anchor is not None:
            await self.release_user(user)
            return browser
        user = user or await self.take_user(run)
        profile_dir: Path | None = None
        ready = False
        try:
            proxy = await self.ensure_proxy(run)
            t0 = time.monotonic()
            if not await self.calls.run(self.store.exists, key):   # the grant made it; deleted since?
                await self.calls.run(store_ops.create_profile, self.stores, key, self.identity(run, key),
                                  run=run.run_id)
            name = await proxy.add_client([], held=True,      # refused everything until attach
                                          pace_key=f"p:{key.scope}/{key.name}")
            browser = Browser(key.name, key, headed, name, user=user)
            run.browsers[key.name] = browser
            profile_dir = await self.calls.run(self.store.open, key)
            self.records.save(run)
            t1 = time.monotonic()
            try:
                browser.anchor = await self.launch(run, browser, profile_dir)
            finally:
                if browser.anchor is None:   # it never started, so it changed nothing: drop the working
                    # copy (the sealed profile stays as it was) so that the next request can open it again
                    run.browsers.pop(key.name, None)
                    with swallowed(log, f"profile {key.name}: closing after a failed launch"):
                        await self.calls.run(self.store.close, key, save=False)
                    with swallowed(log, "removing the failed browser's proxy client", (BrowserStartError,)):
                        await proxy.remove_client(name)
            ready = True
        finally:
            if not ready:
                await self.release_user(user, (profile_dir,) if profile_dir is not None else ())
        self.page_loads.watch(run, browser)      # the guard's own login checks count too
        log.info("run %s: anchor for profile %s ready (profile opened in %.0f ms, browser "
                 "launched in %.0f ms)", run.run_id, key.name, (t1 - t0) * 1000,
                 browser.anchor.launch_seconds * 1000, extra={"run": run.run_id, "profile": key.name})
        if browser.anchor.carried:    # what would have run before the guard: removed, and said
            removed = "; ".join(browser.anchor.carried)
            log.warning("run %s: profile %s carried what would have run before the guard; removed or "
                        "kept from loading: %s", run.run_id, key.name, removed,
                        extra={"run": run.run_id, "profile": key.name})
            with swallowed(log, "the audit record of a cleaned profile"):
                await self.calls.run(self.stores.audit.record, "profile_cleaned", profile=key.name,
                                     run=run.run_id, removed=removed[:500])
        return browser

    async def throwaway(self, run: Run, stage: Stage, user: BrowserUser | None = None) -> Browser:
        """A throw-away browser for a profile-less stage, as `user` (taken when not given)."""
        user = user or await self.take_user(run)
        key = f"tmp-{stage.stage_id}"
        ready = False
        try:
            proxy = await self.ensure_proxy(run)
            name = await proxy.add_client([], held=True,      # refused everything until attach
                                          pace_key=f"b:{run.run_id}/{key}")
            browser = Browser(key, None, stage.headed, name, user=user)
            run.browsers[key] = browser
            browser.anchor = await self.launch(run, browser, None)
            ready = True
        finally:
            if not ready:
                failed = run.browsers.get(key)
                if failed is not None and failed.anchor is None:    # never started: nothing of it stays
                    run.browsers.pop(key)
                    with swallowed(log, "removing the failed browser's proxy client", (BrowserStartError,)):
                        await proxy.remove_client(failed.client)
                await self.release_user(user)
        return browser

    async def leased_browser(self, run: Run, profile: str, headed: bool) -> Browser:
        """The run's browser on `profile` for a login check or handoff, leasing it now; a
        profile another run holds is a conflict (this run is queued)."""
        key = self.profile_key(run, profile)
        async with run.lock:
            result = await self.store_call(store_ops.grant, self.stores, key, run.run_id,
                                        self.identity(run, key))
            if isinstance(result, Waiting):
                raise Conflict("profile_leased", f"profile {key.name!r} is leased by run "
                               f"{result.holder_run!r}; this run is queued", "profile")
            try:
                return await self.ensure_anchor(run, key, headed)
            except BROWSER_ERRORS as exc:
                # the same answer as a stage request whose browser fails (never a 500)
                raise browser_failed(exc, f"could not start the browser of profile {key.name!r}",
                                     "profile") from None
            finally:
                self.records.save(run)
