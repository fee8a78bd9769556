"""Pacing in the proxy: the site's pace and a stage's budget on what the proxy sees.

What one request counts, for its client's profile (`Client.pace_key`; docs/threat-model.md,
"Pacing"):

- a CONNECT tunnel: one request, and one connection open while the tunnel lasts. What a TLS
  tunnel carries is not seen (many HTTPS requests may share one tunnel);
- a plain-HTTP request: one request, and a page load as well when it is a navigation
  (`Sec-Fetch-Dest` document, iframe or frame; or `Upgrade-Insecure-Requests: 1` where the
  browser sends no `Sec-Fetch-Dest`); its client connection holds one connection open to the
  site until it closes.

Limits are `policy.pace` counters: rates in a `PaceStore` (a file per counter in the guard home
here, `FilePaceStore`; the shared PostgreSQL store of supervisor/profiles/pg_pace.py across guard
hosts), budget totals and a stage's own rates always in the local store (a stage lives on one
host), and open connections counted in this process (the profile's lease gives one run, so one
proxy, at a time). Over a limit: wait up to the entry's `max_wait_s` (the request is sent
later), else `429` with `Retry-After`, `X-Sfguard-Decision: deny; reason=pace|budget` and a
line the page and the agent can read; a wait of `policy.pace.DELAY_LOGGED` or more and every
refusal are decision lines. A store that cannot be read refuses (503, `pace_unavailable`).
"""
from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sfguard.errors import SfguardError
from sfguard.policy.pace import (
    NO_PACE,
    Admission,
    Budget,
    Cap,
    HostPace,
    Limit,
    Rate,
    State,
    Total,
    admit,
    retry_text,
)

#: headers of a navigation (a document or frame request)
NAV_DESTS = frozenset({"document", "iframe", "frame"})
_F = struct.Struct("<dd")


class PaceUnavailable(SfguardError):
    """The pace counters cannot be read or written: paced requests are refused (fail closed)."""


class PaceStore(Protocol):
    async def take(self, limits: Sequence[tuple[str, Limit]], *, force: bool = False) -> Admission:
        """One event on every limit at once, or none (policy.pace.admit, `force`: an event that
        happened already). Raises PaceUnavailable."""
        ...

    async def close(self) -> None: ...


class MemoryPaceStore:
    """Counters in this process (`sfguard proxy`, tests)."""

    def __init__(self, clock: object = time.time) -> None:
        self.states: dict[str, State] = {}
        self.clock = clock

    async def take(self, limits: Sequence[tuple[str, Limit]], *, force: bool = False) -> Admission:
        now = self.clock() if callable(self.clock) else time.time()
        result = admit(self.states, limits, float(now), force=force)
        self.states.update(result.updates)
        return result

    async def close(self) -> None:
        return None


class FilePaceStore:
    """Counters in a folder (0700) of the guard home: one file of 16 bytes per counter, named
    by a hash of its key (no profile name on disk), changed under `flock`, so the proxies of
    every run on this host share them, and they outlive a restart of the guard. Locks are
    taken in key order (no deadlock between processes); the files of recent counters stay open
    (a take is then flock, pread, pwrite, unlock)."""

    MAX_OPEN = 256

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self._fds: dict[str, int] = {}

    def path(self, key: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(key.encode()).hexdigest()[:40])

    def _fd(self, key: str) -> int:
        fd = self._fds.get(key)
        if fd is None:
            fd = os.open(self.path(key), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            while len(self._fds) >= self.MAX_OPEN:     # the oldest opened goes
                os.close(self._fds.pop(next(iter(self._fds))))
            self._fds[key] = fd
        return fd

    def take_sync(self, limits: Sequence[tuple[str, Limit]], now: float | None = None, *,
                  force: bool = False) -> Admission:
        locked: list[tuple[str, int]] = []
        try:
            states: dict[str, State] = {}
            keys = [limits[0][0]] if len(limits) == 1 else sorted({k for k, _ in limits})
            for key in keys:
                fd = self._fd(key)
                fcntl.flock(fd, fcntl.LOCK_EX)
                locked.append((key, fd))
                data = os.pread(fd, _F.size, 0)
                if len(data) == _F.size:
                    states[key] = _F.unpack(data)
            result = admit(states, limits, time.time() if now is None else now, force=force)
            for key, fd in locked:
                if key in result.updates:
                    os.pwrite(fd, _F.pack(*result.updates[key]), 0)
            return result
        except OSError as exc:
            raise PaceUnavailable(f"the pace counters cannot be used ({exc.strerror or exc})") from None
        finally:
            for _key, fd in locked:
                try:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError:    # a descriptor that broke: closed and opened again next time
                    os.close(self._fds.pop(_key, fd))

    async def take(self, limits: Sequence[tuple[str, Limit]], *, force: bool = False) -> Admission:
        return self.take_sync(limits, force=force)

    def forget(self, keys: Sequence[str]) -> None:
        """Remove counters (a stage's budget totals, when it ends)."""
        for key in keys:
            fd = self._fds.pop(key, None)
            if fd is not None:
                os.close(fd)
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                pass

    async def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class StageBudget:
    """One stage's budget on a client: `label` names its counters (run/stage/attempt), `until`
    is when its active minutes end (epoch seconds; None: no such limit)."""
    label: str
    budget: Budget
    until: float | None = None


@dataclass(frozen=True)
class Refusal:
    status: int          # 429, or 503 when the counters cannot be used
    reason: str          # pace | budget | pace_unavailable
    rule: str | None
    explanation: str
    retry_after: float | None


@dataclass(frozen=True)
class Verdict:
    wait: float = 0.0
    limit: Limit | None = None   # the limit that made it wait longest
    refusal: Refusal | None = None
    due: float = float("-inf")   # how late against the pace (policy.pace.Admission.due)


GO = Verdict()


def budget_keys(label: str) -> list[str]:
    """Every counter a stage's budget can have (FilePaceStore.forget them when it ends)."""
    full = Budget(page_loads=1, requests=1, page_loads_per_minute=1, requests_per_minute=1)
    return [lim.key(f"budget:{label}") for kind in ("requests", "page_loads") for lim in full.limits(kind)]


def is_navigation(fields: Sequence[tuple[bytes, bytes]]) -> bool:
    """A plain-HTTP request that loads a page or frame (what a browser sends with one), from
    its head's fields."""
    upgrade = False
    for name, value in fields:
        lower = name.lower()
        if lower == b"sec-fetch-dest":
            return value.strip().lower().decode("latin-1") in NAV_DESTS
        if lower == b"upgrade-insecure-requests":
            upgrade = value.strip() == b"1"
    return upgrade


def _refusal(limit: Limit, retry_after: float | None) -> Refusal:
    if isinstance(limit, Total) or limit.reason == "budget":
        what = ("Every request of this stage is refused until it ends" if isinstance(limit, Total)
                else f"Try again {retry_text(retry_after)}")
        return Refusal(429, "budget", limit.rule,
                       f"sfguard: 429 over this stage's budget: {limit.explanation} ({limit.rule}). "
                       f"The request was not sent. {what}; stop and report it, do not retry another way.",
                       retry_after)
    return Refusal(429, "pace", limit.rule,
                   f"sfguard: 429 over the site's pace: {limit.explanation} ({limit.rule}), for this "
                   f"account across every run. The request was not sent. Slow down and try again "
                   f"{retry_text(retry_after)}; do not retry another way.", retry_after)


class ConnectionCaps:
    """Connections open at once per counter (`policy.pace.Cap`), in this process."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self._freed: dict[str, asyncio.Event] = {}

    async def acquire(self, key: str, cap: Cap) -> bool:
        deadline = time.monotonic() + cap.max_wait
        while self.open.get(key, 0) >= cap.limit:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            event = self._freed.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                return False
        self.open[key] = self.open.get(key, 0) + 1
        return True

    def release(self, key: str) -> None:
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)
        event = self._freed.pop(key, None)
        if event is not None:
            event.set()


class Pacer:
    """The pace and budgets of one proxy: `shared` holds the sites' rates (per profile),
    `local` the stages' budgets; both the same store on a guard without a shared one."""

    def __init__(self, shared: PaceStore | None = None, local: PaceStore | None = None,
                 clock: object = time.time) -> None:
        self.local: PaceStore = local if local is not None else MemoryPaceStore()
        self.shared: PaceStore = shared if shared is not None else self.local
        self.caps = ConnectionCaps()
        self.clock = clock

    def now(self) -> float:
        return float(self.clock()) if callable(self.clock) else time.time()

    async def admit(self, who: str, budgets: Sequence[StageBudget], pace: HostPace, page_load: bool,
                    request: bool = True, force: bool = False) -> Verdict:
        """One request of `who` to a host with `pace` (and a page load with `page_load`; only a
        page load without `request`: the guard's browser side). `force`: it happened already
        (counted however late; refused only by a budget total, which it does not count)."""
        kinds = (("requests",) if request else ()) + (("page_loads",) if page_load else ())
        stage_limits: list[tuple[str, Limit]] = []
        now = self.now() if budgets else 0.0
        for sb in budgets:
            if sb.until is not None and now >= sb.until:
                minutes = sb.budget.active_minutes
                rule = f"browser.budget.active_minutes {minutes:g}"
                return Verdict(refusal=_refusal(Total("active_minutes", 0, rule,
                                                      f"this stage's budget allows {minutes:g} active minutes"), None))
            for kind in kinds:
                stage_limits += [(lim.key(f"budget:{sb.label}"), lim) for lim in sb.budget.limits(kind)]
        site_limits: list[tuple[str, Limit]] = [(r.key(who), r) for r in pace.requests] if request else []
        if page_load:
            site_limits += [(r.key(who), r) for r in pace.page_loads]
        wait, longest, due = 0.0, None, float("-inf")
        try:
            for store, limits in ((self.shared, site_limits), (self.local, stage_limits)):
                if not limits:
                    continue
                result = await store.take(limits, force=force)
                if result.refused is not None:
                    return Verdict(refusal=_refusal(result.refused, result.retry_after), due=result.due)
                due = max(due, result.due)
                if result.wait > wait:
                    wait, longest = result.wait, _longest(limits, result)
        except PaceUnavailable as exc:
            return Verdict(refusal=Refusal(503, "pace_unavailable", None,
                                           f"sfguard: the guard cannot count this site's pace now ({exc}), so "
                                           "it refused the request. Try again later.", None))
        return Verdict(wait, longest, None, due) if wait > 0 or force else GO

    async def open_connection(self, who: str, pace: HostPace) -> tuple[list[str], Refusal | None]:
        """Count one open connection on each cap of `pace`: the keys held (release each with
        `caps.release`), or a refusal (nothing held)."""
        held: list[str] = []
        for cap in pace.connections:
            key = cap.key(who)
            if not await self.caps.acquire(key, cap):
                for k in held:
                    self.caps.release(k)
                return [], Refusal(429, "pace", cap.rule,
                                   f"sfguard: 429 over the site's pace: {cap.explanation} ({cap.rule}), for "
                                   "this account. The connection was not opened. Close what you do not "
                                   "need and try again; do not retry another way.", None)
            held.append(key)
        return held, None


def _longest(limits: Sequence[tuple[str, Limit]], result: Admission) -> Limit | None:
    """The rate that asked the longest wait (for the decision line)."""
    best, found = float("-inf"), None
    for key, lim in limits:
        if isinstance(lim, Rate):
            due = result.updates.get(key, (0.0, 0.0))[0] - lim.burst * lim.interval
            if due > best:
                best, found = due, lim
    return found


__all__ = ["GO", "NO_PACE", "ConnectionCaps", "FilePaceStore", "MemoryPaceStore", "PaceStore",
           "PaceUnavailable", "Pacer", "Refusal", "StageBudget", "Verdict", "budget_keys", "is_navigation"]
