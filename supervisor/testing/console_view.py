"""An in-memory ConsoleView (supervisor/console/view.py), to run the operator console without a
guard: tests of its pages and controls, and the live-view benchmark.

`runs` holds the daemon's own records (daemon/runs.py Run, Stage, Browser) that a test puts
there; the actions change them the plain way (a run or stage ends, a browser's restarts count
up) and are listed in `asked`, webhooks in `notified`. The audit chain is a FakeAuditSink unless
one is given; approvals are a real in-memory store. It has no browsers: `lease_browser` gives a
browser a test put in the run, else Unavailable."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sfguard import policy
from sfguard.supervisor import models
from sfguard.supervisor.console.view import AUDIT_ERRORS, ConsoleView
from sfguard.supervisor.daemon.runs import Browser, Run, RunOutcome, RunState, StageOutcome, StageState
from sfguard.supervisor.errors import NotFound, Unavailable
from sfguard.supervisor.protocols import LOCAL_SCOPE, AuditSink
from sfguard.supervisor.testing.fakes import FakeAuditSink
from sfguard.supervisor.writes.approvals import Approvals

log = logging.getLogger("sfguard.testing")


class FakeConsoleView:
    """ConsoleView in memory; `folder` holds its decision log and run records (nothing else)."""

    def __init__(self, folder: Path, *, audit: AuditSink | None = None, scope: str = LOCAL_SCOPE,
                 policy_path: Path | None = None):
        self.scope = scope
        self.home: Path | None = None
        self.runs: dict[str, Run] = {}
        self.decisions_log = folder / "decisions.log"
        self.policy_path = policy_path or policy.default_policy_path()
        self.site_policy = policy.load_policy(self.policy_path)
        self.audit: AuditSink = audit if audit is not None else FakeAuditSink()
        self.approvals = Approvals()
        self.records_root = folder / "records"
        self.records_backend: object = None
        self.recording_level = "full"
        self.profiles: list[dict[str, Any]] = []     # as GET /v1/profiles lists them
        self.login_result: dict[str, Any] = {"logged_in": True, "url": ""}
        self.asked: list[tuple[str, ...]] = []       # the actions, in order
        self.notified: list[tuple[str, dict[str, Any]]] = []
        self.allowed: dict[tuple[str, str], list[str]] = {}   # (run, browser) -> what its proxy lets through

    # -- what the console reads ----------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        return {"guard": {"pid": 0, "since": "", "scope": self.scope, "key_provider": "in memory"},
                "policy": {"file": str(self.policy_path), "mode": self.site_policy.mode, "state": "ok",
                           "error": None},
                "runs": [r.public() for r in self.runs.values()], "leases": []}

    async def list_profiles(self) -> dict[str, Any]:
        return {"profiles": list(self.profiles)}

    async def metrics(self) -> tuple[bytes, str]:
        return b"# no metrics in memory\n", "text/plain; version=0.0.4; charset=utf-8"

    def last_tab(self, run_id: str, stage_id: str) -> str | None:
        return None

    def stage_tabs(self, gate_key: str) -> set[str]:
        return set()

    # -- what it writes ------------------------------------------------------------------------
    async def record_audit(self, event: str, **fields: Any) -> None:
        self.audit.record(event, **fields)

    def record_audit_later(self, what: str, event: str, **fields: Any) -> None:
        try:
            self.audit.record(event, **fields)
        except AUDIT_ERRORS as exc:
            log.warning("%s could not be written: %s", what, type(exc).__name__)

    def notify(self, event: str, payload: dict[str, Any]) -> None:
        self.notified.append((event, payload))

    # -- what it may do ------------------------------------------------------------------------
    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise NotFound("run_not_found", f"no run {run_id!r} in this fake", "run_id")
        return run

    async def end_run(self, run_id: str, body: models.RunEnd) -> dict[str, Any]:
        self.asked.append(("end_run", run_id, body.outcome))
        run = self._run(run_id)
        if run.state == RunState.ACTIVE:
            run.state, run.outcome = RunState.ENDED, RunOutcome(body.outcome)
        return {"ok": True, "outcome": run.outcome, "problems": []}

    async def cancel_stage(self, run_id: str, stage_id: str) -> dict[str, Any]:
        self.asked.append(("cancel_stage", run_id, stage_id))
        return self._end(run_id, stage_id, StageOutcome.CANCELLED)

    async def end_stage(self, run_id: str, stage_id: str, body: models.StageEnd) -> dict[str, Any]:
        self.asked.append(("end_stage", run_id, stage_id, body.outcome))
        return self._end(run_id, stage_id, StageOutcome(body.outcome))

    def _end(self, run_id: str, stage_id: str, outcome: StageOutcome) -> dict[str, Any]:
        stage = self._run(run_id).stages.get(stage_id)
        if stage is None:
            raise NotFound("stage_not_found", f"no stage {stage_id!r} in run {run_id!r}", "stage_id")
        stage.state, stage.outcome = StageState.ENDED, outcome
        return {"ok": True, "problems": []}

    async def restart_browser(self, run_id: str, browser_key: str, by: str) -> None:
        self.asked.append(("restart_browser", run_id, browser_key, by))
        browser = self._run(run_id).browsers.get(browser_key)
        if browser is not None and not browser.closing:
            browser.restarts += 1

    async def login_check(self, run_id: str, body: models.LoginCheckRequest) -> dict[str, Any]:
        self.asked.append(("login_check", run_id, body.profile))
        return dict(self.login_result)

    async def lease_browser(self, run_id: str, profile: str) -> Browser:
        browser = self._run(run_id).browsers.get(profile)
        if browser is None:
            raise Unavailable("browser_failed", "the in-memory console view has no browser to start", None)
        return browser

    async def allow_browser(self, run_id: str, browser_key: str, extra: Sequence[str] = ()) -> list[str]:
        run = self.runs.get(run_id)
        browser = run.browsers.get(browser_key) if run is not None else None
        stages = [run.stages[s] for s in browser.stages if s in run.stages] if run and browser else []
        allow = sorted({a for st in stages for a in st.browser_req.allow_domains} | set(extra))
        if browser is not None:
            self.allowed[(run_id, browser_key)] = allow
        return allow


if TYPE_CHECKING:
    _checked: type[ConsoleView] = FakeConsoleView     # mypy: the fake keeps to the protocol
