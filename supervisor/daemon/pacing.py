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

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sfguard.policy.errors import MalformedHost
from sfguard.policy.hosts import normalize_host, split_host_port_raw
from sfguard.policy.pace import DELAY_LOGGED, Budget, HostPace, Rate, effective
from sfguard.proxy_addons.clients import parse_budgets
from sfguard.proxy_addons.decision_log import DecisionLog
from sfguard.proxy_addons.pacing import FilePaceStore, MemoryPaceStore, Pacer, StageBudget, budget_keys
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


# ------------------------------------------------------------------------------- page loads

#: a stage's commands that start a navigation: to the address in their params ("url"), or (None)
#: again to their tab's own (reload, history)
NAVIGATIONS: dict[str, str | None] = {"Page.navigate": "url", "Target.createTarget": "url",
                                      "Page.reload": None, "Page.navigateToHistoryEntry": None}
#: seconds a navigation command's counted page load waits for its commit
RESERVED_S = 30.0


def _https_host(url: str) -> tuple[str, int] | None:
    """The normalised host and port of an https:// address (http:// page loads are the proxy's)."""
    try:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            return None
        return normalize_host(parts.hostname), parts.port or 443
    except (ValueError, MalformedHost):
        return None


class PageLoads:
    """Page loads of HTTPS sites, kept in the browser: inside TLS the proxy sees connections, not
    pages (docs/threat-model.md, "Pacing"). On the same counters as the proxy (the profile's,
    `<home>/pace` or the shared store), with the same limits:

    - a stage's navigation command (`open`, a new tab with an address, `reload`, `back`) takes
      its page load before it is sent: it waits (bounded) or is answered with the 429 text; the
      commit that follows is not counted again;
    - any other page load of a tab (a click, a form, a script, a redirect) is counted when the
      guard's pipe sees it commit. One over the pace makes the stage's commands to that tab wait
      until the pace has room again (bounded, then the 429 text); one further over than a wait
      allows (a page that navigates by itself faster than the pace), or over the stage's budget,
      closes the tab.
    Each refusal, each wait of 0.25 s or more and each closed tab is a decision line."""

    NAVIGATIONS = NAVIGATIONS

    def __init__(self, runs: dict[str, Run], site_policy: Callable[[], SitePolicy], setting: Any,
                 gate: Any = None) -> None:
        folder, url, log_path = (getattr(setting, name, None) for name in ("folder", "shared_url", "decision_log"))
        local = FilePaceStore(folder) if folder is not None else MemoryPaceStore()
        shared = None
        if url:
            from sfguard.supervisor.profiles.pg_pace import PgPaceStore  # noqa: PLC0415
            shared = PgPaceStore(url)
        self.pacer = Pacer(shared, local)
        self.runs, self.site_policy, self.gate = runs, site_policy, gate
        self.log = DecisionLog(str(log_path)) if log_path is not None else None
        self.reserved: dict[int, list[float]] = {}        # id(pipe) -> times of counted navigations
        #: tabs over the pace: targetId -> (until, the wait's limit, its rule, the refusal text)
        self.marked: dict[str, tuple[float, float, str, str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watched: set[int] = set()                  # id(pipe) of the browsers watched

    def _stage(self, key: str) -> tuple[Run, Stage, Browser] | None:
        parts = key.split("/")
        run = self.runs.get(parts[0]) if len(parts) == 3 else None
        stage = run.stages.get(parts[1]) if run is not None else None
        browser = run.browsers.get(stage.browser_key or "") if run is not None and stage is not None else None
        return (run, stage, browser) if run is not None and stage is not None and browser is not None else None

    def _counters(self, run: Run, browser: Browser, url: str) -> tuple[str, list[StageBudget], HostPace] | None:
        """Whose counters a page load of `url` in `browser` counts on, or None (not paced)."""
        where = _https_host(url)
        if where is None:
            return None
        found = self.site_policy().pace.pace(*where)
        budgets = [b for b in parse_budgets(browser_budgets(run, browser))
                   if b.budget.page_loads is not None or b.budget.page_loads_per_minute is not None]
        if not found.page_loads and not budgets:
            return None
        return pace_key(run, browser), budgets, found

    async def command(self, stage_key: str, method: str, params: dict[str, Any], tab: str | None,
                      tab_url: str, pipe: Any) -> str | None:
        """Before the gate sends a stage's command: None to send it (after any wait), or the
        error text to answer it with."""
        mark = self.marked.get(tab) if tab is not None else None
        if tab is not None and mark is not None:
            left = mark[0] - time.time()
            if left > mark[1]:
                return f"{mark[3]} Try again in {max(1, int(left + 0.999))} s."
            if left > 0:
                self._line(stage_key, "delay", "pace", mark[2], tab_url, wait_ms=int(left * 1000))
                await asyncio.sleep(left)
            self.marked.pop(tab, None)
        if method not in NAVIGATIONS:
            return None
        found = self._stage(stage_key)
        url = str(params.get("url") or "") if NAVIGATIONS[method] else tab_url
        counters = self._counters(found[0], found[2], url) if found is not None else None
        if counters is None:
            return None
        who, budgets, host_pace = counters
        verdict = await self.pacer.admit(who, budgets, host_pace, page_load=True, request=False)
        if verdict.refusal is not None:
            self._line(stage_key, "deny", verdict.refusal.reason, verdict.refusal.rule, url)
            return verdict.refusal.explanation
        if verdict.wait > 0:
            if verdict.wait >= DELAY_LOGGED and verdict.limit is not None:
                self._line(stage_key, "delay", verdict.limit.reason, verdict.limit.rule, url,
                           wait_ms=int(verdict.wait * 1000))
            await asyncio.sleep(verdict.wait)
        self.reserved.setdefault(id(pipe), []).append(time.time())
        return None

    def watch(self, run: Run, browser: Browser) -> None:
        """Count `browser`'s page loads from now on (once per browser; at each stage's attach)."""
        pipe = browser.anchor.pipe if browser.anchor is not None else None
        if pipe is None or id(pipe) in self._watched:
            return
        self._watched.add(id(pipe))
        task = asyncio.get_running_loop().create_task(self._watch(run, browser, pipe))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _t: self._watched.discard(id(pipe)))

    async def _watch(self, run: Run, browser: Browser, pipe: Any) -> None:
        """A session of the guard's own in every page of the browser (a stage cannot switch it
        off), with the Page domain on: each main-frame commit (`Page.frameNavigated`: a new
        document, reloads included; same-document changes are another event) is a page load."""
        client = pipe.client("pace: page loads")
        ids = itertools.count(1)
        sessions: dict[str, str] = {}          # sessionId -> targetId

        async def send(method: str, params: dict[str, Any] | None = None, session: str | None = None) -> None:
            await client.send({"id": next(ids), "method": method, "params": params or {}}
                              | ({"sessionId": session} if session else {}))
        with swallowed(log, f"run {run.run_id}: counting its browser's page loads", (OSError, RuntimeError)):
            await send("Target.setDiscoverTargets", {"discover": True})
            while (text := await client.recv()) is not None:
                data = json.loads(text)
                method, params, sid = data.get("method"), data.get("params") or {}, data.get("sessionId")
                info = params.get("targetInfo") or {}
                if method == "Target.targetCreated" and info.get("type") == "page":
                    await send("Target.attachToTarget", {"targetId": info.get("targetId"), "flatten": True})
                elif method == "Target.attachedToTarget" and isinstance(params.get("sessionId"), str):
                    sessions[params["sessionId"]] = str(info.get("targetId"))
                    await send("Page.enable", session=params["sessionId"])
                elif method == "Target.detachedFromTarget":
                    sessions.pop(str(params.get("sessionId")), None)
                elif method == "Page.frameNavigated" and sid in sessions:
                    frame = params.get("frame") or {}
                    if not frame.get("parentId") and _https_host(str(frame.get("url") or "")) is not None:
                        await self._count(run, browser, pipe, sessions[sid], str(frame.get("url")))
        await client.close()

    async def _count(self, run: Run, browser: Browser, pipe: Any, target: str, url: str) -> None:
        counters = self._counters(run, browser, url)
        if counters is None:
            return
        now = time.time()
        waiting = [t for t in self.reserved.get(id(pipe), []) if now - t < RESERVED_S]
        if waiting:                       # a navigation command counted it before it was sent
            self.reserved[id(pipe)] = waiting[1:]
            return
        who, budgets, host_pace = counters
        verdict = await self.pacer.admit(who, budgets, host_pace, page_load=True, request=False, force=True)
        owner = self.gate.stage_of_target(pipe, target) if self.gate is not None else None
        stage_key = owner or f"{run.run_id}/(no stage)/0"
        limit = verdict.limit
        hard = (limit.wait_limit + limit.interval) if isinstance(limit, Rate) else 0.0
        if verdict.refusal is not None or (limit is not None and verdict.due > hard):
            rule = verdict.refusal.rule if verdict.refusal is not None else getattr(limit, "rule", None)
            reason = verdict.refusal.reason if verdict.refusal is not None else "pace"
            self._line(stage_key, "deny", reason, rule, url, closed_tab=True)
            with swallowed(log, "closing a tab over the pace"):
                await pipe.call("Target.closeTarget", {"targetId": target}, timeout=5)
            log.warning("run %s: closed a tab that loaded pages over the %s (%s)", run.run_id, reason, rule,
                        extra={"run": run.run_id})
        elif verdict.due > 0 and isinstance(limit, Rate):
            text = (f"sfguard: 429 over the site's pace: {limit.explanation} ({limit.rule}); this tab loaded a "
                    "page over it, so its commands wait. Slow down; do not retry another way.")
            self.marked[target] = (now + verdict.due, limit.wait_limit, limit.rule, text)

    def _line(self, stage_key: str, decision: str, reason: str, rule: str | None, url: str,
              **extra: object) -> None:
        if self.log is None:
            return
        parts = stage_key.split("/")
        where = _https_host(url)
        with swallowed(log, "a pace decision line", (OSError,)):
            self.log.write(run=parts[0], client=f"pace:{parts[1] if len(parts) > 1 else ''}", method="GET",
                           host=where[0] if where else None, port=where[1] if where else None,
                           decision=decision, reason=reason, rule=rule, addr=None,
                           extra={"page_load": True, **extra})

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pacer.shared.close()
        if self.pacer.local is not self.pacer.shared:
            await self.pacer.local.close()
        if self.log is not None:
            self.log.close()
