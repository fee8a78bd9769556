"""The audit sink, teed into the run records: every audit record that names a run of this guard
(login checks, handoffs, leases, console actions) is also an entry of that run's record."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sfguard.record")


class AuditTee:
    """An AuditSink (supervisor/protocols.py) that records through `sink` first, then tells
    `seen(event, fields)`; whatever `seen` does, the audit record stands. Everything else of
    the sink (verify, records, ...) is the sink's own."""

    def __init__(self, sink: Any, seen: Callable[[str, dict[str, Any]], None]):
        self._sink, self._seen = sink, seen

    def record(self, event: str, **fields: Any) -> Any:
        out = self._sink.record(event, **fields)
        try:
            self._seen(event, fields)
        except Exception:   # a boundary: the record's failure never undoes an audit record
            log.exception("the run record did not take an audit record")
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)
