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
    url: str = Field(description=(
        "the whole address, shown to the approver while pending (a password in its user info "
        "masked); a decided approval read back after a restart shows it with query values hidden"))
    host: str
    port: int | None = Field(description="the port the write goes to (default ports explicit)")
    path: str
    form: list[list[str]] | None = Field(description=(
        "[name, value] of a form body; secret values masked (type=password inputs, secret field "
        "names, card numbers)"))
    headers: list[list[str]] = Field(description=(
        "[name, value] of the request headers that change what it means (method overrides, "
        "content type, Origin, any a page set); secret values masked; the browser's own left out"))
    body_text: str | None = Field(description="a JSON or text body as sent (secret values masked), at most 8 KiB")
    body_size: int
    body_type: str | None
    tab_url: str | None
    why: str = Field(description=(
        "why it is held: stage_mode (the stage's browser.writes), site_floor (a sites.yaml floor: "
        "see rule), site_write_get (a GET the site policy names a write), replay_unsafe_retry (an "
        "earlier attempt of this replay-unsafe stage wrote)"))
    rule: str | None = Field(description="the sites.yaml rule that decided (file:line writes PATTERNS), if one did")
    earlier: list[dict[str, Any]] = Field(description="for a retry: what earlier attempts sent (method, url, at)")
    screenshot: bool
    created: str
    expires: str = Field(description="when it is denied by itself (timed_out)")
    decided_at: str | None
    decided_by: str | None = Field(description=(
        "who decided: user:NAME (the OS user of a control-socket caller, e.g. `sfguard approvals`), "
        "api-token (the TCP listener's token), console (a console session), timeout, guard"))
    reason: str


class ApprovalsAnswer(Answer):
    approvals: list[ApprovalView]


class ApprovalDecision(Strict):
    decision: Literal["approve", "deny"]
    reason: str = Field("", max_length=500, pattern=r"^[^\x00-\x1f\x7f]*$",
                        description="shown with the approval and kept in the audit chain (one line)")
