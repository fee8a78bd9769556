"""The guard's health for probes (`GET /v1/health/live`, `GET /v1/health/ready`): answered on the
control API's listeners without a token, and revealing nothing but the verdict.

Live: the guard's event loop answers. Ready: the guard has started and is not stopping, its
watchdog pass ran within READY_WATCHDOG_S, and its store answers within READY_STORE_S (a shared
PostgreSQL that is away makes a guard not ready: it cannot grant profiles). Why it is not ready
is in `sfguard status`, never in the probe's answer.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from sfguard.supervisor.errors import Unavailable
from sfguard.supervisor.profiles.store_ops import StoreSlow
from sfguard.supervisor.protocols import StoreUnavailable

READY_WATCHDOG_S = 10.0
READY_STORE_S = 2.0


class Health:
    def __init__(self, *, last_pass: Callable[[], float | None], store_probe: Callable[[float], Awaitable[Any]]):
        """The watchdog's `last_pass` (monotonic), and `store_probe(bound)`: a store call that
        raises StoreUnavailable or StoreSlow when the store does not answer in time. `stopping`
        is set when the guard begins to stop."""
        self.last_pass, self.store_probe = last_pass, store_probe
        self.stopping = False

    async def store_answers(self, bound: float) -> bool:
        try:
            await self.store_probe(bound)
        except (StoreUnavailable, StoreSlow):
            return False
        return True

    async def health_live(self) -> dict[str, Any]:
        return {"status": "alive"}

    async def health_ready(self) -> dict[str, Any]:
        passed = self.last_pass()
        if (self.stopping or passed is None or time.monotonic() - passed > READY_WATCHDOG_S
                or not await self.store_answers(READY_STORE_S)):
            raise Unavailable("not_ready", "the guard is not ready (sfguard status says why)", None)
        return {"status": "ready"}
