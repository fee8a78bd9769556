"""What the operator console reaches of the guard: `ConsoleView` (docs/decisions/0036-console-view.md).

The console never holds the Guard. The daemon builds it a view of the guard's parts
(supervisor/daemon/console_view.py); the in-memory fake is supervisor/testing/console_view.py.
Runs, stages and browsers are read through the small protocols below (the daemon's records,
daemon/runs.py, fit them as they are); everything the console changes goes through an action of
the view, each the same call the control API makes.

The Protocols live here, not in supervisor/protocols.py, for the reason BrowserHost and Handoff
live next to their value types: they name types of rooms above `protocols` (a browser's Anchor,
the approvals store), which that module may not import (tests/test_layout.py).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sfguard.errors import SfguardError
from sfguard.policy import SitePolicy
from sfguard.supervisor import models
from sfguard.supervisor.browsers.host import Anchor
from sfguard.supervisor.protocols import AuditSink, ProfileKey
from sfguard.supervisor.states import RunOutcome, RunState, StageState
from sfguard.supervisor.writes.approvals import Approvals

#: what writing an audit record can raise: I/O (a full disk, a lost file), the chain's and the
#: stores' own errors (AuditFieldError, KeyMissing, a shared store away as Unavailable), and
#: RuntimeError from the store calls' pool once it is shut down (the guard is stopping)
AUDIT_ERRORS: tuple[type[Exception], ...] = (OSError, SfguardError, RuntimeError)


class BrowserView(Protocol):
    """A run's browser as the console reads it."""

    @property
    def key(self) -> str: ...
    @property
    def profile(self) -> ProfileKey | None: ...
    @property
    def anchor(self) -> Anchor | None: ...
    @property
    def restarts(self) -> int: ...
    @property
    def closing(self) -> bool: ...


class StageView(Protocol):
    """A run's stage as the console reads it."""

    @property
    def stage_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def state(self) -> StageState: ...
    @property
    def browser_req(self) -> models.BrowserField: ...
    @property
    def browser_key(self) -> str | None: ...
    @property
    def gate_key(self) -> str | None: ...


class RunView(Protocol):
    """A run as the console reads it: its state, stages and browsers."""

    @property
    def run_id(self) -> str: ...
    @property
    def state(self) -> RunState: ...
    @property
    def outcome(self) -> RunOutcome | None: ...
    @property
    def stages(self) -> Mapping[str, StageView]: ...
    @property
    def browsers(self) -> Mapping[str, BrowserView]: ...


@runtime_checkable
class ConsoleView(Protocol):
    """What the console reads of the guard, and the few things it may do."""

    # -- what it reads -------------------------------------------------------------------------
    @property
    def scope(self) -> str:
        """The guard's scope (its audit records name it)."""
    @property
    def home(self) -> Path | None:
        """The guard home, where the console remembers its port (None: nowhere)."""
    @property
    def runs(self) -> Mapping[str, RunView]:
        """The runs the guard holds (running, and ended ones not yet retired), by id."""
    @property
    def decisions_log(self) -> Path:
        """The decision log (its newest rotation beside it, `.1`)."""
    @property
    def policy_path(self) -> Path:
        """The live site policy's file (for a copy-ready `sfguard policy explain`)."""
    @property
    def site_policy(self) -> SitePolicy:
        """The site policy in force (the last good one)."""
    @property
    def audit(self) -> AuditSink:
        """The audit chain: its records, its check, and records written on the event loop."""
    @property
    def approvals(self) -> Approvals:
        """The held writes a person decides (listing, get, answer) and their listeners."""
    @property
    def records_root(self) -> Path:
        """The folder of the run records."""
    @property
    def records_backend(self) -> object:
        """The shared store's backend for a fleet's run records (None: this home's only)."""
    @property
    def recording_level(self) -> str:
        """What the run records keep (`sfguard start --record`)."""

    async def status(self) -> dict[str, Any]:
        """The guard's status, as GET /v1/status answers it."""
    async def list_profiles(self) -> dict[str, Any]:
        """The profiles and their leases, as GET /v1/profiles answers them."""
    async def metrics(self) -> tuple[bytes, str]:
        """The guard's Prometheus metrics and their content type, as GET /metrics serves them."""
    def last_tab(self, run_id: str, stage_id: str) -> str | None:
        """The tab a stage last sent a command to (its run record's), if any."""
    def stage_tabs(self, gate_key: str) -> set[str]:
        """A stage's tabs (target ids) right now, as the CDP gate knows them."""

    # -- what it writes ------------------------------------------------------------------------
    async def record_audit(self, event: str, **fields: Any) -> None:
        """An audit record written off the event loop, before the caller goes on; raises one of
        AUDIT_ERRORS when the chain could not take it."""
    def record_audit_later(self, what: str, event: str, **fields: Any) -> None:
        """An audit record handed to the store calls; `what` names it in the log if it is lost.
        Never raises."""
    def notify(self, event: str, payload: dict[str, Any]) -> None:
        """Tell the guard's webhooks (never anything that signs a person in)."""

    # -- what it may do (the control API's own calls) ------------------------------------------
    async def end_run(self, run_id: str, body: models.RunEnd) -> dict[str, Any]:
        """End a run, as DELETE /v1/runs/RUN does."""
    async def cancel_stage(self, run_id: str, stage_id: str) -> dict[str, Any]:
        """Take a waiting stage out of its profile's queue; it ends cancelled."""
    async def end_stage(self, run_id: str, stage_id: str, body: models.StageEnd) -> dict[str, Any]:
        """End a stage, as its runner does."""
    async def restart_browser(self, run_id: str, browser_key: str, by: str) -> None:
        """Restart a run's browser for a person (`by`); nothing when it is gone or closing."""
    async def login_check(self, run_id: str, body: models.LoginCheckRequest) -> dict[str, Any]:
        """The guard's own login check of a profile in a run (after a live view's Done)."""
    async def lease_browser(self, run_id: str, profile: str) -> BrowserView:
        """The run's browser on `profile`, leased now if it must be (headless is fine), for a
        live view; a GuardError when it cannot be had (Conflict: another run holds it)."""
    async def allow_browser(self, run_id: str, browser_key: str, extra: Sequence[str] = ()) -> list[str]:
        """What a run's browser may reach through the run's proxy: what its stages allow, plus
        `extra`; set on the proxy when it still serves that browser. The list, sorted."""
