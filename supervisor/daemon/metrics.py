"""The guard's Prometheus metrics (`GET /metrics`, text format 0.0.4).

Served on the control API (the unix socket, 0600, and the TCP listener with its bearer token)
and on the operator console for a signed-in console session; never without authentication.

Two kinds of figures:
- events the guard counts as they happen (stage start latency, lease waits, login checks,
  browser and proxy restarts, webhook deliveries);
- state read at scrape time: runs and stages by state, lease queues, open handoffs, pending
  approvals and the oldest wait, the guard's process tree by kind and its resident memory,
  free disk space of the home and the runtime folder, the policy's and the audit chain's state
  (supervisor/daemon/audit_watch.py), the version, and the decisions of the run proxies, read
  from the decision log (a decision is on disk before its answer, so the log is the source).

Labels are bounded: decision outcome and reason code (a closed set), states, process kinds,
`home`/`runtime`. Never a host, run id, profile or path: those would grow without end.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("sfguard.metrics")
# no `*_created` series: in the 0.0.4 text format they read as extra gauges, and a scraper
# has the guard's start time in sfguard_start_time_seconds
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: below this much free space in the home or the runtime folder, `disk_low` (status, doctor)
DISK_LOW_BYTES = 512 * 1024 * 1024
#: decision-log bytes read per scrape at most (the rest is read by the next scrape)
DECISION_READ_LIMIT = 16 * 1024 * 1024
#: a line longer than this is not a decision (skipped)
MAX_DECISION_LINE = 64 * 1024
STAGE_START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)


#: how long a rotated-away decision log is still read: its writers reopen within a second
ROTATED_GRACE_S = 5.0
#: rotated files looked at when following rotations (the files between two scrapes)
MAX_ROTATED_FOLLOW = 1000


class _Reader:
    """One open file of the decision log and its unfinished last line."""

    def __init__(self, fh: Any):
        self.fh, self.partial, self.left_at = fh, b"", 0.0


class DecisionTail:
    """Counts the decision log's lines by (decision, reason) from where it stood when the guard
    started. It keeps its files open and follows rotations by inode: when the live name points
    to another file, every file rotated after the one it was reading (NAME.k ... NAME.1) and the
    new live one are read from their start, however many rotations happened between two scrapes.
    A rotated-away file is still read for a few seconds (a writer may append to it until it
    reopens the name), so no line is missed."""

    def __init__(self, path: Path):
        self.path = path
        self.counts: Counter[tuple[str, str]] = Counter()
        self._cur: _Reader | None = None
        self._old: list[_Reader] = []
        # with no live file at start, the newest rotated one (if any) is where new files begin
        self._before: tuple[int, int] | None = None
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 (kept open between scrapes)
        except OSError:
            try:
                st = os.stat(self._rotated_name(1))
                self._before = (st.st_ino, st.st_dev)
            except OSError:
                pass
            return
        fh.seek(0, os.SEEK_END)
        self._cur = _Reader(fh)

    def _rotated_name(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def _drain(self, r: _Reader) -> bool:
        """Count the complete lines `r` has gained; True when it reached the end of its file."""
        budget = DECISION_READ_LIMIT
        while budget > 0:
            data = r.fh.read(min(1024 * 1024, budget))
            if not data:
                return True
            budget -= len(data)
            lines = (r.partial + data).split(b"\n")
            r.partial = lines.pop()           # an unfinished last line waits for its end
            if len(r.partial) > MAX_DECISION_LINE:
                r.partial = b""
            for line in lines:
                self._count(line)
        return False

    def _count(self, line: bytes) -> None:
        if not line or len(line) > MAX_DECISION_LINE:
            return
        try:
            rec = json.loads(line)
        except ValueError:
            return
        if isinstance(rec, dict) and isinstance(rec.get("decision"), str):
            reason = rec.get("reason")
            self.counts[(rec["decision"][:32], reason[:64] if isinstance(reason, str) else "")] += 1

    @staticmethod
    def _ident(fh: Any) -> tuple[int, int]:
        st = os.fstat(fh.fileno())
        return st.st_ino, st.st_dev

    def _newer_files(self) -> list[Any]:
        """Open the files newer than the one being read, oldest first: the rotated ones
        (NAME.k ... NAME.1) down to ours, then the live one if it exists (it may be missing
        for a moment: renamed, not yet recreated by a writer)."""
        known = self._ident(self._cur.fh) if self._cur is not None else self._before
        found: list[Any] = []
        seen: set[tuple[int, int]] = set()
        for i in range(MAX_ROTATED_FOLLOW + 1):
            try:
                fh = open(self.path if i == 0 else self._rotated_name(i), "rb")  # noqa: SIM115
            except OSError:
                if i == 0:
                    continue                   # no live file just now: the rotated ones still count
                break                          # the rotated names end (ours was removed by keep)
            ident = self._ident(fh)
            if ident == known:
                fh.close()
                break
            if ident in seen:                  # rotated again while listing: seen already
                fh.close()
                continue
            seen.add(ident)
            found.append(fh)
        found.reverse()
        return found

    def read(self) -> Counter[tuple[str, str]]:
        now = time.monotonic()
        for r in list(self._old):
            if self._drain(r) and now - r.left_at > ROTATED_GRACE_S:
                r.fh.close()
                self._old.remove(r)
        if self._cur is not None:
            self._drain(self._cur)
        newer = self._newer_files()
        if newer:
            if self._cur is not None:
                self._cur.left_at = now
                self._old.append(self._cur)
            *rotated_files, newest = newer
            for fh in rotated_files:
                r = _Reader(fh)
                r.left_at = now
                self._old.append(r)
                self._drain(r)
            self._cur = _Reader(newest)        # the live file, or the newest rotated one
            self._drain(self._cur)
        return self.counts

    def close(self) -> None:
        for r in [*self._old, *([self._cur] if self._cur else [])]:
            r.fh.close()
        self._old, self._cur = [], None


def sfguard_version() -> str:
    """The installed sfguard's version (sfguard_build_info, status), as `sfguard --version` says it."""
    import importlib.metadata
    try:
        return importlib.metadata.version("sfguard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def process_kind(proc: psutil.Process) -> str:
    """browser, agent_browser, proxy or other: what a process of the guard's tree is."""
    try:
        name = proc.name().lower()
        cmd = " ".join(proc.cmdline()[:4])
    except psutil.Error:
        return "other"
    if "proxy_child" in cmd or "proxy_zygote" in cmd:
        return "proxy"
    if "agent-browser" in name or "agent-browser" in cmd:
        return "agent_browser"
    if "chrom" in name:
        return "browser"
    return "other"


def disk_free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class GuardMetrics:
    """What one guard counts, and the collector that reads its state at scrape time.

    A scrape is `snapshot(guard)` on the event loop (in-memory state only: runs, stages,
    handoffs, policy), then `render(snapshot)` off it (decision-log tail, process table, disk,
    the audit chain when its last check is old)."""

    #: the Content-Type of `render`'s text (the console serves it too, through the guard)
    content_type = CONTENT_TYPE

    def __init__(self, decision_log: Path, version: str = "unknown"):
        self.registry = CollectorRegistry(auto_describe=True)
        self.version = version
        self.stage_start = Histogram(
            "sfguard_stage_start_seconds", "Time from a stage's request (or its lease grant) to ready",
            buckets=STAGE_START_BUCKETS, registry=self.registry)
        self.lease_waits = PromCounter(
            "sfguard_lease_waits", "Stage requests that had to queue for a profile held by another run",
            registry=self.registry)
        self.login_checks = PromCounter(
            "sfguard_login_checks", "Login checks by result", ["result"], registry=self.registry)
        for result in ("logged_in", "logged_out", "failed"):
            self.login_checks.labels(result=result)
        self.restarts = PromCounter(
            "sfguard_restarts", "Browsers and run proxies that died and were restarted by the watchdog",
            ["kind"], registry=self.registry)
        for kind in ("browser", "proxy"):
            self.restarts.labels(kind=kind)
        self.webhooks = PromCounter(
            "sfguard_webhook_deliveries", "Webhook deliveries by result (failed: given up after retrying)",
            ["result"], registry=self.registry)
        for result in ("delivered", "failed"):
            self.webhooks.labels(result=result)
        self.webhook_attempt_failures = PromCounter(
            "sfguard_webhook_attempt_failures", "Webhook attempts that failed (each retry counts)",
            registry=self.registry)
        self.decisions = DecisionTail(decision_log)
        self._snap: dict[str, Any] | None = None
        self._render_lock = threading.Lock()    # one scrape at a time reads the snapshot
        self.registry.register(_StateCollector(self))

    def stage_ready(self, seconds: float) -> None:
        self.stage_start.observe(seconds)

    def lease_waited(self) -> None:
        self.lease_waits.inc()

    def login_checked(self, result: str) -> None:
        self.login_checks.labels(result=result).inc()

    def restarted(self, kind: str) -> None:
        """A `browser` or a run `proxy` died and the watchdog restarted it."""
        self.restarts.labels(kind=kind).inc()

    def webhook_delivered(self, result: str) -> None:
        self.webhooks.labels(result=result).inc()

    def webhook_attempt_failed(self) -> None:
        self.webhook_attempt_failures.inc()

    @staticmethod
    def snapshot(guard: Any) -> dict[str, Any]:
        """What the scrape needs of the guard's memory (on the event loop: no I/O)."""
        from sfguard.supervisor.daemon.runs import StageState
        from sfguard.supervisor.daemon.waiting import pending_approvals, waiting_handoffs
        runs = list(guard.runs.values())
        stages = [s for r in runs for s in r.stages.values()]
        approvals, handoffs = pending_approvals(guard), waiting_handoffs(guard)
        watch = guard.audit_watch
        return {"runs": Counter(str(r.state) for r in runs),
                "stages": Counter(str(s.state) for s in stages),
                "queued": sum(1 for s in stages if s.state == StageState.WAITING),
                "handoffs_open": len(handoffs), "approvals_pending": len(approvals),
                "oldest": {"approval": approvals[0]["age_s"] if approvals else 0.0,
                           "handoff": handoffs[0]["age_s"] if handoffs else 0.0},
                "policy_invalid": bool(guard.policy_error), "started": guard.started,
                "disk": {"home": guard.home, "runtime": guard.runtime},
                "audit_ok": watch.ok, "audit_interval": watch.interval}

    def render(self, snapshot: dict[str, Any]) -> bytes:
        """The text exposition (blocking: call it in a thread)."""
        with self._render_lock:
            self._snap = snapshot
            try:
                return generate_latest(self.registry)
            finally:
                self._snap = None


class _StateCollector(Collector):
    def __init__(self, metrics: GuardMetrics):
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self.m._snap
        if snap is None:
            return
        yield from self._decisions()
        yield from self._runs(snap)
        yield from self._processes()
        yield from self._disk(snap)
        yield from self._health(snap)

    def _decisions(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("sfguard_decisions", "Proxy and gate decisions since the guard started",
                                  labels=["decision", "reason"])
        for (decision, reason), n in sorted(self.m.decisions.read().items()):
            fam.add_metric([decision, reason], n)
        yield fam

    def _runs(self, snap: dict[str, Any]) -> Iterator[Metric]:
        from sfguard.supervisor.daemon.runs import RunState, StageState
        runs = GaugeMetricFamily("sfguard_runs", "Runs the guard holds, by state", labels=["state"])
        stages = GaugeMetricFamily("sfguard_stages", "Stages of held runs, by state", labels=["state"])
        for state in RunState:
            runs.add_metric([str(state)], snap["runs"].get(str(state), 0))
        for sstate in StageState:
            stages.add_metric([str(sstate)], snap["stages"].get(str(sstate), 0))
        yield runs
        yield stages
        yield GaugeMetricFamily("sfguard_lease_queue_depth", "Stages waiting for a profile lease",
                                value=snap["queued"])
        yield GaugeMetricFamily("sfguard_handoffs_open", "Login handoffs (live views and local windows) "
                                "waiting for a person", value=snap["handoffs_open"])
        yield GaugeMetricFamily("sfguard_approvals_pending", "Writes held for a person's approval",
                                value=snap["approvals_pending"])
        oldest = GaugeMetricFamily("sfguard_oldest_pending_seconds", "How long the oldest pending "
                                   "approval or open login handoff has waited (0: none)", labels=["kind"])
        for kind, age in sorted(snap["oldest"].items()):
            oldest.add_metric([kind], age)
        yield oldest

    def _processes(self) -> Iterator[Metric]:
        count = GaugeMetricFamily("sfguard_processes", "Processes of the guard's tree, by kind", labels=["kind"])
        rss = GaugeMetricFamily("sfguard_process_resident_memory_bytes",
                                "Resident memory of the guard's tree, by kind (shared pages counted "
                                "in every process)", labels=["kind"])
        counts: Counter[str] = Counter()
        sizes: Counter[str] = Counter()
        me = psutil.Process()
        try:
            tree = [(me, "guard")] + [(p, process_kind(p)) for p in me.children(recursive=True)]
        except psutil.Error:
            tree = [(me, "guard")]
        for proc, kind in tree:
            try:
                sizes[kind] += proc.memory_info().rss
            except psutil.Error:
                continue
            counts[kind] += 1
        for kind in ("guard", "proxy", "browser", "agent_browser", "other"):
            count.add_metric([kind], counts.get(kind, 0))
            rss.add_metric([kind], sizes.get(kind, 0))
        yield count
        yield rss

    def _disk(self, snap: dict[str, Any]) -> Iterator[Metric]:
        free = GaugeMetricFamily("sfguard_disk_free_bytes", "Free space where the guard writes",
                                 labels=["folder"])
        low = GaugeMetricFamily("sfguard_disk_low", f"1 when free space is under {DISK_LOW_BYTES} bytes",
                                labels=["folder"])
        for label, path in snap["disk"].items():
            value = disk_free(path)
            if value is None:
                continue
            free.add_metric([label], value)
            low.add_metric([label], 1 if value < DISK_LOW_BYTES else 0)
        yield free
        yield low

    def _health(self, snap: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("sfguard_policy_edit_invalid",
                                "1 while the policy file holds an invalid edit (the last good policy is in force)",
                                value=1 if snap["policy_invalid"] else 0)
        ok = snap["audit_ok"]
        if ok is not None:
            yield GaugeMetricFamily("sfguard_audit_chain_ok", "1 when the audit chain verifies (checked "
                                    f"every {snap['audit_interval']:.0f} s)", value=1 if ok else 0)
        yield GaugeMetricFamily("sfguard_start_time_seconds", "When the guard started (Unix time)",
                                value=snap["started"])
        info = GaugeMetricFamily("sfguard_build_info", "The running sfguard's version (always 1)",
                                 labels=["version"])
        info.add_metric([self.m.version], 1)
        yield info
