"""The profiles of this guard's scope as the profile routes show them (never their contents),
their leases and queues, and the store's calls as the API answers them."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.daemon.runs import holder_where, now_iso
from sfguard.supervisor.errors import BadRequest, Conflict, NotFound, Unavailable
from sfguard.supervisor.profiles import store_ops
from sfguard.supervisor.protocols import ProfileError, ProfileKey, StoreUnavailable

if TYPE_CHECKING:
    from sfguard.supervisor.profiles.store_ops import StoreCalls
    from sfguard.supervisor.profiles.stores import Stores

class Inventory:
    def __init__(self, *, stores: Stores, calls: StoreCalls, scope: str):
        """Given the profile store, lease and audit (`stores`), their calls off the event loop,
        and the guard's scope."""
        self.stores, self.store, self.lease, self.calls, self.scope = (
            stores, stores.store, stores.lease, calls, scope)

    async def store_call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A seam call off the event loop; the database away is Unavailable (the caller may
        retry)."""
        try:
            return await self.calls.run(fn, *args, **kw)
        except StoreUnavailable as exc:
            raise Unavailable("store_unreachable", str(exc), None) from None

    def lease_table(self) -> list[dict[str, Any]]:
        leases = []
        for info in self.store.list(self.scope):
            holder = self.lease.holder(info.key)
            queue = self.lease.queue(info.key)
            leases.append({"profile": info.key.name, "holder_run": holder.run if holder else None,
                           "since": now_iso(holder.since) if holder else None,
                           "queue": [{"run": q.run, "since": now_iso(q.since)} for q in queue],
                           **holder_where(holder and holder.host, holder and holder.guard)})
        return leases

    async def list_profiles(self) -> dict[str, Any]:

        def listing() -> list[dict[str, Any]]:
            out = []
            for info in self.store.list(self.scope):
                holder = self.lease.holder(info.key)
                out.append({"name": info.key.name, "scope": info.key.scope,
                            "created": now_iso(info.created),
                            "last_used": now_iso(info.last_used) if info.last_used else None,
                            "size": info.size, "leased_by": holder.run if holder else None,
                            "identity": info.identity})
            return out
        return {"profiles": await self.store_call(listing)}

    async def delete_profile(self, name: str) -> dict[str, Any]:
        try:
            key = ProfileKey(self.scope, name)
        except ProfileError as exc:
            raise BadRequest("invalid_name", str(exc), "name") from None
        holder = await self.store_call(self.lease.holder, key)
        if holder is not None:
            raise Conflict("profile_leased", f"profile {name!r} is leased by run {holder.run!r}", "name")
        if not await self.store_call(self.store.exists, key):
            raise NotFound("profile_not_found", f"no profile {name!r}", "name")
        await self.store_call(store_ops.delete_profile, self.stores, key, by="api")
        return {"ok": True}
