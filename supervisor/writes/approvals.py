"""Held writes waiting for a person: the one store the control API, the CLI and the console
decide from (the local `WriteApprover`, supervisor/writes/held.py).

An approval moves pending -> approved | denied | timed_out | cancelled, once
(supervisor/states.py `APPROVAL_TRANSITIONS`); a
decided one answers 409 when decided again. Identical writes pending at once (same run, stage
and fingerprint) are one approval: every waiter gets its outcome. Pending ones live only while
the guard runs (the held request lives in the browser); decided ones are kept for listing, the
newest `KEEP_DECIDED` (without their screenshot, which is kept while pending only).
Password-like form fields are masked whenever an approval is shown
(`SECRET_FIELD`); no form value or query value is ever logged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sfguard.errors import SfguardError
from sfguard.supervisor.states import APPROVAL_TRANSITIONS, ApprovalState
from sfguard.supervisor.writes.held import HeldWrite, WriteOutcome

log = logging.getLogger("sfguard.writes")

#: a form field whose value is never shown (its name matches)
SECRET_FIELD = re.compile(r"pass|pwd|secret|token|otp|totp|code|pin|cvv|cvc|card|ssn|key|auth", re.I)
MASK = "********"
KEEP_DECIDED = 500
#: the decision log's verdict for each end of an approval
VERDICTS = {ApprovalState.APPROVED: "write_approved", ApprovalState.DENIED: "write_denied",
            ApprovalState.TIMED_OUT: "write_timed_out", ApprovalState.CANCELLED: "write_cancelled"}


class ApprovalNotFound(SfguardError):
    pass


class ApprovalDecided(SfguardError):
    pass


@dataclass
class Approval:
    id: str
    held: HeldWrite
    created: float
    expires: float
    state: ApprovalState = ApprovalState.PENDING
    decided_at: float | None = None
    by: str | None = None
    reason: str = ""
    outcome: asyncio.Future[WriteOutcome] | None = field(default=None, repr=False)

    def move(self, to: ApprovalState) -> None:
        if to not in APPROVAL_TRANSITIONS[self.state]:
            raise ApprovalDecided(f"approval {self.id} is {self.state}")
        self.state = to

    def public(self) -> dict[str, Any]:
        h = self.held
        form = [[k, MASK if SECRET_FIELD.search(k) else v] for k, v in h.form] if h.form is not None else None
        return {"id": self.id, "state": self.state, "run_id": h.run_id, "stage_id": h.stage_id,
                "attempt": h.attempt, "profile": h.profile, "method": h.method, "url": h.url,
                "host": h.host, "path": h.path, "form": form, "body_size": h.body_size,
                "body_type": h.body_type, "tab_url": h.tab_url, "why": h.why,
                "earlier": [dict(e) for e in h.earlier], "screenshot": h.screenshot is not None,
                "created": _iso(self.created), "expires": _iso(self.expires),
                "decided_at": _iso(self.decided_at) if self.decided_at else None,
                "decided_by": self.by, "reason": self.reason}


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _shown_url(url: str) -> str:
    """For logs: scheme, host and path, never the query's values."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.netloc}{p.path}" + ("?..." if p.query else "")


class Approvals:
    """The store. `audit(event, fields)` records held, approved, denied, timed out, cancelled."""

    def __init__(self, audit: Callable[[str, dict[str, Any]], None] | None = None, keep: int = KEEP_DECIDED,
                 notify: Callable[[str, dict[str, Any]], None] | None = None):
        self.audit = audit
        #: the guard's webhooks (supervisor/daemon/notify.py): every event audited is sent too
        self.notify = notify
        self.keep = keep
        self.items: OrderedDict[str, Approval] = OrderedDict()
        self.changed = asyncio.Event()
        #: called on every change (the console's live pages)
        self.listeners: list[Callable[[], None]] = []

    # -- WriteApprover ---------------------------------------------------------------------
    async def decide(self, held: HeldWrite, timeout: float) -> WriteOutcome:
        ap = next((a for a in self.items.values() if a.state == ApprovalState.PENDING and a.held.run_id == held.run_id
                   and a.held.stage_id == held.stage_id and a.held.fingerprint == held.fingerprint), None)
        if ap is None:
            now = time.time()
            ap = Approval("ap_" + secrets.token_hex(10), held, now, now + timeout,
                          outcome=asyncio.get_running_loop().create_future())
            self.items[ap.id] = ap
            self._record("write_held", ap)
            log.info("write held for a person: %s %s %s (run %s, stage %s)", ap.id, held.method,
                     _shown_url(held.url), held.run_id, held.stage_id)
            self._changed()
        assert ap.outcome is not None
        try:
            return await asyncio.wait_for(asyncio.shield(ap.outcome), max(0.0, ap.expires - time.time()))
        except TimeoutError:
            if ap.state == ApprovalState.PENDING:
                self._finish(ap, ApprovalState.TIMED_OUT, WriteOutcome(False, "timeout", "no decision in time"))
            return ap.outcome.result()

    # -- a person's answer -----------------------------------------------------------------
    def answer(self, approval_id: str, approve: bool, by: str, reason: str = "") -> dict[str, Any]:
        ap = self.get(approval_id)
        if ap.state != ApprovalState.PENDING:
            raise ApprovalDecided(f"approval {approval_id} is already {ap.state}")
        self._finish(ap, ApprovalState.APPROVED if approve else ApprovalState.DENIED, WriteOutcome(approve, by, reason))
        return ap.public()

    def cancel(self, run_id: str, stage_id: str | None = None, reason: str = "the stage ended") -> int:
        """Deny what is pending for a run (or one of its stages) that ends."""
        n = 0
        for ap in list(self.items.values()):
            if ap.state == ApprovalState.PENDING and ap.held.run_id == run_id and stage_id in (None, ap.held.stage_id):
                self._finish(ap, ApprovalState.CANCELLED, WriteOutcome(False, "guard", reason))
                n += 1
        return n

    # -- reading ---------------------------------------------------------------------------
    def get(self, approval_id: str) -> Approval:
        ap = self.items.get(approval_id)
        if ap is None:
            raise ApprovalNotFound(f"no approval {approval_id}")
        return ap

    def listing(self, run_id: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        return [a.public() for a in self.items.values()
                if (run_id is None or a.held.run_id == run_id) and (state is None or a.state == state)]

    def pending_for(self, run_id: str) -> list[dict[str, Any]]:
        return [{"id": a.id, "stage_id": a.held.stage_id, "method": a.held.method, "host": a.held.host,
                 "path": a.held.path} for a in self.items.values()
                if a.state == ApprovalState.PENDING and a.held.run_id == run_id]

    async def wait_changed(self, seconds: float) -> None:
        """Return when the list changes or after `seconds` (a long-poll)."""
        if seconds <= 0:
            return
        event = self.changed
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass

    # -- inside ----------------------------------------------------------------------------
    def _finish(self, ap: Approval, state: ApprovalState, outcome: WriteOutcome) -> None:
        ap.move(state)
        ap.decided_at, ap.by, ap.reason = time.time(), outcome.by, outcome.reason
        if ap.held.screenshot is not None:   # kept while pending only (decided ones are many)
            ap.held = dataclasses.replace(ap.held, screenshot=None)
        if ap.outcome is not None and not ap.outcome.done():
            ap.outcome.set_result(outcome)
        self._record(VERDICTS[state], ap)
        log.info("write %s %s by %s", ap.id, state, outcome.by)
        decided = [k for k, a in self.items.items() if a.state != ApprovalState.PENDING]
        for k in decided[:max(0, len(decided) - self.keep)]:
            del self.items[k]
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
        for listener in list(self.listeners):
            try:
                listener()
            except Exception as exc:   # a page that cannot refresh never stops a decision
                log.warning("an approvals listener failed: %s", type(exc).__name__)

    def _record(self, event: str, ap: Approval) -> None:
        if self.audit is None:
            return
        h = ap.held
        fields: dict[str, Any] = {"approval": ap.id, "run": h.run_id, "stage": h.stage_id, "attempt": h.attempt,
                                  "profile": h.profile or None, "method": h.method.lower(), "host": h.host,
                                  "why": h.why, "by": ap.by}
        try:
            self.audit(event, {k: v for k, v in fields.items() if v is not None})
        except Exception as exc:   # the audit chain's own failure is logged by it; the write still waits
            log.warning("could not audit %s of %s: %s", event, ap.id, exc)
        if self.notify is not None:   # what a person needs, never a form value or the query
            try:
                self.notify(event, {k: v for k, v in ap.public().items() if k not in ("form", "url", "earlier")})
            except Exception as exc:   # a notification never stops the write's decision
                log.warning("could not notify %s of %s: %s", event, ap.id, exc)
