"""The seam between where a write is caught (the guard's browser connection) and who decides a
held one (the approvals store, a person through the console, the CLI or the control API).

`HeldWrite` is what the person is shown; `WriteApprover.decide` waits for their answer (or the
timeout, which is a denial). The local implementation is the approvals store
(supervisor/writes/approvals.py); tests use the in-memory fake in supervisor/testing/.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qsl, urlsplit


def hidden_query(url: str) -> str:
    """For logs and records: scheme, host, port and path, the query's names with their values
    hidden (`?id=...&t=...`), no user info, no fragment."""
    try:
        p = urlsplit(url)
        netloc = p.hostname or ""
        if ":" in netloc:
            netloc = f"[{netloc}]"
        if p.port is not None:
            netloc += f":{p.port}"
    except ValueError:
        return "(unreadable address)"
    names = [k for k, _ in parse_qsl(p.query, keep_blank_values=True)][:20]
    query = ("?" + "&".join(f"{k[:40]}=..." for k in names)) if names else ("?..." if p.query else "")
    return f"{p.scheme}://{netloc}{p.path}{query}"


def new_approval_id() -> str:
    """A new approval's id (`ap_` and 20 hex digits: approval_models.APPROVAL_ID)."""
    return "ap_" + secrets.token_hex(10)


@dataclass(frozen=True)
class HeldWrite:
    """One write held for a person: what is shown is what is sent. `url` is shown to the
    approver whole; logs and records hide its query values."""
    run_id: str
    stage_id: str | None
    attempt: int | None
    profile: str
    method: str
    url: str
    host: str
    path: str
    #: form field names and values of a form body (secret values masked when shown)
    form: tuple[tuple[str, str], ...] | None
    body_size: int
    body_type: str | None
    tab_url: str | None
    #: sha256 over method, URL, meaningful headers and body (a record of what was sent)
    fingerprint: str
    #: why it is held: stage_mode, site_floor, site_write_get, or replay_unsafe_retry (an
    #: earlier attempt of this replay-unsafe stage wrote)
    why: str = "stage_mode"
    #: PNG of the tab when the write was held (None when the tab could not be captured)
    screenshot: bytes | None = field(default=None, repr=False)
    #: for a retry of a replay-unsafe stage: what earlier attempts sent (method, url, at)
    earlier: tuple[dict[str, object], ...] = ()
    port: int | None = None
    #: the sites.yaml rule that decided (file:line and patterns), when a rule did
    rule: str | None = None
    #: the request headers that change what it means (masking.shown_headers), as sent
    headers: tuple[tuple[str, str], ...] = ()
    #: a JSON or text body as shown (masked); None for forms, empty or other bodies
    body_text: str | None = None
    #: names of the page's `type=password` inputs (their values are masked wherever shown)
    password_fields: tuple[str, ...] = ()
    #: the approval's id, chosen where the write is held (its decision-log lines carry it)
    approval_id: str | None = None


@dataclass(frozen=True)
class WriteOutcome:
    """A person's answer (or the timeout's). `by` names who: console session, CLI user, API."""
    approved: bool
    by: str
    reason: str = ""


class WriteApprover(Protocol):
    async def decide(self, held: HeldWrite, timeout: float) -> WriteOutcome:
        """Wait until a person approves or denies `held`, or `timeout` seconds pass (denied,
        by "timeout"). Each held request is its own approval: one approval releases one request."""
        ...
