"""Decision-log replay: what a candidate policy would have answered to logged traffic.

Pure like the rest of `policy/`: `read_decision_log` takes the lines of a proxy's
`--decision-log` and `replay` re-decides every logged request under a candidate policy (or two
policies on the same traffic, for `policy diff --log`); the CLI (`sfguard policy replay|diff`,
cli/policy_test_cmd.py) reads the files and prints.

A decision is the one `sfguard policy explain` gives: the host rules, and for a logged address
the address check. Refusals made by the proxy at connect time (SNI, Host header, credentials)
are kept as they were: a host policy cannot change them.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypedDict

from sfguard.policy.engine import SitePolicy
from sfguard.policy.errors import PolicyError
from sfguard.policy.index import RuleSet, compile_patterns

#: reason codes a host-level decision can give; the others are made by the proxy at connect time
HOST_REASONS = frozenset({"malformed_host", "port_not_allowed", "blocked_by_policy",
                          "allowed_by_run", "allowed_by_policy", "not_allowed"})


@dataclass(frozen=True)
class LoggedRequest:
    line: int
    run: str | None
    host: str
    port: int | None
    decision: str
    reason: str
    rule: str | None
    addr: str | None
    count: int = 1


@dataclass
class DecisionLog:
    requests: list[LoggedRequest] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (line, why)
    run_allow: dict[str | None, list[str]] = field(default_factory=dict)


def read_decision_log(lines: Iterable[str]) -> DecisionLog:
    """Parse decision-log JSON lines (the proxy's `--decision-log`). Lines that are not
    decisions are listed in `skipped`; aggregated quiet denials become one request per host
    (no port is logged for them: they are re-decided as `policy explain HOST` is)."""
    log = DecisionLog()
    for n, raw in enumerate(lines, 1):
        raw = raw.strip()
        if not raw:
            continue
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            log.skipped.append((n, "not JSON"))
            continue
        if not isinstance(rec, dict) or rec.get("decision") not in ("allow", "deny") \
                or not isinstance(rec.get("reason"), str):
            log.skipped.append((n, "not a decision record"))
            continue
        run = rec.get("run") if isinstance(rec.get("run"), str) else None
        if rec.get("source") == "cdp_gate":
            log.skipped.append((n, "a CDP gate refusal, not a host decision"))
            continue
        if rec["reason"] == "quiet_denials":
            hosts = rec.get("hosts")
            if not isinstance(hosts, dict):
                log.skipped.append((n, "quiet_denials without hosts"))
                continue
            for host, count in hosts.items():
                if isinstance(host, str) and host and isinstance(count, int) and count > 0:
                    log.requests.append(LoggedRequest(n, run, host, None, "deny", "quiet_denials",
                                                      None, None, count))
            continue
        host, port = rec.get("host"), rec.get("port")
        if not isinstance(host, str) or not host or (port is not None and (
                not isinstance(port, int) or isinstance(port, bool))):
            log.skipped.append((n, "no host or a bad port"))
            continue
        rule = rec.get("rule") if isinstance(rec.get("rule"), str) else None
        addr = rec.get("addr") if isinstance(rec.get("addr"), str) else None
        log.requests.append(LoggedRequest(n, run, host, port, rec["decision"], rec["reason"],
                                          rule, addr))
        # The run's own allow_domains are not logged, but every allowed_by_run line names the
        # pattern that allowed it ("SOURCE PATTERN"): replay keeps those patterns for the run.
        if rec["reason"].endswith("allowed_by_run") and rule:
            pattern = rule.rsplit(" ", 1)[-1]
            known = log.run_allow.setdefault(run, [])
            if pattern not in known:
                known.append(pattern)
    return log


class ChangeRecord(TypedDict):
    """`Change.as_dict()`."""

    host: str
    port: int | None
    change: str
    before: str
    after: str
    count: int


class SkippedRecord(TypedDict):
    line: int
    why: str


class ReplayRecord(TypedDict):
    """`Replay.as_dict()`: the shape of `sfguard policy replay --json`."""

    total: int
    unchanged: int
    kept: int
    counts: dict[str, int]
    changes: list[ChangeRecord]
    skipped: list[SkippedRecord]


@dataclass(frozen=True)
class Change:
    host: str
    port: int | None
    kind: str            # "allow->deny" | "deny->allow" | "reason"
    before: str          # reason before
    after: str           # reason after
    count: int

    def as_dict(self) -> ChangeRecord:
        return {"host": self.host, "port": self.port, "change": self.kind, "before": self.before,
                "after": self.after, "count": self.count}


@dataclass
class Replay:
    total: int = 0
    unchanged: int = 0
    kept: int = 0                      # connect-time refusals that a host policy cannot change
    changes: list[Change] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c: Counter[str] = Counter()
        for ch in self.changes:
            c[ch.kind] += ch.count
        return {"allow->deny": c["allow->deny"], "deny->allow": c["deny->allow"],
                "reason": c["reason"]}

    def as_dict(self) -> ReplayRecord:
        return {"total": self.total, "unchanged": self.unchanged, "kept": self.kept,
                "counts": self.counts(), "changes": [c.as_dict() for c in self.changes],
                "skipped": [{"line": n, "why": why} for n, why in self.skipped]}


def redecide(p: SitePolicy, req: LoggedRequest, allow: RuleSet | None) -> tuple[str, str] | None:
    """(decision, reason) of `p` for a logged request, or None when the logged answer was a
    connect-time refusal (SNI, Host header, credentials, ...) that `p` would not reach."""
    d = p.decide(req.host, req.port, allow)
    base = req.reason.removeprefix("would_deny:")
    if d.allowed and not d.would_deny:
        if req.addr:
            d = p.check_address(d, req.addr)
        elif base not in HOST_REASONS and base != "quiet_denials" and base != "private_address":
            return None
    return d.decision, d.reason


def replay(log: DecisionLog, candidate: SitePolicy, extra_allow: list[str] | None = None,
           baseline: SitePolicy | None = None) -> Replay:
    """Re-decide every logged request under `candidate` and list what changes, per host.

    The "before" side is what was logged, or, with `baseline`, what `baseline` decides (that is
    how `policy diff --log` compares two policies on the same traffic). A run's allow_domains
    are the patterns its allowed_by_run lines name, plus `extra_allow`."""
    out = Replay(skipped=list(log.skipped))
    groups: dict[tuple[str, int | None, str, str, str], int] = {}
    cache: dict[str | None, RuleSet | None] = {}
    for req in log.requests:
        out.total += req.count
        if req.run not in cache:
            patterns = list(log.run_allow.get(req.run, [])) + list(extra_allow or [])
            try:
                cache[req.run] = compile_patterns(patterns, source="allow_domains") if patterns else None
            except PolicyError:
                cache[req.run] = compile_patterns(list(extra_allow or []), source="allow_domains") \
                    if extra_allow else None
        allow = cache[req.run]
        if baseline is None:
            before = (req.decision, req.reason)
        else:
            before = redecide(baseline, req, allow) or (req.decision, req.reason)
        after = redecide(candidate, req, allow)
        if after is None:
            out.kept += req.count
            continue
        if before[0] == after[0] and _same_reason(before[1], after[1]):
            out.unchanged += req.count
            continue
        kind = "reason" if before[0] == after[0] else f"{before[0]}->{after[0]}"
        key = (req.host, req.port, kind, before[1], after[1])
        groups[key] = groups.get(key, 0) + req.count
    out.changes = [Change(h, p, k, b, a, n) for (h, p, k, b, a), n in groups.items()]
    order = {"allow->deny": 0, "deny->allow": 1, "reason": 2}
    out.changes.sort(key=lambda c: (order[c.kind], -c.count, c.host, c.port or 0))
    return out


def _same_reason(a: str, b: str) -> bool:
    # quiet denials are logged without their reason; any denial reason matches them
    return a == b or "quiet_denials" in (a, b)
