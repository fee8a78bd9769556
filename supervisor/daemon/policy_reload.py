"""The live site policy file, checked on every watchdog pass: a valid edit is applied (audited,
every browser's write gates re-wired), an invalid one refused once (an ERROR line, a
`policy_edit_refused` audit record, a `policy_invalid` webhook) while the last good policy stays
in force (`policy.PolicyWatcher`)."""
from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("sfguard.guard")


def check_policy(*, watch: Any, path: Path, audit: Any, calls: Any, policy_changed: Callable[[], None],
                 notify: Callable[[str, dict[str, Any]], None]) -> None:
    before = watch.error
    if watch.check():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        calls.submit("the audit record of a policy reload", audit.record,
                     "policy_reloaded", mode=watch.policy.mode, policy_sha256=digest)
        log.info("site policy reloaded from %s", path)
        policy_changed()
    elif watch.error is not None and watch.error is not before:
        error = str(watch.error).replace("\n", "; ")
        log.error("site policy edit refused, the last good policy stays in force: %s", error)
        notify("policy_invalid", {"file": str(path), "reason": error})
        fields: dict[str, Any] = {"mode": watch.policy.mode, "reason": "invalid"}
        with contextlib.suppress(OSError):
            fields["policy_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        calls.submit("the audit record of a refused policy edit", audit.record,
                     "policy_edit_refused", **fields)
