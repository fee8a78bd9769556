"""Held writes waiting for a person: the one store the control API, the CLI and the console
decide from (the local `WriteApprover`, supervisor/writes/held.py).

An approval moves pending -> approved | denied | timed_out | cancelled, once
(supervisor/states.py `APPROVAL_TRANSITIONS`); a decided one answers 409 when decided again.
Each held request is its own approval: approving releases that one request, never several.
What is shown is what is sent (method, whole URL, the headers that change its meaning, the
body) with secrets masked (supervisor/writes/masking.py). A decided approval is a record: it is
appended to `<home>/approvals/decided.jsonl` (query values hidden) and read back at the next
start for the retention period; approvals still pending when the guard stops are recorded as
cancelled. No form value or query value is ever logged or audited.
Why: docs/decisions/0010-approvals-are-records.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sfguard.errors import SfguardError
from sfguard.supervisor.home import FILE_MODE, atomic_file, private_dir
from sfguard.supervisor.states import APPROVAL_TRANSITIONS, ApprovalState
from sfguard.supervisor.writes.held import HeldWrite, WriteOutcome, hidden_query, new_approval_id
from sfguard.supervisor.writes.masking import MASK, mask_form

log = logging.getLogger("sfguard.writes")

#: decided approvals kept in memory (the newest); older ones stay in the record file
KEEP_DECIDED = 2000
#: the decided record's default retention (the decision log's, 14 days, unless given)
KEEP_SECONDS = 14 * 86400.0
RECORD_FILE = "decided.jsonl"
#: the decision log's verdict for each end of an approval
VERDICTS = {ApprovalState.APPROVED: "write_approved", ApprovalState.DENIED: "write_denied",
            ApprovalState.TIMED_OUT: "write_timed_out", ApprovalState.CANCELLED: "write_cancelled"}


class ApprovalNotFound(SfguardError):
    pass


class ApprovalDecided(SfguardError):
    pass


def shown_url(url: str) -> str:
    """For the approver: the whole address, but a password in its user info masked."""
    try:
        p = urlsplit(url)
        if p.password is None:
            return url
        return url.replace(f":{p.password}@", f":{MASK}@", 1)
    except ValueError:
        return url


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
    #: a decided approval read back from the record file: its shown form, as recorded
    recorded: dict[str, Any] | None = field(default=None, repr=False)

    def move(self, to: ApprovalState) -> None:
        if to not in APPROVAL_TRANSITIONS[self.state]:
            raise ApprovalDecided(f"approval {self.id} is {self.state}")
        self.state = to

    def public(self) -> dict[str, Any]:
        if self.recorded is not None:
            return dict(self.recorded)
        h = self.held
        form = mask_form(h.form, h.password_fields) if h.form is not None else None
        return {"id": self.id, "state": self.state, "run_id": h.run_id, "stage_id": h.stage_id,
                "attempt": h.attempt, "profile": h.profile, "method": h.method, "url": shown_url(h.url),
                "host": h.host, "port": h.port, "path": h.path, "form": form,
                "headers": [list(x) for x in h.headers], "body_text": h.body_text, "body_size": h.body_size,
                "body_type": h.body_type, "tab_url": shown_url(h.tab_url) if h.tab_url else None, "why": h.why,
                "rule": h.rule,
                "earlier": [dict(e) for e in h.earlier], "screenshot": h.screenshot is not None,
                "created": _iso(self.created), "expires": _iso(self.expires),
                "decided_at": _iso(self.decided_at) if self.decided_at else None,
                "decided_by": self.by, "reason": self.reason}

    def record(self) -> dict[str, Any]:
        """The lasting record of a decided approval: what was shown, query values hidden."""
        rec = self.public()
        rec["url"] = hidden_query(self.held.url)
        rec["tab_url"] = hidden_query(self.held.tab_url) if self.held.tab_url else None
        rec["earlier"] = [{**e, "url": hidden_query(str(e.get("url") or ""))} for e in rec["earlier"]]
        rec["screenshot"] = False
        rec["at"] = self.decided_at
        return rec


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _tell(what: str, hook: Callable[..., object], *args: Any) -> None:
    """Call a hook of another part (the console's pages, the run record, the audit chain, the
    webhooks) about an approval: what it raises is logged, never let into the decision."""
    try:
        hook(*args)
    except Exception as exc:   # boundary: another part's failure never stops (or undoes) a decision
        log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)


class Approvals:
    """The store. `audit(event, fields)` records held, approved, denied, timed out, cancelled;
    `folder` (in the guard home) keeps decided approvals for `keep_seconds`."""

    def __init__(self, audit: Callable[[str, dict[str, Any]], None] | None = None, keep: int = KEEP_DECIDED,
                 folder: Path | None = None, keep_seconds: float = KEEP_SECONDS,
                 notify: Callable[[str, dict[str, Any]], None] | None = None):
        self.audit = audit
        #: the guard's webhooks (supervisor/daemon/notify.py): every event audited is sent too
        self.notify = notify
        self.keep = keep
        self.items: OrderedDict[str, Approval] = OrderedDict()
        self.changed = asyncio.Event()
        #: called on every change (the console's live pages)
        self.listeners: list[Callable[[], None]] = []
        #: told of each event with its approval (the run record: a held write and its picture)
        self.observers: list[Callable[[str, Approval], None]] = []
        self.folder, self.keep_seconds = folder, keep_seconds
        if folder is not None:
            self._load()

    # -- WriteApprover ---------------------------------------------------------------------
    async def decide(self, held: HeldWrite, timeout: float) -> WriteOutcome:
        """One approval for this one request (never shared with another, however alike)."""
        now = time.time()
        ap_id = held.approval_id if held.approval_id and held.approval_id not in self.items else new_approval_id()
        ap = Approval(ap_id, held, now, now + timeout,
                      outcome=asyncio.get_running_loop().create_future())
        self.items[ap.id] = ap
        self._record("write_held", ap)
        log.info("write held for a person: %s %s %s (run %s, stage %s)", ap.id, held.method,
                 hidden_query(held.url), held.run_id, held.stage_id)
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

    def cancel(self, run_id: str | None, stage_id: str | None = None, reason: str = "the stage ended") -> int:
        """Deny what is pending for a run (or one of its stages) that ends; `run_id` None: every
        pending approval (the guard stops)."""
        n = 0
        for ap in list(self.items.values()):
            if ap.state == ApprovalState.PENDING and run_id in (None, ap.held.run_id) \
                    and stage_id in (None, ap.held.stage_id):
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
                 "path": a.held.path, "created": _iso(a.created), "expires": _iso(a.expires)}
                for a in self.items.values() if a.state == ApprovalState.PENDING and a.held.run_id == run_id]

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
        ap.decided_at, ap.by, ap.reason = time.time(), outcome.by, outcome.reason[:500]
        if ap.held.screenshot is not None:   # kept while pending only (decided ones are many)
            ap.held = dataclasses.replace(ap.held, screenshot=None)
        if ap.outcome is not None and not ap.outcome.done():
            ap.outcome.set_result(outcome)
        self._record(VERDICTS[state], ap)
        self._keep(ap)
        log.info("write %s %s by %s", ap.id, state, outcome.by)
        decided = [k for k, a in self.items.items() if a.state != ApprovalState.PENDING]
        for k in decided[:max(0, len(decided) - self.keep)]:
            del self.items[k]
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
        for listener in list(self.listeners):
            _tell("an approvals listener", listener)   # a page that cannot refresh

    def _record(self, event: str, ap: Approval) -> None:
        """The audit record: what was held (method, address with query values hidden, form
        field names, body type and size), why and by which rule, who decided and their reason."""
        self._notify(event, ap)
        for observer in list(self.observers):
            _tell("an approvals observer", observer, event, ap)   # the run record
        if self.audit is None:
            return
        h = ap.held
        fields: dict[str, Any] = {
            "approval": ap.id, "run": h.run_id, "stage": h.stage_id, "attempt": h.attempt,
            "profile": h.profile or None, "method": h.method.lower(), "host": h.host, "port": h.port,
            "url": hidden_query(h.url), "fields": ",".join(k for k, _ in h.form)[:500] if h.form else None,
            "body_type": h.body_type, "body_size": h.body_size, "why": h.why, "rule": h.rule,
            "by": ap.by, "note": ap.reason or None}
        _tell(f"the audit record {event} of {ap.id}", self.audit, event,
              {k: v for k, v in fields.items() if v is not None})

    def _notify(self, event: str, ap: Approval) -> None:
        """The guard's webhooks: what a person needs to act, never a form value, a body, a
        header value or the query (the approval's console page shows those)."""
        if self.notify is None:
            return
        hidden = ("form", "url", "earlier", "headers", "body_text", "tab_url")
        _tell(f"the notification {event} of {ap.id}", self.notify, event,
              {k: v for k, v in ap.public().items() if k not in hidden})

    # -- the lasting record ------------------------------------------------------------------
    def _file(self) -> Path | None:
        return self.folder / RECORD_FILE if self.folder is not None else None

    def _keep(self, ap: Approval) -> None:
        path = self._file()
        if path is None:
            return
        try:
            private_dir(path.parent)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
            try:
                os.write(fd, json.dumps(ap.record(), sort_keys=True).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
        except (OSError, SfguardError) as exc:   # the audit chain has it; the decision stands
            log.warning("could not keep the record of approval %s: %s", ap.id, exc)

    def _load(self) -> None:
        """Decided approvals of earlier guards within `keep_seconds`; the file is rewritten
        without older ones (atomically). A damaged line is skipped and said."""
        path = self._file()
        if path is None or not path.exists():
            return
        cutoff, kept, bad = time.time() - self.keep_seconds, [], 0
        for line in path.read_bytes().splitlines():
            try:
                rec = json.loads(line)
                at = float(rec["at"])
                state = ApprovalState(rec["state"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            if at >= cutoff:
                kept.append(line)
                self.items[rec["id"]] = _from_record(rec, at, state)
        if bad:
            log.warning("the approvals record %s has %d unreadable line(s); skipped", path, bad)
        decided = list(self.items)
        for k in decided[:max(0, len(decided) - self.keep)]:
            del self.items[k]
        with atomic_file(path) as fh:
            fh.write(b"".join(x + b"\n" for x in kept))


def _from_record(rec: dict[str, Any], at: float, state: ApprovalState) -> Approval:
    held = HeldWrite(str(rec.get("run_id")), rec.get("stage_id"), rec.get("attempt"), str(rec.get("profile") or ""),
                     str(rec.get("method")), str(rec.get("url")), str(rec.get("host")), str(rec.get("path")),
                     None, int(rec.get("body_size") or 0), rec.get("body_type"), None, "",
                     why=str(rec.get("why") or ""), port=rec.get("port"))
    return Approval(str(rec["id"]), held, at, at, state, at, rec.get("decided_by"), str(rec.get("reason") or ""),
                    recorded=rec)
