"""What a full disk (or a missing key) made the guard put off, and does by itself when space
(or the key) returns.

When the guard home fills up (or its runtime folder does), a run that ends cannot always
reseal its profile or write its lease release. Dropping either would lose something: the
unsealed profile holds the run's login (the previous sealed copy is older), and a lease that
is not written as released keeps every other run waiting until the guard restarts. The same
holds on a guard host of a shared store that has not yet been given the store's current key
version (a rotation on another host): it never seals with an older version, so it waits until
its key file holds the new one (read again without a restart). So:

- a reseal that fails for lack of space keeps the unsealed copy (in the memory-backed runtime
  folder) and the lease; the reseal is tried again every RETRY_INTERVAL_S;
- the run's lease release waits until each of its reseals landed (another run must never
  unseal the older copy while the newer one waits), and is tried again likewise.

`status` lists what waits (`pending`), and the metrics' disk gauges say why.
"""
from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sfguard.supervisor.profiles import rotation, store_ops
from sfguard.supervisor.profiles.keys import KeyVersionMissing
from sfguard.supervisor.protocols import ProfileError, ProfileKey

log = logging.getLogger("sfguard.guard")

#: how often what waits is tried again
RETRY_INTERVAL_S = 2.0
#: the errors that mean "no space", as opposed to a damaged home
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def no_space(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says a disk or quota is full."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in NO_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


#: what a deferred step waits for: (why it failed, when it is done)
SPACE = ("no space left", "there is space")
KEY = ("this host has not got the store's current key version", "its key file holds it")


def waits_for(exc: BaseException) -> tuple[str, str] | None:
    """SPACE or KEY when a failed reseal or release can wait and be tried again; else None."""
    if no_space(exc):
        return SPACE
    seen: BaseException | None = exc
    for _ in range(5):
        if isinstance(seen, KeyVersionMissing):
            return KEY
        seen = None if seen is None else (seen.__cause__ or seen.__context__)
    return None


@dataclass
class Deferred:
    """The reseals and lease releases put off for lack of space or key (one guard's)."""

    stores: Any
    calls: Any
    reseals: dict[ProfileKey, str] = field(default_factory=dict)      # profile -> run
    releases: dict[str, str] = field(default_factory=dict)            # run -> outcome
    why: dict[ProfileKey | str, tuple[str, str]] = field(default_factory=dict)
    _last_try: float = 0.0

    def reseal_later(self, key: ProfileKey, run: str, wait: tuple[str, str] = SPACE) -> None:
        self.reseals[key], self.why[key] = run, wait
        log.warning("profile %s: %s to reseal it; its unsealed copy and run %s's lease are kept, and "
                    "the reseal is tried again every %.0f s", key.name,
                    "no space" if wait is SPACE else "no current key", run, RETRY_INTERVAL_S)

    def release_later(self, run: str, outcome: str, wait: tuple[str, str] = SPACE) -> None:
        self.releases[run], self.why[run] = outcome, wait

    @staticmethod
    def no_space_problem(problems: list[str]) -> tuple[str, str] | None:
        """Whether release_run's problems say the release failed for lack of space (SPACE) or
        of the current key (KEY)."""
        if any(p.endswith("(no_space)") for p in problems):
            return SPACE
        return KEY if any(p.endswith("(key_missing)") for p in problems) else None

    def holds(self, run: str) -> bool:
        """Whether `run` has a reseal waiting (then its release must wait too)."""
        return run in self.reseals.values()

    def pending(self) -> list[str]:
        """What waits, for `status`: one line each."""
        def what(item: ProfileKey | str) -> str:
            return "disk space" if self.why.get(item, SPACE) is SPACE else "the current key version on this host"
        out = [f"profile {k.name}: reseal waits for {what(k)} (run {run} keeps its lease until then)"
               for k, run in self.reseals.items()]
        out += [f"run {run}: lease release waits for {what(run)}" for run in self.releases]
        return out

    async def retry(self, now: float | None = None) -> list[str]:
        """Try what waits (at most every RETRY_INTERVAL_S); the runs whose releases landed."""
        now = time.monotonic() if now is None else now
        if not (self.reseals or self.releases) or now - self._last_try < RETRY_INTERVAL_S:
            return []
        self._last_try = now
        for key in list(self.reseals):
            try:
                await self.calls.run(rotation.close_profile, self.stores, key, self.reseals[key])
            except (OSError, ProfileError) as exc:
                if waits_for(exc) is None:
                    log.error("profile %s: reseal failed again (%s); the unsealed copy is kept "
                              "for the next start's sweep", key.name, exc)
                continue
            del self.reseals[key]
            self.why.pop(key, None)
            log.info("profile %s: resealed now that it could be", key.name)
        done = []
        for run, outcome in list(self.releases.items()):
            if self.holds(run):
                continue
            _released, problems = await self.calls.run(store_ops.release_run, self.stores, run, outcome)
            if self.no_space_problem(problems):
                continue
            del self.releases[run]
            self.why.pop(run, None)
            done.append(run)
            log.info("run %s: its leases were released now that there is space", run)
        return done
