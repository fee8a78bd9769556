"""The seam between where a write is caught (the guard's browser connection) and who decides a
held one (the approvals store, a person through the console, the CLI or the control API).

`HeldWrite` is what the person is shown; `WriteApprover.decide` waits for their answer (or the
timeout, which is a denial). The local implementation is the approvals store
(supervisor/writes/approvals.py); tests use the in-memory fake in supervisor/testing/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class HeldWrite:
    """One write held for a person. `url` is shown to the approver; logs redact its query."""
    run_id: str
    stage_id: str | None
    attempt: int | None
    profile: str
    method: str
    url: str
    host: str
    path: str
    #: form field names and values of a form body (password-like values masked when shown)
    form: tuple[tuple[str, str], ...] | None
    body_size: int
    body_type: str | None
    tab_url: str | None
    #: sha256 over method, URL and body: identical writes pending at once share one approval
    fingerprint: str
    #: why it is held: the write mode `gate`, or `replay_unsafe_retry` (an earlier attempt wrote)
    why: str = "gate"
    #: PNG of the tab when the write was held (None when the tab could not be captured)
    screenshot: bytes | None = field(default=None, repr=False)
    #: for a retry of a replay-unsafe stage: what earlier attempts sent (method, url, at)
    earlier: tuple[dict[str, object], ...] = ()


@dataclass(frozen=True)
class WriteOutcome:
    """A person's answer (or the timeout's). `by` names who: console session, CLI user, API."""
    approved: bool
    by: str
    reason: str = ""


class WriteApprover(Protocol):
    async def decide(self, held: HeldWrite, timeout: float) -> WriteOutcome:
        """Wait until a person approves or denies `held`, or `timeout` seconds pass (denied,
        by "timeout"). Identical writes pending at once (same run, stage and fingerprint) are
        one approval: every waiter gets the same outcome."""
        ...
