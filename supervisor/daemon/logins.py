"""Login checks, envelope verification and the human handoff, in a run's leased browser."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sfguard import policy
from sfguard.supervisor import models
from sfguard.supervisor.browsers.handoff import HandoffImpossible
from sfguard.supervisor.browsers.login import LoginCheckError, check_login, shown_url
from sfguard.supervisor.daemon.runs import Browser, Run
from sfguard.supervisor.daemon.stage_browser import BROWSER_ERRORS
from sfguard.supervisor.daemon.window_handoff import WindowHandoffs
from sfguard.supervisor.errors import BadRequest, Conflict, Forbidden, Unavailable, Unprocessable
from sfguard.supervisor.gate.cdp_session import CdpCallError, PipeClosed
from sfguard.supervisor.protocols import ProfileError
from sfguard.supervisor.states import HandoffPhase

if TYPE_CHECKING:
    from sfguard.policy.watch import PolicyWatcher
    from sfguard.supervisor.browsers.handoff import Handoff
    from sfguard.supervisor.browsers.host import BrowserHost
    from sfguard.supervisor.daemon.browser_supply import BrowserSupply
    from sfguard.supervisor.daemon.metrics import GuardMetrics
    from sfguard.supervisor.daemon.watchdog import Watchdog
    from sfguard.supervisor.profiles.stores import Stores

#: Bound of one login check (its own tab; never affects the anchor or other stages).
LOGIN_CHECK_TIMEOUT = 30.0


def run_allow(run: Run, profile: str) -> list[str]:
    """Every allow_domains pattern this run's stages asked for with this profile."""
    out: set[str] = set()
    for st in run.stages.values():
        if st.browser_req.profile == profile:
            out.update(st.browser_req.allow_domains)
    return sorted(out)


async def open_in_titled_window(pipe: Any, url: str) -> None:
    """Open `url` as a tab in the browser's first window, the one titled with site and
    profile (--window-name names only that one; a new window would carry the page's title).
    Chromium puts a new tab in the window last in front, so that window is brought forward
    first."""
    targets = (await pipe.call("Target.getTargets"))["targetInfos"]
    windows = []
    for t in targets:
        if t.get("type") == "page":
            w = await pipe.call("Browser.getWindowForTarget", {"targetId": t["targetId"]})
            windows.append((w["windowId"], t["targetId"]))
    if windows:
        await pipe.call("Target.activateTarget", {"targetId": min(windows)[1]})
    made = await pipe.call("Target.createTarget", {"url": url})
    await pipe.call("Target.activateTarget", {"targetId": made["targetId"]})


class Logins:
    def __init__(self, *, runs: dict[str, Run], run_of: Callable[[str], Run], active_run: Callable[[str], Run],
                 supply: BrowserSupply, watchdog: Watchdog, host: BrowserHost, stores: Stores, scope: str,
                 store_call: Callable[..., Awaitable[Any]], metrics: GuardMetrics,
                 policy_watch: PolicyWatcher, new_handoff: Callable[[], Handoff],
                 notify: Callable[[str, dict[str, Any]], None] | None = None):
        """Given exactly what it uses: the runs (and the guard's lookups of one, with their
        errors), the browser supply and the watchdog (to relaunch and re-attach), the browser host,
        the profile store and audit, metrics, the policy in force, the handoff factory and the
        guard's webhooks (a window handoff waiting and ended)."""
        self.notify = notify
        self.run_of, self.active_run, self.supply, self.watchdog = run_of, active_run, supply, watchdog
        self.host, self.store, self.audit, self.scope = host, stores.store, stores.audit, scope
        self.store_call, self.metrics, self.policy_watch, self.new_handoff = (
            store_call, metrics, policy_watch, new_handoff)
        # local_window handoffs (window_handoff.py)
        self.windows = WindowHandoffs(runs, self._window_closed,
                                      lambda run, browser: self.relaunch(run, browser, headed=False, site=None),
                                      notify=notify)

    async def _window_closed(self, outcome: str, fields: dict[str, Any]) -> None:
        await self.store_call(self.audit.record, "handoff_closed", outcome=outcome, scope=self.scope, **fields)

    async def check(self, run_id: str, body: models.LoginCheckRequest) -> dict[str, Any]:
        run = self.active_run(run_id)
        parts = urlsplit(body.login_check.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        allow = run_allow(run, body.profile)
        decision = self.policy_watch.policy.decide(parts.hostname or "", port, policy.compile_patterns(allow))
        if not decision.allowed:
            raise Forbidden("login_check_not_allowed", f"the check address's host is refused "
                            f"for this run: {decision.explanation}", "login_check.url")
        browser = await self.supply.leased_browser(run, body.profile, headed=False)
        assert run.proxy is not None and browser.anchor is not None
        check_pattern = policy.allow_pattern_for_url(body.login_check.url)
        try:
            await run.proxy.set_allow(browser.client, run.browser_allow(browser) + [check_pattern])
            # its own tab and window, its own bound; a failed check leaves the anchor as it was
            result = await check_login(browser.anchor.pipe, body.login_check,
                                       timeout=LOGIN_CHECK_TIMEOUT)
        except LoginCheckError as exc:
            self.metrics.login_checked("failed")
            raise Unprocessable("login_check_failed", str(exc), "login_check") from None
        except ValueError as exc:
            raise BadRequest("invalid_pattern", str(exc), "login_check") from None
        finally:
            if browser.client in run.proxy.clients:
                await run.proxy.set_allow(browser.client, run.browser_allow(browser))
        run.login_results[body.profile] = result
        self.metrics.login_checked("logged_in" if result.logged_in else "logged_out")

        def record_check() -> None:
            self.audit.record("login_checked", scope=self.scope, profile=browser.key,
                           run=run.run_id, host=decision.normalized_host,
                           logged_in=result.logged_in,
                           result="logged_in" if result.logged_in else "logged_out")
            note = getattr(self.store, "record_login_check", None)  # shared: a fenced state write
            if note is not None:
                with contextlib.suppress(ProfileError):  # a stale lease is refused and logged there
                    note(browser.profile, result.logged_in)
        await self.store_call(record_check)
        return {"logged_in": result.logged_in, "url": result.url}

    async def verify(self, run_id: str, body: models.LoginVerifyRequest) -> dict[str, Any]:
        run = self.run_of(run_id)
        mine = run.login_results.get(body.profile)
        if mine is None:
            raise Conflict("no_login_check", f"the guard has not checked profile "
                           f"{body.profile!r} in this run; call login-check first", "profile")
        for field_name in ("logged_in", "url"):
            theirs, ours = getattr(body.reported, field_name), getattr(mine, field_name)
            if field_name == "url":   # the guard's answer hides query values; the stage may not
                theirs = shown_url(theirs)
            if theirs != ours:
                raise Conflict("envelope_mismatch",
                               f"the stage reported {field_name}={theirs!r} but the guard's own check "
                               f"found {field_name}={ours!r}", f"reported.{field_name}")
        return {"ok": True}

    async def window_handoff(self, run: Run, body: models.HandoffRequest) -> dict[str, Any]:
        """A local window for the person (the guard sends live views to the console)."""
        handoff = self.new_handoff()
        try:   # opens the display (xdpyinfo, bounded): off the event loop
            await asyncio.to_thread(handoff.check_possible, profile=body.profile, url=body.url)
        except HandoffImpossible as exc:
            raise Conflict("handoff_impossible", str(exc), None) from None
        browser = await self.supply.leased_browser(run, body.profile, headed=True)
        assert run.proxy is not None and browser.anchor is not None
        if not browser.headed or browser.site != body.site:
            # reopen the anchor headed, same profile, same proxy client, its window titled
            # with the site and the profile
            try:
                await self.relaunch(run, browser, headed=True, site=body.site)
            except BROWSER_ERRORS as exc:   # e.g. the browser user cannot open the display
                raise Conflict("handoff_impossible", "a visible login window is not "
                               f"possible: {exc}", None) from None
        if body.url:
            host = urlsplit(body.url).hostname or ""
            await run.proxy.set_allow(browser.client, run.browser_allow(browser) + [host])
            try:
                await open_in_titled_window(browser.anchor.pipe, body.url)
            except (PipeClosed, CdpCallError, TimeoutError, KeyError) as exc:   # KeyError: an answer without its field
                raise Unavailable("browser_failed", f"could not open the page in the browser "
                                  f"({type(exc).__name__})", None) from None
        await self.store_call(self.audit.record, "handoff_opened", scope=self.scope,
                           profile=browser.key, run=run.run_id, host=body.site)
        self.windows.open(run, browser, body.profile, body.site, body.stage_id, body.timeout_s)
        if self.notify is not None:
            self.notify("handoff_waiting", {"kind": "local_window", "run": run.run_id, "stage": body.stage_id,
                                            "profile": body.profile, "site": body.site, "reason": body.reason})
        return handoff.payload(site=body.site, reason=body.reason, url=body.url).model_dump()

    async def relaunch(self, run: Run, browser: Browser, *, headed: bool, site: str | None) -> None:
        """Reopen the anchor headed (its window titled with site and profile) or headless, on
        the same profile folder and proxy client; its stages get new gate tokens. When the new
        launch fails, the old form comes back and the error is raised."""
        assert browser.anchor is not None
        async with browser.lock:
            await self.host.close_anchor(browser.anchor)
            before, profile_dir = (browser.headed, browser.site), browser.anchor.profile_dir
            browser.headed, browser.site = headed, site
            try:
                browser.anchor = await self.supply.launch(run, browser, profile_dir)
            except BROWSER_ERRORS:
                browser.headed, browser.site = before
                browser.anchor = await self.supply.launch(run, browser, profile_dir)
                await self.watchdog.reattach(run, browser)
                raise
            await self.watchdog.reattach(run, browser)

    async def window_state(self, run_id: str, wait: float, live_since: float | None) -> dict[str, Any] | None:
        """The run's window handoff, unless a live view (opened at `live_since`) is newer or it
        has none (None); with `wait`, held until it is no longer open."""
        window = self.windows.items.get(run_id)
        if window is None or (live_since is not None and live_since > window.created):
            return None
        if window.state == HandoffPhase.OPEN and wait > 0:
            window.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(window.changed.wait(), wait)
        return window.public()
