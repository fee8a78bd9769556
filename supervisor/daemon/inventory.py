"""What the guard holds, as `sfguard status` and the profile routes show it: runs, leases and
queues, the policy's state, and the profiles of this guard's scope (never their contents)."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.daemon.metrics import DISK_LOW_BYTES, disk_free
from sfguard.supervisor.daemon.runs import RunState, holder_where, now_iso
from sfguard.supervisor.errors import BadRequest, Conflict, NotFound, Unavailable
from sfguard.supervisor.profiles import store_ops
from sfguard.supervisor.profiles.store_ops import StoreSlow
from sfguard.supervisor.protocols import ProfileError, ProfileKey, StoreUnavailable

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


class Inventory:
    def __init__(self, guard: Guard):
        self.g = guard

    async def store_call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A seam call off the event loop; the database away is Unavailable (the caller may
        retry)."""
        try:
            return await self.g.calls.run(fn, *args, **kw)
        except StoreUnavailable as exc:
            raise Unavailable("store_unreachable", str(exc), None) from None

    def lease_table(self) -> list[dict[str, Any]]:
        g = self.g
        leases = []
        for info in g.store.list(g.scope):
            holder = g.lease.holder(info.key)
            queue = g.lease.queue(info.key)
            leases.append({"profile": info.key.name, "holder_run": holder.run if holder else None,
                           "since": now_iso(holder.since) if holder else None,
                           "queue": [{"run": q.run, "since": now_iso(q.since)} for q in queue],
                           **holder_where(holder and holder.host, holder and holder.guard)})
        return leases

    async def status(self) -> dict[str, Any]:
        g = self.g
        # the store's part is bounded: with the database away, status still answers at once
        store_error = None
        try:
            leases = await g.calls.bounded(STATUS_STORE_WAIT, self.lease_table)
        except (StoreUnavailable, StoreSlow) as exc:
            leases, store_error = [], str(exc)
        g.retire()
        active = [r for r in g.runs.values() if r.state != RunState.ENDED]
        recent = [g.runs[i] for i in reversed(g.ended) if i in g.runs][:STATUS_ENDED_SHOWN]
        return {
            "guard": {"pid": os.getpid(), "since": now_iso(g.started), "home": str(g.home),
                      "key_provider": g.keys.describe(), "scope": g.scope,
                      "store": g.stores.shown, "store_error": store_error,
                      "tcp_port": g.api_tcp_port},
            "policy": {"file": str(g.policy_path), "mode": g.site_policy.mode,
                       "state": "error" if g.policy_error else "ok", "error": g.policy_error},
            "runs": [r.public() for r in active + recent],
            "runs_summary": {"active": len(active), "ended_shown": len(recent),
                             "ended_in_memory": len(g.ended), "retired": g.retired,
                             "keep_ended_runs": g.keep_ended_runs,
                             "keep_ended_hours": g.keep_ended_seconds / 3600},
            "leases": leases,
            "console": {"url": g.console.base_url} if g.console is not None else None,
            # authorities the browsers trust besides the system's (--ca-file, browsers/trust.py)
            "trusted_cas": ca.public() if (ca := getattr(g.host, "ca", None)) else [],
            "disk": disk_state(g.home, g.runtime),
            "pending": g.deferred.pending(),
        }

    async def list_profiles(self) -> dict[str, Any]:
        g = self.g

        def listing() -> list[dict[str, Any]]:
            out = []
            for info in g.store.list(g.scope):
                holder = g.lease.holder(info.key)
                out.append({"name": info.key.name, "scope": info.key.scope,
                            "created": now_iso(info.created),
                            "last_used": now_iso(info.last_used) if info.last_used else None,
                            "size": info.size, "leased_by": holder.run if holder else None,
                            "identity": info.identity})
            return out
        return {"profiles": await self.store_call(listing)}

    async def delete_profile(self, name: str) -> dict[str, Any]:
        g = self.g
        try:
            key = ProfileKey(g.scope, name)
        except ProfileError as exc:
            raise BadRequest("invalid_name", str(exc), "name") from None
        holder = await self.store_call(g.lease.holder, key)
        if holder is not None:
            raise Conflict("profile_leased", f"profile {name!r} is leased by run {holder.run!r}", "name")
        if not await self.store_call(g.store.exists, key):
            raise NotFound("profile_not_found", f"no profile {name!r}", "name")
        await self.store_call(store_ops.delete_profile, g.stores, key, by="api")
        return {"ok": True}
