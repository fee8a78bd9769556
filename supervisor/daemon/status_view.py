"""What the guard holds, as `sfguard status` and the console's overview show it: the guard,
its runs (those not ended and the most recently ended), leases and queues, the policy's state,
trusted authorities, disk space and work a full disk put off, what waits for a person (held
writes, login handoffs), the audit chain's last check and the webhooks' deliveries."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.daemon.metrics import DISK_LOW_BYTES, disk_free
from sfguard.supervisor.daemon.runs import RunState, now_iso
from sfguard.supervisor.daemon.waiting import pending_approvals, waiting_handoffs
from sfguard.supervisor.profiles.store_ops import StoreSlow
from sfguard.supervisor.protocols import StoreUnavailable

if TYPE_CHECKING:
    from sfguard.supervisor.daemon.guard import Guard

#: `status` waits this long for the store's part (leases, queues); then answers without it
STATUS_STORE_WAIT = 2.0
#: `status` lists every run not yet ended and this many of the most recently ended
STATUS_ENDED_SHOWN = 20


def disk_state(home: Any, runtime: Any) -> list[dict[str, Any]]:
    """Free space of the home and the runtime folder, with the `disk_low` flag."""
    out = []
    for folder, path in (("home", home), ("runtime", runtime)):
        free = disk_free(path)
        out.append({"folder": folder, "path": str(path), "free_bytes": free,
                    "low": free is not None and free < DISK_LOW_BYTES})
    return out


async def guard_status(g: Guard) -> dict[str, Any]:
    """`GET /v1/status`: a read-only view of the whole guard (it changes nothing but retiring
    the ended runs past their keeping)."""
    # the store's part is bounded: with the database away, status still answers at once
    store_error = None
    try:
        leases = await g.calls.bounded(STATUS_STORE_WAIT, g.inventory.lease_table)
    except (StoreUnavailable, StoreSlow) as exc:
        leases, store_error = [], str(exc)
    g.retention.retire()
    active = [r for r in g.runs.values() if r.state != RunState.ENDED]
    recent = [g.runs[i] for i in reversed(g.retention.ended) if i in g.runs][:STATUS_ENDED_SHOWN]
    return {
        "guard": {"pid": os.getpid(), "since": now_iso(g.started), "home": str(g.home),
                  "key_provider": g.stores.keys.describe(), "scope": g.scope,
                  "store": g.stores.shown, "store_error": store_error,
                  "tcp_port": g.api_tcp_port, "version": g.metrics.version},
        "policy": {"file": str(g.policy_path), "mode": g.site_policy.mode,
                   "state": "error" if g.policy_error else "ok", "error": g.policy_error},
        "runs": [r.public() for r in active + recent],
        "runs_summary": {"active": len(active), "ended_shown": len(recent),
                         **g.retention.summary()},
        "leases": leases,
        "console": {"url": g.console.base_url} if g.console is not None else None,
        # authorities the browsers trust besides the system's (--ca-file, browsers/trust.py)
        "trusted_cas": ca.public() if (ca := getattr(g.host, "ca", None)) else [],
        "disk": disk_state(g.home, g.runtime),
        "pending": g.deferred.pending(),
        # what waits for a person, with its age (`status --check --max-wait`)
        "approvals": pending_approvals(g),
        "handoffs": waiting_handoffs(g),
        "audit": g.audit_watch.public(),
        "notifications": g.notifier.status(),
    }
