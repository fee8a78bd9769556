"""Pacing, the guard's side: whose pace a browser and a stage's shell count on, the stages'
budgets as the run's proxy takes them, and what the stage answer shows (policy/pace.py,
proxy_addons/pacing.py; docs/threat-model.md, "Pacing").

- A browser on a profile counts on the profile's pace (`p:SCOPE/NAME`): every run, stage and
  guard host that uses the profile shares its counters. A throw-away browser counts on its own.
- A stage's shell (its proxy credential under `sfguard stage-exec`) counts on its browser's.
- A browser's client carries the budgets of every stage on it (two stages sharing an anchor:
  each request counts against both, since the proxy cannot tell whose tab sent it); a shell's
  client carries its own stage's.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from sfguard.policy.errors import MalformedHost
from sfguard.policy.hosts import split_host_port_raw
from sfguard.policy.pace import Budget, effective
from sfguard.proxy_addons.pacing import FilePaceStore, budget_keys
from sfguard.supervisor.daemon.runs import now_iso
from sfguard.supervisor.errors import swallowed

if TYPE_CHECKING:
    from sfguard.policy.engine import SitePolicy
    from sfguard.supervisor.daemon.runs import Browser, Run, Stage

log = logging.getLogger("sfguard.guard")


def _base_host(pattern: str) -> tuple[str, int | None]:
    """A pattern's host without `*.` and its port (`*.shop.test:8080` -> shop.test, 8080)."""
    try:
        host, port = split_host_port_raw(pattern)
    except MalformedHost:
        host, port = pattern, None
    return (host[2:] if host.startswith("*.") else host), (int(port) if port and port.isdigit() else None)


def pace_key(run: Run, browser: Browser) -> str:
    """Whose pace a browser's requests count on: its profile, or the throw-away browser."""
    if browser.profile is not None:
        return f"p:{browser.profile.scope}/{browser.profile.name}"
    return f"b:{run.run_id}/{browser.key}"


def budget_label(stage: Stage) -> str:
    return f"{stage.run_id}/{stage.stage_id}/{stage.attempt}"


def forget_budget(proxy: object, stage: Stage) -> None:
    """A stage that ended takes its budget's counters with it (its label is never used again:
    a retry is another attempt)."""
    folder = getattr(getattr(proxy, "pace", None), "folder", None)
    if folder is None or stage.browser_req.budget is None:
        return
    with swallowed(log, f"stage {stage.stage_id}: removing its budget's counters", (OSError,)):
        FilePaceStore(folder).forget(budget_keys(budget_label(stage)))


def budget_of(stage: Stage) -> Budget | None:
    field = stage.browser_req.budget
    values = field.model_dump(exclude_none=True) if field is not None else {}
    return Budget(**values) if values else None


def stage_budget(stage: Stage) -> list[dict[str, Any]]:
    """The stage's budget as the proxy takes it (proxy_addons/clients.py parse_budgets); its
    active minutes count from `stage.started`."""
    budget = budget_of(stage)
    if budget is None:
        return []
    started = stage.started if stage.started is not None else time.time()
    until = started + budget.active_minutes * 60 if budget.active_minutes is not None else None
    return [{"label": budget_label(stage), "budget": budget.as_dict(),
             "until": until}]


def browser_budgets(run: Run, browser: Browser) -> list[dict[str, Any]]:
    """The budgets of every stage on `browser` (each counts all of the browser's requests)."""
    out: list[dict[str, Any]] = []
    for sid in sorted(browser.stages):
        stage = run.stages.get(sid)
        if stage is not None:
            out += stage_budget(stage)
    return out


def pace_view(site_policy: SitePolicy, stage: Stage) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """What the stage answer shows: the effective pace per allowed pattern (the site's limits
    and rules, tightened by the budget's rates; the pace entries of hosts inside a wildcard
    pattern listed under their own pattern), and the budget as asked with `active_until`."""
    budget = budget_of(stage)
    rules = site_policy.pace
    out: dict[str, dict[str, Any]] = {}
    patterns = list(stage.browser_req.allow_domains)
    for pattern in patterns:
        host, port = _base_host(pattern)
        eff = effective(rules, budget, host, port)
        if eff:
            out[pattern] = eff
    for pattern in patterns:
        if not pattern.startswith("*."):
            continue
        suffix = "." + pattern[2:].split(":", 1)[0]
        for entry in rules.entries:
            for inner in entry.patterns:
                name = inner[2:] if inner.startswith("*.") else inner
                if inner not in out and name.split(":", 1)[0].endswith(suffix):
                    host, port = _base_host(inner)
                    out[inner] = effective(rules, budget, host, port)
    shown: dict[str, Any] = budget.as_dict() if budget is not None else {}
    if budget is not None and budget.active_minutes is not None and stage.started is not None:
        shown["active_until"] = now_iso(stage.started + budget.active_minutes * 60)
    return out, shown
