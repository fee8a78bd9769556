"""The models of `GET /v1/status` beyond the runs (supervisor/models.py has those and the guard,
policy, lease, console and disk parts): what waits for a person, the audit chain's last check,
the webhooks, the health probes' answer, and the whole status answer."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sfguard.supervisor.models import (
    Answer,
    ConsoleInfo,
    DiskState,
    GuardInfo,
    LeaseInfo,
    PolicyState,
    RunInfo,
)


class PendingApprovalInfo(Answer):
    """A write held for a person, as status shows it: never a form value or a query."""
    id: str
    run: str
    stage: str | None
    method: str
    host: str
    path: str
    since: str
    age_s: float


class WaitingHandoffInfo(Answer):
    kind: Literal["live_view", "local_window"]
    run: str
    stage: str | None
    profile: str
    site: str
    age_s: float


class AuditState(Answer):
    ok: bool | None = Field(description="the chain verified at the last check (null: it could not be read)")
    checked: str | None
    problem: str | None
    interval_s: float = Field(description="how often the running guard checks it (--audit-check)")


class WebhookState(Answer):
    url: str = Field(description="scheme, host and port only (the path of a chat webhook is its token)")
    events: list[str]
    delivered: int
    failed: int = Field(description="deliveries given up after retrying")
    queued: int
    last: dict[str, Any] | None = Field(description="event, result (delivered, failed), at, attempts, error")


class NotificationsState(Answer):
    file: str | None
    webhooks: list[WebhookState]


class HealthAnswer(Answer):
    status: Literal["alive", "ready"]


class StatusAnswer(Answer):
    guard: GuardInfo
    policy: PolicyState
    runs: list[RunInfo] = Field(description="the runs not yet ended, then the latest ended ones")
    runs_summary: dict[str, int | float] = Field(default_factory=dict, description=(
        "active, ended_shown, ended_in_memory, retired, keep_ended_runs, keep_ended_hours"))
    leases: list[LeaseInfo]
    console: ConsoleInfo | None = None
    disk: list[DiskState] = Field(default_factory=list)
    pending: list[str] = Field(default_factory=list, description=(
        "what a full disk put off (a reseal, a lease release), done when space returns"))
    approvals: list[PendingApprovalInfo] = Field(default_factory=list, description=(
        "writes held for a person's approval, oldest first"))
    handoffs: list[WaitingHandoffInfo] = Field(default_factory=list, description=(
        "login handoffs waiting for a person, oldest first"))
    audit: AuditState | None = None
    notifications: NotificationsState | None = Field(default=None, description=(
        "the webhooks of <home>/notify.yaml and how their deliveries went; null without one"))
