"""An in-memory, scriptable WriteApprover for tests: approve, deny or never answer; records
every held write it was asked about. Identical pending writes (run, stage, fingerprint) share
one decision, as the approvals store does."""
from __future__ import annotations

import asyncio

from sfguard.supervisor.writes.held import HeldWrite, WriteOutcome


class FakeApprover:
    def __init__(self, answer: str = "never", delay: float = 0.0) -> None:
        self.answer = answer          # "approve" | "deny" | "never" | "manual"
        self.delay = delay
        self.asked: list[HeldWrite] = []
        self._pending: dict[tuple, asyncio.Future] = {}

    async def decide(self, held: HeldWrite, timeout: float) -> WriteOutcome:
        self.asked.append(held)
        key = (held.run_id, held.stage_id, held.fingerprint)
        fut = self._pending.get(key)
        if fut is None or fut.done():
            fut = asyncio.get_running_loop().create_future()
            self._pending[key] = fut
            if self.answer in ("approve", "deny"):
                outcome = WriteOutcome(self.answer == "approve", "fake", self.answer)
                asyncio.get_running_loop().call_later(self.delay, _set, fut, outcome)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            return WriteOutcome(False, "timeout", "no decision in time")

    def decide_all(self, approved: bool, by: str = "fake") -> int:
        """Answer every pending write (for "manual"); the number answered."""
        n = 0
        for fut in self._pending.values():
            if not fut.done():
                fut.set_result(WriteOutcome(approved, by))
                n += 1
        return n


def _set(fut: asyncio.Future, outcome: WriteOutcome) -> None:
    if not fut.done():
        fut.set_result(outcome)
