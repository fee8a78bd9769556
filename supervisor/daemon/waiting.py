"""What waits for a person, with its age: writes held for an approval and open login handoffs
(live views and local windows). `sfguard status`, `status --check` and the metrics read it."""
from __future__ import annotations

import calendar
import time
from typing import Any

from sfguard.supervisor.states import HandoffPhase


def _age_of_iso(stamp: str | None, now: float) -> float:
    try:
        return max(0.0, now - calendar.timegm(time.strptime(stamp or "", "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return 0.0


def pending_approvals(guard: Any) -> list[dict[str, Any]]:
    """Held writes waiting for a decision, oldest first: id, run, stage, method, host, path,
    since and age_s. Never a form value or a query."""
    now = time.time()
    out = [{"id": a["id"], "run": a["run_id"], "stage": a.get("stage_id"), "method": a["method"],
            "host": a["host"], "path": (a.get("path") or "").split("?", 1)[0],
            "since": a["created"], "age_s": round(_age_of_iso(a["created"], now), 1)}
           for a in guard.approvals.listing(state="pending")]
    return sorted(out, key=lambda a: -a["age_s"])


def waiting_handoffs(guard: Any) -> list[dict[str, Any]]:
    """Open login handoffs, oldest first: kind, run, stage, profile, site and age_s."""
    now = time.monotonic()
    found: list[tuple[str, Any]] = []
    console = getattr(guard, "console", None)
    if console is not None:
        found += [("live_view", h) for h in console.handoffs.values()]
    logins = getattr(guard, "logins", None)
    if logins is not None:
        found += [("local_window", h) for h in logins.windows.items.values()]
    out = [{"kind": kind, "run": h.run_id, "stage": h.stage_id, "profile": h.profile, "site": h.site,
            "age_s": round(max(0.0, now - h.created), 1)}
           for kind, h in found if h.state == HandoffPhase.OPEN]
    return sorted(out, key=lambda h: -h["age_s"])
