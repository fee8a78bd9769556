"""The CDP gate's refusals as the guard keeps them: each one a decision line at once, and one
aggregated audit record (`denials_aggregated`) when a stage or run ends.

Build it with the decision log, the store calls and the audit log; give `on_refusal` to the
gate and `flush` to the teardown."""
from __future__ import annotations

from pathlib import Path

from sfguard.supervisor.daemon.log_rotation import write_decision
from sfguard.supervisor.profiles.store_ops import StoreCalls
from sfguard.supervisor.protocols import AuditSink


class GateRefusals:
    def __init__(self, decision_log: Path, calls: StoreCalls, audit: AuditSink):
        self.decision_log, self.calls, self.audit = decision_log, calls, audit
        self.counts: dict[str, int] = {}

    def on_refusal(self, stage_key: str, method: str, reason: str) -> None:
        self.counts[method] = self.counts.get(method, 0) + 1
        write_decision(self.decision_log, stage=stage_key, method=method,
                       decision="deny", reason=reason, source="cdp_gate")

    def flush(self) -> None:
        if self.counts:
            total = sum(self.counts.values())
            self.calls.submit("the audit record of aggregated denials", self.audit.record,
                              "denials_aggregated", count=total, reason="cdp_gate")
            self.counts.clear()
