"""The guard's recorder (issue 48): the core (core.py: runs, levels, cap, screenshots, seal) with
its sources (sources.py: gate, pipe, write gate, approvals, audit, decision log), started and
stopped with the guard. `recorded` puts the write gate's decision lines into the record too."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.record.core import RecordSettings
from sfguard.supervisor.record.sources import Sources
from sfguard.supervisor.record.tail import follow

log = logging.getLogger("sfguard.record")

__all__ = ["RecordSettings", "Recorder", "recorded"]


def recorded(first: Callable[[str, dict[str, object]], None],
             then: Callable[[dict[str, object]], None]) -> Callable[[str, dict[str, object]], None]:
    """The write gate's decision lines (`first`: the decision log), each also told to the
    record (`then`); a record that fails never loses the decision line."""
    def both(decision: str, rec: dict[str, object]) -> None:
        first(decision, rec)
        with swallowed(log, "a write decision into its run's record"):
            then(rec)
    return both


class Recorder(Sources):
    """The guard's run records (see core.py and sources.py)."""

    async def start(self, decisions_log: Path | None = None) -> list[str]:
        """Seal what a guard that died left open, prune now and hourly, fsync every second, and
        follow the decision log (the run proxies' lines). The records sealed."""
        self.loop = loop = asyncio.get_running_loop()
        sealed = await asyncio.to_thread(self.recover)
        self._tasks = [loop.create_task(self._tick()), loop.create_task(self._prune_loop())]
        if decisions_log is not None and self.on:
            self._tasks.append(loop.create_task(follow(decisions_log, self.proxy_line)))
        return sealed
