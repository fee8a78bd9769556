"""The approvals routes of the control API (`GET /v1/approvals`, `GET /v1/approvals/{id}`,
`POST /v1/approvals/{id}`): the store's answers in the API's words and errors."""
from __future__ import annotations

import re
import time
from typing import Any

from sfguard.supervisor.daemon.approval_models import ApprovalDecision
from sfguard.supervisor.daemon.callers import CALLER
from sfguard.supervisor.errors import BadRequest, Conflict, NotFound
from sfguard.supervisor.models import RUN_ID
from sfguard.supervisor.states import ApprovalState
from sfguard.supervisor.writes.approvals import ApprovalDecided, ApprovalNotFound, Approvals

RUN_ID_RE = re.compile(RUN_ID)


class ApprovalsApi:
    def __init__(self, approvals: Approvals):
        self.approvals = approvals

    async def list_approvals(self, run: str | None = None, state: str | None = None,
                             wait: float = 0.0) -> dict[str, Any]:
        """With `wait`: answer when the pending list changes, or after `wait` seconds."""
        if run is not None and not RUN_ID_RE.fullmatch(run):
            raise BadRequest("invalid_request", "run: not a valid run id", "run")
        if state is not None and state not in set(ApprovalState):
            raise BadRequest("invalid_request", f"state: one of {', '.join(ApprovalState)}", "state")
        before = self.approvals.listing(run, ApprovalState.PENDING)
        deadline = time.monotonic() + wait
        while wait > 0 and self.approvals.listing(run, ApprovalState.PENDING) == before and time.monotonic() < deadline:
            await self.approvals.wait_changed(deadline - time.monotonic())
        return {"approvals": self.approvals.listing(run, state)}

    def _get(self, approval_id: str):
        try:
            return self.approvals.get(approval_id)
        except ApprovalNotFound:
            raise NotFound("approval_not_found", f"no approval {approval_id}", "approval_id") from None

    async def get_approval(self, approval_id: str) -> dict[str, Any]:
        return self._get(approval_id).public()

    async def approval_screenshot(self, approval_id: str) -> bytes:
        """The tab of a pending write as it was when the write was held (PNG)."""
        png = self._get(approval_id).held.screenshot
        if png is None:
            raise NotFound("screenshot_not_found", f"approval {approval_id} has no screenshot (the tab "
                           "could not be captured, or the approval was decided: pictures are kept "
                           "while pending only)", "approval_id")
        return png

    async def decide_approval(self, approval_id: str, body: ApprovalDecision) -> dict[str, Any]:
        self._get(approval_id)
        try:
            return self.approvals.answer(approval_id, body.decision == "approve", CALLER.get(), body.reason)
        except ApprovalDecided as exc:
            raise Conflict("approval_decided", str(exc), "approval_id") from None
