"""The audit chain's state while the guard runs: verified at start and again every `interval`
seconds (off the event loop; reading the whole chain costs ~0.5 s per 20,000 records here).

    watch = AuditWatch(audit.verify, calls.run, interval=300, notify=notifier.emit)
    watch.seen(audit.verify())          # the start's own check
    watch.start()                       # checks every `interval`; `await watch.stop()`
    watch.public()                      # {"ok", "checked", "problem", "interval_s"} for status

When the chain stops verifying the guard logs an ERROR and sends `audit_chain_broken` once (again
only after it verified in between); `status --check` alerts and `sfguard_audit_chain_ok` is 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("sfguard.audit")

DEFAULT_INTERVAL_S = 300.0


class AuditWatch:
    def __init__(self, verify: Callable[[], Any], run: Callable[..., Awaitable[Any]],
                 interval: float = DEFAULT_INTERVAL_S,
                 notify: Callable[[str, dict[str, Any]], None] | None = None):
        self.verify, self.run, self.interval, self.notify = verify, run, interval, notify
        self.ok: bool | None = None
        self.checked: float | None = None
        self.problem: str | None = None
        self._task: asyncio.Task[None] | None = None

    def seen(self, result: Any) -> None:
        """The outcome of a check (a VerifyResult: `ok` and its text)."""
        before = self.ok
        self.ok, self.checked = bool(result.ok), time.time()
        self.problem = None if result.ok else str(result)
        if not self.ok and before is not False:
            log.error("the audit chain does not verify: %s (see `sfguard audit verify`)", self.problem)
            if self.notify is not None:
                self.notify("audit_chain_broken", {"reason": self.problem})
        elif self.ok and before is False:
            log.info("the audit chain verifies again")

    async def check(self) -> None:
        try:
            result = await self.run(self.verify)
        except Exception as exc:   # the loop's top: whatever stops a check (a store away), the watch goes on
            log.warning("the audit chain could not be verified: %s: %s", type(exc).__name__, exc)
            self.ok, self.checked, self.problem = None, time.time(), f"not verified: {exc}"
            return
        self.seen(result)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def public(self) -> dict[str, Any]:
        checked = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.checked)) if self.checked else None
        return {"ok": self.ok, "checked": checked, "problem": self.problem, "interval_s": self.interval}
