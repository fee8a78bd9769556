"""PolicyReloader addon: keeps the proxy's site policy current without a restart.

Every `interval` seconds (default 0.25 s) an asyncio task asks a `policy.PolicyWatcher` (the one
implementation of policy watching: one `stat`, a reload on change, the last good policy kept) to
check the file. A valid file replaces the policy at once; an invalid one keeps the last good
policy, logs the error (with its line) to `sfguard.proxy.policy`, and records it in
`PolicyStatus` so `sfguard status` can say "last good policy kept since ..., error ...".
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from sfguard import policy

logger = logging.getLogger("sfguard.proxy.policy")


@dataclass(frozen=True)
class PolicySnapshot:
    """What a status reader sees: which policy is active and whether the file is broken."""

    path: str
    loaded_at: str                 # ISO time the active policy was loaded
    mode: str                      # "enforce" | "report"
    error: str | None = None       # the last reload error (one issue per line), or None
    error_since: str | None = None # when the file first became invalid

    def describe(self) -> str:
        if self.error is None:
            return f"policy {self.path} ({self.mode}) loaded {self.loaded_at}"
        return (f"last good policy kept since {self.error_since}, error {self.error}")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class PolicyStatus:
    """Thread-safe holder of the active SitePolicy and its status."""

    def __init__(self, site_policy: policy.SitePolicy, path: Path) -> None:
        self._lock = threading.Lock()
        self.policy = site_policy
        self._snapshot = PolicySnapshot(str(path), _now(), site_policy.mode)

    def snapshot(self) -> PolicySnapshot:
        return self._snapshot

    def set_policy(self, site_policy: policy.SitePolicy) -> None:
        with self._lock:
            self.policy = site_policy
            self._snapshot = PolicySnapshot(self._snapshot.path, _now(), site_policy.mode)

    def set_error(self, message: str) -> None:
        with self._lock:
            s = self._snapshot
            self._snapshot = PolicySnapshot(s.path, s.loaded_at, s.mode, message,
                                            s.error_since or _now())


class PolicyReloader:
    """mitmproxy addon: polls the policy file through a `policy.PolicyWatcher`."""

    def __init__(self, status: PolicyStatus, path: Path, interval: float = 0.25) -> None:
        self.status = status
        self.path = Path(path)
        self.interval = interval
        self.watcher = policy.PolicyWatcher(self.path, policy=status.policy)
        self._task: asyncio.Task[None] | None = None

    def running(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll(), name="policy watcher")

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def check_now(self) -> bool:
        """Reload if the file changed since the last check; True when a reload was attempted."""
        before = self.watcher.error
        if self.watcher.check():
            new = self.watcher.policy
            self.status.set_policy(new)
            logger.info("policy reloaded from %s (mode %s)", self.path, new.mode)
            return True
        err = self.watcher.error
        if err is None or err is before:
            return False
        logger.error("policy reload failed, keeping the last good policy: %s",
                     str(err).replace("\n", "; "))
        self.status.set_error(str(err))
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.check_now()
            except Exception:  # the task's top: a failed check must not end the watcher (logged)
                logger.exception("policy watcher error")
