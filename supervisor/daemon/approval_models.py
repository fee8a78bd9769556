"""The control API's models of write approvals (routes in supervisor/daemon/api.py, the store in
supervisor/writes/approvals.py)."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from sfguard.supervisor.models import Answer, Strict

APPROVAL_ID = r"^ap_[0-9a-f]{20}$"
APPROVAL_ID_RE = re.compile(APPROVAL_ID)
ApprovalState = Literal["pending", "approved", "denied", "timed_out", "cancelled"]


class Png:
    """An answer that is a PNG picture (`image/png`), not JSON: the route table's marker."""
    media_type = "image/png"


class ApprovalView(Answer):
    id: str = Field(pattern=APPROVAL_ID)
    state: ApprovalState
    run_id: str
    stage_id: str | None
    attempt: int | None
    profile: str
    method: str
    url: str = Field(description="the whole address, shown to the approver (logs leave out query values)")
    host: str
    path: str
    form: list[list[str]] | None = Field(description="[name, value] of a form body; password-like values masked")
    body_size: int
    body_type: str | None
    tab_url: str | None
    why: str = Field(description="gate (the write mode) or replay_unsafe_retry (an earlier attempt wrote)")
    earlier: list[dict[str, Any]] = Field(description="for a retry: what earlier attempts sent (method, url, at)")
    screenshot: bool
    created: str
    expires: str = Field(description="when it is denied by itself (timed_out)")
    decided_at: str | None
    decided_by: str | None
    reason: str


class ApprovalsAnswer(Answer):
    approvals: list[ApprovalView]


class ApprovalDecision(Strict):
    decision: Literal["approve", "deny"]
    reason: str = Field("", max_length=500, description="shown with the approval; never in the audit chain")
