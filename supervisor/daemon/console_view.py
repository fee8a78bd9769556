"""The console's view of the guard (supervisor/console/view.py ConsoleView), made of the guard's
parts: the console reads runs, decisions, profiles, the audit chain, approvals and run records
through it, and acts only through the Guard's own service methods (docs/decisions/0036-console-view.md)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sfguard.policy import PolicyWatcher, SitePolicy
from sfguard.supervisor import models
from sfguard.supervisor.console.view import ConsoleView
from sfguard.supervisor.daemon.runs import Browser, Run
from sfguard.supervisor.protocols import AuditSink
from sfguard.supervisor.writes.approvals import Approvals

if TYPE_CHECKING:
    from sfguard.supervisor.daemon.browser_supply import BrowserSupply
    from sfguard.supervisor.daemon.guard import Guard
    from sfguard.supervisor.daemon.inventory import Inventory
    from sfguard.supervisor.daemon.metrics import GuardMetrics
    from sfguard.supervisor.daemon.watchdog import Watchdog
    from sfguard.supervisor.gate.cdp_gate import CdpGate
    from sfguard.supervisor.profiles.store_ops import StoreCalls
    from sfguard.supervisor.record.recorder import Recorder

Answer = Callable[..., Awaitable[dict[str, Any]]]


class GuardConsoleView:
    """A ConsoleView over one guard's parts and its service methods (`status`, `end_run`,
    `cancel_stage`, `end_stage`, `login_check`, `run_of`), never the Guard itself."""

    def __init__(self, *, scope: str, home: Path, runs: Mapping[str, Run], decisions_log: Path,
                 policy_path: Path, policy_watch: PolicyWatcher, audit: AuditSink, approvals: Approvals,
                 recorder: Recorder, gate: CdpGate, supply: BrowserSupply, watchdog: Watchdog, inventory: Inventory,
                 calls: StoreCalls, metrics: GuardMetrics, metrics_snapshot: Callable[[], dict[str, Any]],
                 notify: Callable[[str, dict[str, Any]], None], status: Callable[[], Awaitable[dict[str, Any]]],
                 end_run: Answer, cancel_stage: Answer, end_stage: Answer, login_check: Answer,
                 run_of: Callable[[str], Run]):
        self.scope, self.home, self.runs = scope, home, runs
        self.decisions_log, self.policy_path = decisions_log, policy_path
        self.audit, self.approvals = audit, approvals
        self._policy_watch, self._recorder, self._gate = policy_watch, recorder, gate
        self._supply, self._watchdog, self._inventory, self._calls = supply, watchdog, inventory, calls
        self._metrics, self._metrics_snapshot, self._notify = metrics, metrics_snapshot, notify
        self._status, self._end_run, self._cancel_stage = status, end_run, cancel_stage
        self._end_stage, self._login_check, self._run_of = end_stage, login_check, run_of

    # -- what the console reads ----------------------------------------------------------------
    @property
    def site_policy(self) -> SitePolicy:
        return self._policy_watch.policy

    @property
    def records_root(self) -> Path:
        return self._recorder.root

    @property
    def records_backend(self) -> object:
        return self._recorder.backend

    @property
    def recording_level(self) -> str:
        return self._recorder.settings.level

    async def status(self) -> dict[str, Any]:
        return await self._status()

    async def list_profiles(self) -> dict[str, Any]:
        return await self._inventory.list_profiles()

    async def metrics(self) -> tuple[bytes, str]:
        body = await asyncio.to_thread(self._metrics.render, self._metrics_snapshot())
        return body, self._metrics.content_type

    def last_tab(self, run_id: str, stage_id: str) -> str | None:
        rec = self._recorder.runs.get(run_id)
        st = rec.stages.get(stage_id) if rec is not None else None
        return st.last_tab if st is not None else None

    def stage_tabs(self, gate_key: str) -> set[str]:
        return self._gate.stage_targets(gate_key)

    # -- what it writes ------------------------------------------------------------------------
    async def record_audit(self, event: str, **fields: Any) -> None:
        await self._inventory.store_call(self.audit.record, event, **fields)

    def record_audit_later(self, what: str, event: str, **fields: Any) -> None:
        self._calls.submit(what, self.audit.record, event, **fields)

    def notify(self, event: str, payload: dict[str, Any]) -> None:
        self._notify(event, payload)

    # -- what it may do ------------------------------------------------------------------------
    async def end_run(self, run_id: str, body: models.RunEnd) -> dict[str, Any]:
        return await self._end_run(run_id, body)

    async def cancel_stage(self, run_id: str, stage_id: str) -> dict[str, Any]:
        return await self._cancel_stage(run_id, stage_id)

    async def end_stage(self, run_id: str, stage_id: str, body: models.StageEnd) -> dict[str, Any]:
        return await self._end_stage(run_id, stage_id, body)

    async def login_check(self, run_id: str, body: models.LoginCheckRequest) -> dict[str, Any]:
        return await self._login_check(run_id, body)

    async def restart_browser(self, run_id: str, browser_key: str, by: str) -> None:
        run, browser = self._browser(run_id, browser_key)
        if run is not None and browser is not None:
            await self._watchdog.restart_browser(run, browser, by=by)

    async def lease_browser(self, run_id: str, profile: str) -> Browser:
        return await self._supply.leased_browser(self._run_of(run_id), profile, headed=False)

    async def allow_browser(self, run_id: str, browser_key: str, extra: Sequence[str] = ()) -> list[str]:
        run, browser = self._browser(run_id, browser_key)
        if run is None or browser is None:
            return sorted(set(extra))
        allow = sorted(set(run.browser_allow(browser)) | set(extra))
        if run.proxy is not None and browser.client in run.proxy.clients:
            await run.proxy.set_allow(browser.client, allow)
        return allow

    def _browser(self, run_id: str, browser_key: str) -> tuple[Run | None, Browser | None]:
        run = self.runs.get(run_id)
        return run, (run.browsers.get(browser_key) if run is not None else None)


def console_view(guard: Guard) -> ConsoleView:
    """The view `sfguard start` gives the console it attaches to `guard` (mypy checks here that
    it is a ConsoleView)."""
    return GuardConsoleView(
        scope=guard.scope, home=guard.home, runs=guard.runs, decisions_log=guard.decision_log,
        policy_path=guard.policy_path, policy_watch=guard.policy_watch, audit=guard.audit,
        approvals=guard.approvals, recorder=guard.recorder, gate=guard.gate, supply=guard.stages.supply,
        watchdog=guard.watchdog, inventory=guard.inventory, calls=guard.calls, metrics=guard.metrics,
        metrics_snapshot=lambda: guard.metrics.snapshot(guard), notify=guard.notify, status=guard.status,
        end_run=guard.end_run, cancel_stage=guard.cancel_stage, end_stage=guard.end_stage,
        login_check=guard.login_check, run_of=guard.run_of)
