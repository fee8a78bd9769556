"""The guard's records of runs, stages and browsers, and the stage state machine.

  run ──┬─ one guard proxy (supervisor/daemon/run_proxy.py)
        ├─ one anchor per profile (leased, unsealed, launched through the proxy)
        │    └─ one tab + one CDP-gate token per stage
        └─ one throw-away browser per profile-less stage

`StageState` is the single list of stage states and `STAGE_TRANSITIONS` the single list of
the moves between them; `Stage.move` refuses any other. Records hold no HTTP: a failed
stage keeps a domain error (supervisor/errors.py) that api.py maps.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sfguard.supervisor import models
from sfguard.supervisor.browsers.host import Anchor
from sfguard.supervisor.browsers.login import LoginResult
from sfguard.supervisor.errors import GuardError, IllegalTransition
from sfguard.supervisor.gate.warden import scheme_host
from sfguard.supervisor.procs import ProcRecord
from sfguard.supervisor.protocols import ProfileKey, Waiting
from sfguard.supervisor.states import (
    STAGE_TRANSITIONS,
    WAITING_STATES,
    RunOutcome,
    RunState,
    StageOutcome,
    StageState,
)

if TYPE_CHECKING:
    from sfguard.supervisor.daemon.shared_proxy import AnyRunProxy
    from sfguard.supervisor.stage.sandbox import StageUser


def now_iso(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts if ts is not None else time.time()))


def holder_where(host: str | None, guard: str | None) -> dict[str, Any]:
    """Where a holder runs, for shared stores (local leases name only the run)."""
    return {"holder_host": host, "holder_guard": guard} if guard else {}


@dataclass
class Browser:
    """An anchor (profile) or a throw-away browser, with its proxy client."""
    key: str                                  # profile name, or "tmp-<stage>" for throw-aways
    profile: ProfileKey | None
    headed: bool
    client: str
    anchor: Anchor | None = None
    stages: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restarts: int = 0
    closing: bool = False          # being closed: the watchdog must not restart it
    site: str | None = None        # the site a login handoff shows it for (in its window's title)
    #: a root guard's browser user it runs as, from its first launch until it is closed (its
    #: restarts and relaunches keep it: its profile folder is that user's)
    user: StageUser | None = None

    def public(self) -> dict[str, Any]:
        """The browser as run answers show it: no address but a closed tab's scheme and host."""
        pipe = getattr(self.anchor, "pipe", None) if self.anchor is not None else None
        targets = getattr(pipe, "targets", {}) or {}
        warden = getattr(pipe, "warden", None)
        return {"profile": self.profile.name if self.profile else None, "throwaway": self.profile is None,
                "headed": self.headed, "alive": self.anchor is not None, "stages": sorted(self.stages),
                "restarts": self.restarts,
                "tabs": sorted(scheme_host(str(t.get("url") or "")) for t in list(targets.values())
                               if t.get("type") == "page")[:100],
                "closed_tabs": [scheme_host(u) for u in getattr(warden, "closed", [])][:50],
                "carried": list(getattr(self.anchor, "carried", ()) or ())}


@dataclass
class Stage:
    run_id: str
    stage_id: str
    attempt: int
    browser_req: models.BrowserField
    headed: bool
    state: StageState = StageState.PENDING
    browser_key: str | None = None
    gate_key: str | None = None
    env_full: dict[str, str] | None = None    # with inherited vars; used to close the session
    env: dict[str, str] | None = None         # what the stage gets
    waiting: Waiting | None = None
    store_wait: str | None = None             # why it waits when no holder is known (store away)
    pool_wait: str | None = None              # why it waits for a browser user (all in use)
    outcome: StageOutcome | None = None
    error: GuardError | None = None
    processes: list[ProcRecord] = field(default_factory=list)  # the stage session's daemon
    events: list[dict[str, Any]] = field(default_factory=list)  # what happened to it (browser restarts)
    write_modes: dict[str, str] = field(default_factory=dict)   # effective write mode per allowed pattern
    started: float | None = None               # when it got its browser (its budget's active minutes)
    pace: dict[str, dict[str, Any]] = field(default_factory=dict)   # effective pace per allowed pattern
    budget: dict[str, Any] = field(default_factory=dict)            # its budget as asked, active_until
    replay_safe: bool = True                   # false: a retry's writes wait for a person once one was sent

    def move(self, to: StageState) -> None:
        if to not in STAGE_TRANSITIONS[self.state]:
            raise IllegalTransition(f"stage {self.run_id}/{self.stage_id}: {self.state} -> {to}")
        self.state = to

    def answer(self) -> dict[str, Any]:
        """The stage as the runner sees it: ready (env), waiting (holder, place) or ended; a
        failed stage raises its error."""
        if self.state == StageState.READY:
            return {"state": "ready", "env": self.env, "writes": self.write_modes, "pace": self.pace,
                    "budget": self.budget}
        if self.state == StageState.WAITING and self.waiting is not None:
            w = self.waiting
            since = w.holder_since if w.holder_since is not None else w.queued_since
            return {"state": "waiting", "holder_run": w.holder_run or "", "since": now_iso(since),
                    "position": w.position, **holder_where(w.holder_host, w.holder_guard)}
        if self.state == StageState.WAITING and self.store_wait is not None:
            return {"state": "waiting", "holder_run": "", "since": now_iso(), "position": None,
                    "reason": "store_unreachable", "message": self.store_wait}
        if self.state == StageState.WAITING and self.pool_wait is not None:
            return {"state": "waiting", "holder_run": "", "since": now_iso(), "position": None,
                    "reason": "browser_pool_full", "message": self.pool_wait}
        if self.state in WAITING_STATES:
            return {"state": "waiting", "holder_run": "", "since": now_iso(), "position": None}
        if self.state == StageState.FAILED and self.error is not None:
            raise self.error
        return {"state": "ended", "outcome": self.outcome or ""}


@dataclass
class Run:
    run_id: str
    pipeline: str | None
    created: float
    state: RunState = RunState.ACTIVE
    outcome: RunOutcome | None = None
    stages: dict[str, Stage] = field(default_factory=dict)
    browsers: dict[str, Browser] = field(default_factory=dict)
    proxy: AnyRunProxy | None = None
    workdir: Path | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    problems: list[str] = field(default_factory=list)
    login_results: dict[str, LoginResult] = field(default_factory=dict)  # profile -> last check
    released_writes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # stage -> writes sent
    ended_at: float | None = None

    def public(self) -> dict[str, Any]:
        """The run as API answers and run state show it: names and states, no secrets."""
        return {
            "run_id": self.run_id, "state": self.state, "outcome": self.outcome,
            "created": now_iso(self.created), "pipeline": bool(self.pipeline),
            "ended": now_iso(self.ended_at) if self.ended_at is not None else None,
            "stages": [{"stage_id": s.stage_id, "attempt": s.attempt, "state": s.state,
                        "profile": s.browser_req.profile, "outcome": s.outcome,
                        "holder_run": s.waiting.holder_run
                        if s.state == StageState.WAITING and s.waiting else None,
                        "events": list(s.events)}
                       for s in self.stages.values()],
            "browsers": [b.public() for b in self.browsers.values()],
            "proxy": None if self.proxy is None else {"port": self.proxy.port, "alive": self.proxy.alive(),
                                                       "restarts": self.proxy.restarts},
            "problems": list(self.problems),
        }

    def waiting_stages(self) -> list[Stage]:
        return [st for st in self.stages.values() if st.state == StageState.WAITING]

    def browser_allow(self, browser: Browser) -> list[str]:
        """What `browser` may reach: every allow_domains pattern of the stages it serves."""
        out: set[str] = set()
        for sid in browser.stages:
            st = self.stages.get(sid)
            if st is not None:
                out.update(st.browser_req.allow_domains)
        return sorted(out)
