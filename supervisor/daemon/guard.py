"""The guard daemon: one `Guard` per home, the composition root over the named services of
supervisor/daemon/ (docs/design.md maps them). The Guard's service methods (one per control API
route, named as api.py's ROUTES name them) take validated models and return plain answers; they
raise domain errors (supervisor/errors.py), never HTTP: api.py alone decides statuses.

The Guard is built with its collaborators: `stores` (keys, store, lease, audit: the local
home or a shared store by default, supervisor/profiles/stores.py), `browser_host` (local
Chromium through agent-browser by default) and `handoff` (a local window by default).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sfguard import policy
from sfguard.supervisor import models
from sfguard.supervisor.browsers import agent_browser, browser_pool, tools
from sfguard.supervisor.browsers.handoff import Handoff, LocalWindowHandoff
from sfguard.supervisor.browsers.host import BrowserHost, LocalBrowserHost
from sfguard.supervisor.console import handoff as live
from sfguard.supervisor.daemon.approvals_api import ApprovalsApi
from sfguard.supervisor.daemon.audit_watch import AuditWatch
from sfguard.supervisor.daemon.browser_supply import BrowserSupply
from sfguard.supervisor.daemon.crash import RunRecords, release_runtime, sweep
from sfguard.supervisor.daemon.deferred import Deferred
from sfguard.supervisor.daemon.gate_refusals import GateRefusals
from sfguard.supervisor.daemon.health import Health
from sfguard.supervisor.daemon.instance import GuardAlreadyRunning, Instance
from sfguard.supervisor.daemon.inventory import Inventory
from sfguard.supervisor.daemon.keys_service import KeysService
from sfguard.supervisor.daemon.log_rotation import keep_rotated
from sfguard.supervisor.daemon.logins import Logins
from sfguard.supervisor.daemon.metrics import GuardMetrics, sfguard_version
from sfguard.supervisor.daemon.notify import Notifier
from sfguard.supervisor.daemon.pacing import PageLoads
from sfguard.supervisor.daemon.policy_reload import check_policy
from sfguard.supervisor.daemon.retention import Retention
from sfguard.supervisor.daemon.run_proxy import RunProxy
from sfguard.supervisor.daemon.runs import (
    WAITING_STATES,
    Run,
    RunOutcome,
    RunState,
    Stage,
    StageOutcome,
    StageState,
)
from sfguard.supervisor.daemon.settings import GuardSettings
from sfguard.supervisor.daemon.shared_proxy import pace_setting, proxy_pool
from sfguard.supervisor.daemon.stage_attach import STAGE_ENV_KEYS, StageAttach
from sfguard.supervisor.daemon.stage_browser import effective_headed
from sfguard.supervisor.daemon.stage_exec import StageExecService
from sfguard.supervisor.daemon.stage_sessions import StageSessions
from sfguard.supervisor.daemon.stages import Stages
from sfguard.supervisor.daemon.status_view import guard_status
from sfguard.supervisor.daemon.teardown import Teardown
from sfguard.supervisor.daemon.watchdog import Watchdog
from sfguard.supervisor.errors import Conflict, Forbidden, swallowed
from sfguard.supervisor.gate.cdp_gate import CdpGate
from sfguard.supervisor.home import (
    ensure_home,
    ensure_home_policy,
    private_dir,
    revoke_traverse,
    runtime_dir,
    runtime_path,
    upgrade_format,
)
from sfguard.supervisor.profiles.store_ops import StoreCalls
from sfguard.supervisor.profiles.stores import Stores, open_stores
from sfguard.supervisor.protocols import LOCAL_SCOPE, AuditSink, ProfileStore
from sfguard.supervisor.record.recorder import Recorder, recorded
from sfguard.supervisor.record.tee import AuditTee
from sfguard.supervisor.stage.stage_bridge import BridgeHost
from sfguard.supervisor.writes.approvals import Approvals
from sfguard.supervisor.writes.modes import decision_recorder

if TYPE_CHECKING:
    from sfguard.supervisor.console.server import ConsoleServer

log = logging.getLogger("sfguard.guard")

#: a stage answer that may still change; long-poll re-checks it every LONG_POLL_STEP seconds
LONG_POLL_STEP = 0.1
__all__ = ["Guard", "GuardAlreadyRunning", "GuardSettings", "RunProxy", "release_runtime", "sweep"]


class Guard:
    """The composition root: `__init__` builds the parts and hands each service what it uses;
    the methods are the control API's routes that need several parts, and the lifecycle."""

    def __init__(self, home: Path, policy_path: Path | str | None = None, *,
                 resolve: dict[str, str] | None = None, scope: str = LOCAL_SCOPE,
                 store: str | None = None, stores: Stores | None = None,
                 browser_host: BrowserHost | None = None,
                 handoff: Callable[[], Handoff] = LocalWindowHandoff,
                 settings: GuardSettings | None = None):
        self.settings = settings if settings is not None else GuardSettings()
        self.home = ensure_home(home)
        upgrade_format(self.home)   # an older home is migrated, a newer one refused
        # named here, created by start (a guard that is refused before it starts, or only
        # sweeps, leaves no empty folder in /dev/shm)
        self.runtime = runtime_path(self.home)
        self.scope = scope
        # the live policy: --policy FILE, else HOME/sites.yaml (made from the shipped template
        # on first start); `sfguard policy explain|validate|test --home` read it from status
        self.policy_watch = policy.PolicyWatcher(  # raises PolicyError if invalid
            Path(policy_path).absolute() if policy_path else ensure_home_policy(self.home))
        private_dir(self.runs_dir)
        private_dir(self.logs_dir)
        self._build_stores(store, stores)
        self.host: BrowserHost = browser_host if browser_host is not None else LocalBrowserHost()
        self.runs: dict[str, Run] = {}
        refusals = GateRefusals(self.decision_log, self.calls, self.audit)
        self.gate = self.recorder.gate = CdpGate(on_refusal=refusals.on_refusal)
        self.gate.observer = self.recorder.command     # every command a stage sends
        # stage sessions, and one started ahead per shared anchor (supervisor/daemon/stage_sessions.py)
        sessions = StageSessions(self.gate, self.host, self.socket_dir, self.config_path, STAGE_ENV_KEYS)
        # ended runs: kept in memory a while, then only on disk (supervisor/daemon/retention.py)
        self.retention = Retention(runs=self.runs, records=RunRecords(self.runs_dir, self.scope, sessions),
                                   keep_runs=self.settings.keep_ended_runs,
                                   keep_seconds=self.settings.keep_ended_seconds)
        self.proxies = proxy_pool(self.settings.proxies, self.policy_path, self.decision_log,
                                  dict(resolve or {}), pace_setting(self.home, self.stores))
        # Prometheus metrics (GET /metrics): events counted by the services, state read at scrape
        self.metrics = GuardMetrics(self.decision_log, sfguard_version())
        # webhooks (<home>/notify.yaml), the audit chain's checks, the probes (GET /v1/health/*)
        self.notifier = Notifier.from_home(self.home, metrics=self.metrics, console=lambda: self.console)
        self._build_approvals()
        # stage-exec (layer 3): per-stage bridges, the stage user and the sandbox check
        self.exec_service = StageExecService(home=self.home, runtime=self.runtime, gate=self.gate,
                                             bridges=BridgeHost(self.runtime))
        self.pool: browser_pool.BrowserPool | None = None   # layer 2: under root, a user per browser
        self._build_services(handoff, refusals, sessions)
        # the instance lock, the start time, what `sfguard start` opened beside the control socket
        self.instance = Instance(self.home)
        self._tasks: list[asyncio.Task[None]] = []      # the watchdog's loop, the log rotation

    def _build_stores(self, store: str | None, stores: Stores | None) -> None:
        """The seams (keys, store, lease, audit), the run records that tee the audit log, and
        the calls that run the seams off the event loop."""
        # the local home, or a shared PostgreSQL (`--store` / $SFGUARD_STORE): supervisor/profiles/stores.py
        self.stores = stores if stores is not None else open_stores(self.home, self.runtime, store)
        # the run records (supervisor/record): every audit record naming a run is one of its entries
        self.recorder = Recorder(self.home / "records", self.settings.record, policy=lambda: self.policy_watch.policy,
                                 backend=self.stores.backend)
        self.stores.audit = self.recorder.audit = AuditTee(self.stores.audit, self.recorder.audit_event)
        # seam calls run off the event loop (supervisor/profiles/store_ops.py)
        self.calls = StoreCalls(getattr(self.stores.backend, "pool_size", 1))
        # reseals and lease releases a full disk put off (supervisor/daemon/deferred.py)
        self.deferred = Deferred(self.stores, self.calls)

    def _build_approvals(self) -> None:
        """Held writes wait in `approvals` (answered through `approvals_api`'s routes); decided
        ones are kept as long as the decision lines naming them (the decision log's retention)."""
        kept = self.settings.log_retention
        def audited(event: str, fields: dict[str, Any]) -> None:
            self.audit.record(event, **fields)
        approvals = Approvals(audited, notify=self.notify, folder=self.home / "approvals",
                              keep_seconds=kept.max_age_s * (kept.keep + 1))
        approvals.observers.append(self.recorder.approval)
        self.approvals_api = ApprovalsApi(approvals)

    def _build_services(self, handoff: Callable[[], Handoff], refusals: GateRefusals,
                        sessions: StageSessions) -> None:
        """The services, each given exactly what it uses."""
        write_record = recorded(decision_recorder(self.decision_log), self.recorder.write_decision)
        self.inventory = Inventory(stores=self.stores, calls=self.calls, scope=self.scope)
        store_call = self.inventory.store_call
        # HTTPS page loads, kept in the browser (the gate asks it; each pipe tells it)
        page_loads = PageLoads(self.runs, lambda: self.site_policy, getattr(self.proxies, "pace", None), self.gate)
        self.gate.pace = page_loads
        supply = BrowserSupply(scope=self.scope, stores=self.stores, calls=self.calls, store_call=store_call,
                               records=self.records, host=self.host, browser_tool=tools.find_browser(),
                               pool=lambda: self.pool, proxies=self.proxies, runtime=self.runtime,
                               socket_dir=self.socket_dir, config_path=self.config_path, page_loads=page_loads)
        attaching = StageAttach(runs=self.runs, records=self.records, policy_watch=self.policy_watch, gate=self.gate,
                                sessions=sessions, bridges=self.bridges, write_approver=self.approvals,
                                write_gate_timeout=self.settings.write_gate_timeout, write_record=write_record,
                                recorder=self.recorder, page_loads=page_loads)
        self.stages = Stages(runs=self.runs, stores=self.stores, calls=self.calls, records=self.records,
                             metrics=self.metrics, recorder=self.recorder, supply=supply, attaching=attaching)
        self.teardown = Teardown(runs=self.runs, stages=self.stages, supply=supply, records=self.records,
                                 host=self.host, sessions=sessions, gate=self.gate, bridges=self.bridges,
                                 approvals=self.approvals, stores=self.stores, calls=self.calls,
                                 deferred=self.deferred, run_ended=self.retention.run_ended,
                                 flush_refusals=refusals.flush, notify=self.notify, recorder=self.recorder)
        check = functools.partial(check_policy, watch=self.policy_watch, path=self.policy_path, audit=self.audit,
                                  calls=self.calls, policy_changed=attaching.policy_changed, notify=self.notify)
        self.watchdog = Watchdog(runs=self.runs, stages=self.stages, supply=supply, attaching=attaching,
                                 records=self.records, host=self.host, sessions=sessions, gate=self.gate,
                                 deferred=self.deferred, check_policy=check, metrics=self.metrics)
        self.logins = Logins(runs=self.runs, run_of=self.retention.run_of, active_run=self.retention.active_run,
                             supply=supply, watchdog=self.watchdog, host=self.host, stores=self.stores,
                             scope=self.scope, store_call=store_call, metrics=self.metrics,
                             policy_watch=self.policy_watch, new_handoff=handoff, notify=self.notify)
        self.audit_watch = AuditWatch(self.audit.verify, self.calls.run, self.settings.audit_check_seconds,
                                      self.notify)
        self.health = Health(last_pass=lambda: self.watchdog.last_pass,
                             store_probe=lambda bound: self.calls.bounded(bound, self.inventory.lease_table))
        self.keys_service = KeysService(stores=self.stores, scope=self.scope)

    # -- the parts' own names, as the services and tools read them -----------------------------
    @property
    def records(self) -> RunRecords:
        """The runs' crash records (`runs/<id>.json`), kept beside the retention's."""
        return self.retention.records

    @property
    def sessions(self) -> StageSessions:
        return self.stages.attaching.sessions

    @property
    def policy_path(self) -> Path:
        return self.policy_watch.path

    @property
    def bridges(self) -> BridgeHost:
        return self.exec_service.bridges

    @property
    def started(self) -> float:
        return self.instance.started

    @property
    def console(self) -> ConsoleServer | None:
        return self.instance.console

    @property
    def api_tcp_port(self) -> int | None:
        return self.instance.api_tcp_port

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def decision_log(self) -> Path:
        return self.logs_dir / "decisions.log"

    @property
    def socket_dir(self) -> Path:
        return self.runtime / "ab"

    @property
    def config_path(self) -> Path:
        return self.runtime / "ab-config.json"

    @property
    def audit(self) -> AuditSink:
        return self.stores.audit

    @property
    def store(self) -> ProfileStore:
        return self.stores.store

    @property
    def notify(self) -> Callable[..., None]:
        return self.notifier.emit

    @property
    def approvals(self) -> Approvals:
        return self.approvals_api.approvals

    def listening(self, *, api_tcp_port: int | None = None, console: ConsoleServer | None = None) -> None:
        """What `sfguard start` opened beside the control socket: the API's TCP port, the console."""
        if api_tcp_port is not None:
            self.instance.api_tcp_port = api_tcp_port
        if console is not None:
            self.instance.console = console

    # -- lifecycle -------------------------------------------------------------------------
    def acquire_instance_lock(self) -> None:
        """One guard per home (`sfguard sweep` takes it too): GuardAlreadyRunning otherwise."""
        self.instance.acquire()

    async def start(self) -> dict[str, Any]:
        self.acquire_instance_lock()
        try:
            return await self._start()
        except BaseException:
            # a start that fails half-way leaves nothing: no gate, spare proxy, bridge folder
            # or runtime folder (this guard holds the lock, so they are its own)
            with swallowed(log, "stopping after a failed start"):
                await self.stop()
            raise

    async def _start(self) -> dict[str, Any]:
        await self.notifier.start()
        runtime_dir(self.home)
        private_dir(self.socket_dir)
        # before the sweep: it ends the browser users' orphans and returns them to the pool
        self.pool = browser_pool.setup(self.runtime, self.host, self.settings.browser_pool,
                                       self.settings.stage_user_name)
        self.keys_service.check_keys()      # before the sweep reseals anything
        report = sweep(self)
        # damaged state is reported, never silently reset; an interrupted rotation is finished
        audit = self.keys_service.at_start(report)
        self.audit_watch.seen(audit)    # logs and notifies a broken chain; it is kept as it is
        agent_browser.write_pinned_config(self.config_path)
        report["sandbox"] = self.exec_service.prepare(self.settings.stage_user_name, self.settings.api_gid)
        await self.gate.start()
        report["records_sealed"] = await self.recorder.start(self.logs_dir / "decisions.log")
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.watchdog.loop()),
                       loop.create_task(keep_rotated([self.decision_log], self.settings.log_retention))]
        self.audit_watch.start()
        self.proxies.refill()
        return report

    async def stop(self) -> None:
        """Tear every run down as `abandoned`, then stop the gate."""
        self.health.stopping = True
        await self.audit_watch.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.approvals.cancel(None, reason="the guard stopped")   # recorded; nothing held is sent
        await live.close_all(self.console)
        await self.logins.windows.close_all()
        for run in list(self.runs.values()):
            if run.state == RunState.ACTIVE:
                await self.teardown.end_run(run, RunOutcome.ABANDONED)
        await self.recorder.stop()      # records still open (a start that failed) are sealed
        await self.sessions.drop_all()
        await self.proxies.stop()
        await self.bridges.close_all()
        await self.gate.stop()
        self.teardown.flush_refusals()
        await self.notifier.stop()
        self.calls.close()
        release_runtime(self)
        revoke_traverse(self.runtime)
        browser_pool.close(self.pool)    # a user not given back keeps its mark for the next sweep
        self.instance.release()
        self.stores.close()

    @property
    def site_policy(self) -> policy.SitePolicy:
        """The policy in force: the last good one (an invalid edit is reported, not applied).
        The run proxies watch the same file themselves."""
        return self.policy_watch.policy

    @property
    def policy_error(self) -> str | None:
        err = self.policy_watch.error
        return str(err).replace("\n", "; ") if err is not None else None

    def check_policy(self) -> None:
        """Re-read the site policy file now (the watchdog does on every pass)."""
        self.watchdog.check_policy()

    # -- helpers -----------------------------------------------------------------------------
    def run_of(self, run_id: str) -> Run:
        return self.retention.run_of(run_id)

    def active_run(self, run_id: str) -> Run:
        return self.retention.active_run(run_id)

    def stage_of(self, run: Run, stage_id: str) -> Stage:
        return self.retention.stage_of(run, stage_id)


    # -- services: runs ----------------------------------------------------------------------
    async def create_run(self, body: models.CreateRun) -> dict[str, Any]:
        self.retention.retire()
        if body.run_id in self.runs:
            raise Conflict("run_exists", f"run {body.run_id!r} already exists", "run_id")
        run = Run(body.run_id, body.pipeline, time.time())
        self.runs[run.run_id] = run
        self.recorder.run_started(run.run_id, body.pipeline)
        log.info("run %s created", run.run_id, extra={"run": run.run_id})
        return {"run_id": run.run_id, "state": run.state}

    async def get_run(self, run_id: str) -> dict[str, Any]:
        if run_id not in self.runs:
            rec = self.records.ended_record(run_id)
            if rec is not None:   # ended and retired (or before a restart): its kept record
                return {**rec, "retired": True}
        return {**self.run_of(run_id).public(), "approvals": self.approvals.pending_for(run_id)}

    async def end_run(self, run_id: str, body: models.RunEnd) -> dict[str, Any]:
        if run_id not in self.runs:
            rec = self.records.ended_record(run_id)
            if rec is not None:   # ending an ended run answers its end again
                problems = list(rec.get("problems") or [])
                return {"ok": not problems, "outcome": rec.get("outcome"), "problems": problems}
        run = self.run_of(run_id)
        if run.state != RunState.ACTIVE:
            return {"ok": True, "outcome": run.outcome, "problems": run.problems}
        await self.teardown.end_run(run, RunOutcome(body.outcome))
        return {"ok": not run.problems, "outcome": run.outcome, "problems": run.problems}

    # -- services: stages --------------------------------------------------------------------
    async def request_stage(self, run_id: str, body: models.StageRequest) -> dict[str, Any]:
        run = self.active_run(run_id)
        existing = run.stages.get(body.stage_id)
        if existing is not None and existing.state != StageState.ENDED:
            if existing.attempt == body.attempt and existing.browser_req == body.browser:
                return self._stage_answer(run, existing)  # resume: the identical answer
            raise Conflict("stage_active", f"stage {body.stage_id!r} is active with attempt "
                           f"{existing.attempt}; end it first", "stage_id")
        if existing is not None and body.attempt <= existing.attempt:
            raise Conflict("attempt_used", f"attempt {body.attempt} of stage {body.stage_id!r} "
                           "has ended; use a new attempt number", "attempt")
        refused = self.site_policy.allow_domains_refusals(body.browser.allow_domains)
        if refused:  # every entry, each at its field; `field` names the first
            raise Forbidden(policy.REVIEWER_ONLY, "; ".join(
                f"browser.allow_domains.{i}: {msg}" for i, msg in refused),
                f"browser.allow_domains.{refused[0][0]}")
        headed = effective_headed(body.browser)
        if body.browser.profile is not None:
            self.stages.supply.profile_key(run, body.browser.profile)  # validate now (bad input is refused)
        stage = Stage(run_id, body.stage_id, body.attempt, body.browser, headed, replay_safe=body.replay_safe)
        run.stages[body.stage_id] = stage
        await self.stages.advance(run, stage)
        return self._stage_answer(run, stage)

    async def get_stage(self, run_id: str, stage_id: str, wait: float = 0.0) -> dict[str, Any]:
        run = self.run_of(run_id)
        stage = self.stage_of(run, stage_id)
        # long-poll (?wait=, at most api.MAX_WAIT): hold a waiting answer until it changes
        deadline = time.monotonic() + wait
        while stage.state in WAITING_STATES and run.state == RunState.ACTIVE and time.monotonic() < deadline:
            await asyncio.sleep(min(LONG_POLL_STEP, max(deadline - time.monotonic(), 0)))
        return self._stage_answer(run, stage)

    def _stage_answer(self, run: Run, stage: Stage) -> dict[str, Any]:
        answer = stage.answer()
        if answer.get("state") == "ready":
            answer = {**answer, "exec_prefix": self.exec_service.exec_prefix(run.run_id, stage.stage_id),
                      "approvals": [a for a in self.approvals.pending_for(run.run_id)
                                    if a["stage_id"] == stage.stage_id]}
        return answer

    async def stage_exec(self, run_id: str, stage_id: str) -> dict[str, Any]:
        run = self.run_of(run_id)
        return self.exec_service.exec_answer(run, self.stage_of(run, stage_id))

    async def cancel_stage(self, run_id: str, stage_id: str) -> dict[str, Any]:
        """DELETE of a waiting stage request: it leaves the profile's queue and ends cancelled."""
        run = self.run_of(run_id)
        return await self.stages.cancel_waiting(run, self.stage_of(run, stage_id))

    async def end_stage(self, run_id: str, stage_id: str, body: models.StageEnd) -> dict[str, Any]:
        run = self.run_of(run_id)
        stage = self.stage_of(run, stage_id)
        problems = await self.teardown.end_stage(run, stage, StageOutcome(body.outcome))
        return {"ok": not problems, "problems": problems}

    # -- services: login check, handoff, status, profiles (logins.py, inventory.py) ------------
    async def login_check(self, run_id: str, body: models.LoginCheckRequest) -> dict[str, Any]:
        return await self.logins.check(run_id, body)

    async def login_verify(self, run_id: str, body: models.LoginVerifyRequest) -> dict[str, Any]:
        return await self.logins.verify(run_id, body)

    async def handoff(self, run_id: str, body: models.HandoffRequest) -> dict[str, Any]:
        run = self.active_run(run_id)
        if live.wants_live_view(self.console, body):   # no screen here: a live view in the console
            return await live.open_live(self.console, run, body)
        return await self.logins.window_handoff(run, body)

    async def handoff_state(self, run_id: str, wait: float = 0.0) -> dict[str, Any]:
        """The run's newest handoff, a live view's or a window's; with `wait`, held until it is
        no longer open."""
        self.run_of(run_id)
        newest = live.newest(self.console, run_id)
        window = await self.logins.window_state(run_id, wait, newest.created if newest else None)
        return window if window is not None else await live.state(self.console, run_id, wait)

    async def status(self) -> dict[str, Any]:
        return await guard_status(self)

    async def console_link(self, body: models.ConsoleLinkRequest) -> dict[str, Any]:
        if self.console is None:
            raise Conflict("console_off", "the guard runs without its console (--no-console)", None)
        answer: dict[str, Any] = self.console.login_link(body.ttl_s, person=body.person)
        return answer
