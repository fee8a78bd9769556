"""The guard's side of a `live_view` login handoff (issue 16, docs/design.md 4.5).

    POST /v1/runs/RUN/handoff {"profile", "site", "reason", "url", "kind": "live_view"|"auto",
                               "stage_id"?}
      -> {"kind": "live_view", "site", "reason", "url": "http://127.0.0.1:PORT/live/ID?t=TOKEN"}
    GET  /v1/runs/RUN/handoff?wait=S -> {"state": open|done|cancelled|expired|ended, ...}

`open_live` leases the profile's browser (headless is fine), opens a login tab at the page
(`LiveView`) and makes a one-time link scoped to this handoff. The person opens it (the
console's live page), logs in through the frames, then presses Done (the guard runs its own
login check, `verify: login_check`) or Cancel (the stage named by `stage_id` fails). The link
and every session made from it die when the handoff ends: done, cancelled, timed out, its stage
or run ended, or its tab or browser went away. The audit log gets `handoff_opened`,
`handoff_viewed` (by the console session's public id), and `handoff_confirmed` or
`handoff_closed` with the outcome; never frames, text or addresses with queries.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sfguard import policy
from sfguard.supervisor import models
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.handoff import display_refusal
from sfguard.supervisor.console.liveview import TAB_ERRORS, LiveView
from sfguard.supervisor.console.view import RunView
from sfguard.supervisor.errors import BadRequest, Conflict, GuardError, NotFound, Unavailable, swallowed
from sfguard.supervisor.protocols import ProfileError
from sfguard.supervisor.states import HandoffPhase, RunState, StageState, handoff_move

if TYPE_CHECKING:
    from sfguard.supervisor.console.server import ConsoleServer

log = logging.getLogger("sfguard.console.handoff")
#: a stage that will not ask for anything any more
STAGE_OVER = (StageState.ENDED, StageState.FAILED)

HANDOFF_TIMEOUT = 900.0     # a live view nobody finishes ends after 15 minutes
WATCH_STEP = 0.25
MAX_WAIT = 60.0
TERMINAL = ("done", "cancelled", "expired", "ended")


@dataclass
class LiveHandoff:
    id: str
    run_id: str
    profile: str
    stage_id: str | None
    site: str
    host: str
    login_check: models.LoginCheck | None
    deadline: float
    view: LiveView
    state: HandoffPhase = HandoffPhase.OPEN
    result: dict[str, Any] | None = None
    viewers_seen: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task[None] | None = None
    finishing: bool = False
    created: float = field(default_factory=time.monotonic)
    browser_key: str = ""          # the run's browser it opened in (its page host is allowed there)

    @property
    def scope(self) -> str:
        return f"live:{self.id}"

    def public(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "kind": "live_view", "site": self.site,
                               "profile": self.profile}
        if self.result is not None:
            out["logged_in"] = self.result.get("logged_in")
            out["url"] = self.result.get("url")
        return out


def wants_live_view(console: ConsoleServer | None, body: models.HandoffRequest) -> bool:
    """`live_view` asked for, or `auto` with a page to open on a guard with no usable screen
    (no display, or one this guard cannot open; a container given a display has one) and its
    console on."""
    kind = getattr(body, "kind", "auto")
    if kind == "live_view":
        return True
    if kind == "local_window":
        return False
    if not body.url or console is None:
        return False
    return not tools.display_available() or display_refusal() is not None


async def open_live(console: ConsoleServer | None, run: RunView, body: models.HandoffRequest) -> dict[str, Any]:
    if console is None:
        raise Conflict("handoff_impossible", "a live_view handoff needs the guard's console, "
                       "which is off (start the guard without --no-console)", None)
    if not body.url:
        raise BadRequest("invalid_request", "url: a live_view handoff needs the page to open",
                         "url")
    try:
        page_pattern = policy.allow_pattern_for_url(body.url)
    except (policy.MalformedHost, ValueError) as exc:
        raise BadRequest("invalid_request", f"url: not an http:// or https:// address with a "
                         f"valid host ({exc})", "url") from None
    stage = None
    if body.stage_id is not None:
        stage = run.stages.get(body.stage_id)
        if stage is None:
            raise NotFound("stage_not_found", f"no stage {body.stage_id!r} in run "
                           f"{run.run_id!r}", "stage_id")
    for old in console.handoffs.values():   # one open live view per run and profile
        if old.run_id == run.run_id and old.profile == body.profile and old.state == HandoffPhase.OPEN:
            await finish(console, old, "ended", by="guard")
    view = console.view
    browser = await view.lease_browser(run.run_id, body.profile)
    if browser.anchor is None:
        raise Unavailable("browser_failed", "the profile's browser is not running", None)
    host = urlsplit(body.url).hostname or ""
    allow = await view.allow_browser(run.run_id, browser.key, [page_pattern])
    patterns = policy.compile_patterns(allow)

    def allowed(url: str) -> bool:
        p = urlsplit(url)
        if p.scheme not in ("http", "https") or not p.hostname:
            return False
        port = p.port or (443 if p.scheme == "https" else 80)
        return view.site_policy.decide(p.hostname, port, patterns).allowed

    hid = secrets.token_hex(8)
    tab = LiveView(browser.anchor.pipe, allowed, name=f"live:{hid}")
    try:
        await tab.start(body.url)
    except TAB_ERRORS as exc:
        with swallowed(log, "closing the live view that could not start"):
            await tab.close()
        raise Unavailable("browser_failed", f"could not open the login tab for the live view "
                          f"({type(exc).__name__})", None) from None
    check = body.login_check or (stage.browser_req.login_check if stage is not None else None)
    h = LiveHandoff(hid, run.run_id, body.profile, body.stage_id, body.site, host, check,
                    time.monotonic() + float(body.timeout_s or HANDOFF_TIMEOUT), tab, browser_key=browser.key)
    console.handoffs[hid] = h
    token = console.auth.new_link(h.scope, ttl=float(body.timeout_s or HANDOFF_TIMEOUT))
    h.watcher = asyncio.get_running_loop().create_task(_watch(console, h))
    view.audit.record("handoff_opened", scope=view.scope, profile=browser.key, run=run.run_id,
                      host=body.site if _plain_host(body.site) else host, mode="live_view")
    view.notify("handoff_waiting", {"kind": "live_view", "run": run.run_id, "stage": body.stage_id,
                                    "profile": body.profile, "site": body.site, "reason": body.reason})
    url = f"{console.base_url}/live/{hid}?t={token}"
    return {"kind": "live_view", "site": body.site, "reason": body.reason, "url": url}


def _plain_host(site: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9._:\-\[\]*]{1,255}", site))


async def _watch(console: ConsoleServer, h: LiveHandoff) -> None:
    """End the handoff when its time is up, its stage or run ended, or its tab went away."""
    try:
        while h.state == HandoffPhase.OPEN:
            await asyncio.sleep(WATCH_STEP)
            if h.state != HandoffPhase.OPEN or h.finishing:
                return
            run = console.view.runs.get(h.run_id)
            stage = run.stages.get(h.stage_id) if (run is not None and h.stage_id) else None
            if time.monotonic() >= h.deadline:
                await finish(console, h, "expired", by="guard")
            elif run is None or run.state != RunState.ACTIVE or (stage is not None and stage.state in STAGE_OVER):
                await finish(console, h, "ended", by="guard")
            elif h.view.closed.is_set():
                await finish(console, h, "ended", by="guard")
    except asyncio.CancelledError:
        pass


async def finish(console: ConsoleServer, h: LiveHandoff, outcome: str, *, by: str) -> dict[str, Any]:
    """End a handoff: `done` (then the guard's login check), `cancelled` (the stage fails),
    `expired` or `ended`. Idempotent; the link and its sessions stop working at once."""
    if h.state != HandoffPhase.OPEN or h.finishing:
        return h.public()
    h.finishing = True
    view = console.view
    console.auth.end_scope(h.scope)
    h.view.outcome = outcome     # what the viewers are told as their socket closes
    await h.view.close()
    if h.watcher is not None and h.watcher is not asyncio.current_task():
        h.watcher.cancel()
    run = view.runs.get(h.run_id)
    result = None
    if outcome == "done" and h.login_check is not None and run is not None and run.state == RunState.ACTIVE:
        try:
            result = await view.login_check(h.run_id, models.LoginCheckRequest(
                profile=h.profile, login_check=h.login_check))
        except GuardError as exc:
            result = {"logged_in": False, "url": "", "error": exc.code}
    elif outcome == "cancelled" and h.stage_id and run is not None and run.state == RunState.ACTIVE:
        with contextlib.suppress(GuardError):
            await view.end_stage(h.run_id, h.stage_id, models.StageEnd(outcome="failed"))
    if run is not None and run.state == RunState.ACTIVE:
        # the page's host was added for the handoff only: back to what the stages allow
        with swallowed(log, f"run {h.run_id}: taking the handoff's page host off the allowlist"):
            await view.allow_browser(h.run_id, h.browser_key)
    h.result = result
    h.state = handoff_move(h.state, outcome)
    fields: dict[str, Any] = dict(scope=view.scope, profile=h.profile, run=h.run_id, by=by)
    if h.stage_id:
        fields["stage"] = h.stage_id
    with swallowed(log, "the audit record of the handoff's end", (OSError, ProfileError)):
        if outcome == "done":
            view.audit.record("handoff_confirmed", outcome="done", **fields,
                              **({"logged_in": bool(result.get("logged_in"))} if result else {}))
        else:
            view.audit.record("handoff_closed", outcome=outcome, **fields)
    h.changed.set()
    console.notify()
    log.info("live view %s of run %s ended: %s", h.id, h.run_id, outcome, extra={"run": h.run_id})
    view.notify("handoff_ended", {"kind": "live_view", "run": h.run_id, "stage": h.stage_id,
                                  "profile": h.profile, "site": h.site, "outcome": outcome})
    return h.public()


def viewed(console: ConsoleServer, h: LiveHandoff, session_id: str) -> None:
    """Audit the first time a console session opens this live view."""
    if session_id in h.viewers_seen:
        return
    h.viewers_seen.add(session_id)
    with swallowed(log, "the audit record of a handoff viewed", (OSError, ProfileError)):
        console.view.audit.record("handoff_viewed", scope=console.view.scope, profile=h.profile,
                                  run=h.run_id, by=session_id)


def newest(console: ConsoleServer | None, run_id: str) -> LiveHandoff | None:
    """The run's newest live handoff, if it had one."""
    mine = [h for h in (console.handoffs.values() if console else []) if h.run_id == run_id]
    return mine[-1] if mine else None


async def state(console: ConsoleServer | None, run_id: str, wait: float = 0.0) -> dict[str, Any]:
    """The run's latest live handoff (the caller has checked the run is known); with `wait`,
    held until it is no longer open."""
    h = newest(console, run_id)
    if h is None:
        raise NotFound("handoff_not_found", f"run {run_id!r} has no handoff", "run_id")
    if h.state == HandoffPhase.OPEN and wait > 0:
        h.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(h.changed.wait(), min(wait, MAX_WAIT))
    return h.public()


async def close_all(console: ConsoleServer | None) -> None:
    if console is None:
        return
    for h in list(console.handoffs.values()):
        await finish(console, h, "ended", by="guard")
