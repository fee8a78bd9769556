"""The effective write mode of a stage per allowed host pattern: the stricter of the stage's
`browser.writes` and the site policy's floor for that host (policy.writes.effective)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from sfguard.policy.errors import MalformedHost, PolicyError
from sfguard.policy.hosts import split_host_port_raw
from sfguard.policy.index import compile_patterns
from sfguard.policy.writes import WriteRules, effective, stricter


def _base_host(pattern: str) -> tuple[str, int | None]:
    try:
        host, port = split_host_port_raw(pattern)
    except MalformedHost:
        host, port = pattern, None
    return (host[2:] if host.startswith("*.") else host), (int(port) if port and port.isdigit() else None)


def stage_write_modes(site_policy: Any, stage_mode: str, patterns: list[str]) -> dict[str, str]:
    """{pattern: mode} for the stage's allow_domains (what the runner tells the agent), plus the
    site policy's floors on hosts inside them (`*.example.com` allow, `pay.example.com` gate)."""
    rules = getattr(site_policy, "writes", None) or WriteRules()
    out: dict[str, str] = {}
    for pattern in patterns:
        host, port = _base_host(pattern)
        out[pattern] = effective(stage_mode, rules.floor(host, port)).mode
    if rules.guarded() and patterns:
        with contextlib.suppress(PolicyError, ValueError):
            allowed = compile_patterns(list(patterns), "allow_domains")
            for entry in rules.guarded():
                for pattern in entry.patterns:
                    host, port = _base_host(pattern)
                    if pattern not in out and allowed.match(host, ":" in host or host.replace(".", "").isdigit(),
                                                            port) is not None:
                        out[pattern] = stricter(stage_mode, entry.mode)
    return out


def decision_recorder(path: Any) -> Callable[[str, dict[str, object]], None]:
    """Write decisions into the guard's decision log (beside the proxies' host decisions):
    client `writes:STAGE`, decision write_allowed|refused|held|approved|denied|timeout, with the
    write's stage, attempt, port, path (query hidden), the rule and the approval id."""
    from sfguard.proxy_addons.decision_log import DecisionLog  # noqa: PLC0415
    log = DecisionLog(str(path))

    def record(_decision: str, rec: dict[str, object]) -> None:
        extra = {k: rec[k] for k in ("stage", "attempt", "path", "approval", "by") if rec.get(k) is not None}
        port = rec.get("port")
        log.write(run=str(rec["run"]), client=f"writes:{rec.get('stage')}", method=str(rec["method"]),
                  host=str(rec["host"]), port=port if isinstance(port, int) else None, decision=str(rec["decision"]),
                  reason=str(rec["reason"]), rule=str(rec["rule"]) if rec.get("rule") else None, addr=None,
                  extra=extra)
    return record


def guard_writes(run: Any, browser: Any, stage: Any, approver: Any, timeout: float,
                 record: Callable[[str, dict[str, object]], None] | None = None,
                 rules: Callable[[], WriteRules] | None = None,
                 owner: Callable[[Any], str | None] | None = None) -> None:
    """Install (or widen) the write gate on the browser's pipe: per host, the strictest mode of
    the stages that use this browser (a request is not always known to belong to one stage:
    workers, service workers; fail closed). Nothing is installed while every mode is allow."""
    from sfguard.supervisor.writes.intercept import StageWrites, WriteContext, WriteInterceptor  # noqa: PLC0415

    pipe = browser.anchor.pipe
    current = pipe.writes
    modes = browser_modes(run, browser, stage)
    # replay_safe: false: every write of the stage is watched; once one was sent, a retry's are held
    replay_unsafe = not getattr(stage, "replay_safe", True)
    history = run.released_writes.setdefault(stage.stage_id, [])
    earlier = tuple(history) if replay_unsafe and stage.attempt > 1 else ()
    floors = bool(rules().guarded()) if rules is not None else False
    if current is None and not replay_unsafe and not floors and all(m == "allow" for m in modes.values()):
        return
    if current is None:
        profile = browser.profile.name if browser.profile else ""
        current = pipe.writes = WriteInterceptor(
            pipe, WriteContext(run.run_id, profile, stage.stage_id, stage.attempt, modes),
            rules=rules, approver=approver, timeout=timeout, record=record)
    else:
        current.ctx.stage_id, current.ctx.attempt = stage.stage_id, stage.attempt
        current.set_modes(modes)
    # each stage's own part (a request from its tab is judged by it alone); stages that left
    # the browser are dropped; what no stage owns is judged by the strictest of them all
    current.stages = {sid: sw for sid, sw in current.stages.items() if sid in browser.stages}
    current.stages[stage.stage_id] = StageWrites(stage.stage_id, stage.attempt, dict(stage.write_modes),
                                                 replay_unsafe, earlier, history)
    for sid in browser.stages:      # stages attached while nothing needed a gate: all allow
        other = run.stages.get(sid)
        if sid not in current.stages and other is not None:
            current.stages[sid] = StageWrites(sid, other.attempt, dict(other.write_modes),
                                              not getattr(other, "replay_safe", True), (),
                                              run.released_writes.setdefault(sid, []))
    if owner is not None:
        current.owner = owner
    current.ctx.replay_unsafe = any(sw.replay_unsafe for sw in current.stages.values())
    current.ctx.earlier = next((sw.earlier for sw in current.stages.values() if sw.earlier), ())
    current.released = history          # what this attempt sends is the next attempt's `earlier`
    pipe.apply_write_patterns()


def browser_modes(run: Any, browser: Any, stage: Any = None) -> dict[str, str]:
    """The write mode per host pattern of a browser: the strictest of the stages that use it now
    (`stage` too), whichever of them names the pattern. A write follows its host, whoever sends it."""
    modes: dict[str, str] = {}
    users = [run.stages[sid] for sid in sorted(browser.stages) if sid in run.stages]
    for st in users + ([stage] if stage is not None and stage not in users else []):
        for pattern, mode in st.write_modes.items():
            modes[pattern] = stricter(modes.get(pattern, "allow"), mode)
    return modes


def stage_left(run: Any, browser: Any) -> None:
    """A stage left the browser (it ended): the write gate keeps the modes of the stages that
    are still there, and the browser's interception and WebSocket rules follow."""
    from sfguard.supervisor.writes.websockets import schedule_websockets  # noqa: PLC0415
    pipe = getattr(browser.anchor, "pipe", None) if browser.anchor is not None else None
    writes = getattr(pipe, "writes", None) if pipe is not None else None
    if pipe is None or writes is None:
        return
    writes.stages = {sid: sw for sid, sw in writes.stages.items() if sid in browser.stages}
    writes.set_modes(browser_modes(run, browser))
    pipe.apply_write_patterns()
    schedule_websockets(browser.anchor)


def rewire_writes(runs: Any, site_policy: Any, approver: Any, timeout: float,
                  record: Callable[[str, dict[str, object]], None] | None,
                  rules: Callable[[], WriteRules]) -> None:
    """After a policy reload: every live browser's write modes from its stages again, from
    scratch (a floor the reviewers loosened loosens too), the gate installed where a new floor
    needs one, and its Fetch patterns and WebSocket rules re-applied. Each paused request is
    judged against the live policy anyway; this keeps the patterns (what pauses at all) in step
    with it."""
    from sfguard.supervisor.writes.websockets import schedule_websockets  # noqa: PLC0415
    for run in runs:
        for browser in list(run.browsers.values()):
            pipe = getattr(browser.anchor, "pipe", None) if browser.anchor is not None else None
            stages = [run.stages[s] for s in sorted(browser.stages) if s in run.stages]
            if pipe is None or not stages:
                continue
            for stage in stages:
                stage.write_modes = stage_write_modes(site_policy, stage.browser_req.writes,
                                                      list(stage.browser_req.allow_domains))
            if pipe.writes is not None:
                pipe.writes.set_modes({})
            for stage in stages:
                guard_writes(run, browser, stage, approver, timeout, record, rules)
            schedule_websockets(browser.anchor)     # the WebSocket rules follow (websockets.py)
