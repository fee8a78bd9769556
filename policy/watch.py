"""Keep a running guard on its last good policy while the file is edited.

`PolicyWatcher.check()` costs one `stat`; call it about once a second (or before a decision,
rate-limited). When the file changed, it is re-read: a valid file replaces the policy, an invalid
or unreadable one leaves the last good policy in force and is reported through `error` (for
`sfguard status`) until a later edit fixes it.

This is the one implementation of policy watching: the daemon calls `check()` itself, and the
proxy's `PolicyReloader` addon (proxy_addons/policy_watch.py) calls it from an asyncio task.
"""
from __future__ import annotations

import os
from pathlib import Path

from sfguard.policy.engine import SitePolicy
from sfguard.policy.errors import PolicyError
from sfguard.policy.schema import default_policy_path, load_policy


class PolicyWatcher:
    """The current policy of one file. Raises PolicyError at construction if the file is not
    valid then: a guard must not start without a good policy. A caller that already loaded the
    file passes that policy as `policy`; the file is then only stamped, not read again."""

    def __init__(self, path: str | os.PathLike[str] | None = None, policy: SitePolicy | None = None):
        self.path = Path(path) if path is not None else default_policy_path()
        self._stamp = self._stat()
        self.policy: SitePolicy = policy if policy is not None else load_policy(self.path)
        self.error: PolicyError | None = None  # why the file on disk is not the policy in force
        self.generation = 1  # increases with every policy taken into use

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)

    def check(self) -> bool:
        """Re-read the file if it changed; True when a new valid policy was taken into use."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            policy = load_policy(self.path)
        except PolicyError as exc:
            self.error = exc
            return False
        self.policy, self.error = policy, None
        self.generation += 1
        return True
