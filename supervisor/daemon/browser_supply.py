"""The lease and browser step of a stage: profile names and leases, browser users, the run's
proxy, and the browsers themselves (a leased profile's anchor, or a throw-away one) behind it.

`Stages` (stages.py) asks it for a stage's browser; the login check and handoff lease theirs
here; the watchdog relaunches through `launch`. Listeners in `on_user_back` are called when a
browser user comes back to the pool (a stage waiting for one can move on)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sfguard.supervisor import models
from sfguard.supervisor.browsers import xdisplay
from sfguard.supervisor.browsers.host import Anchor, AnchorSpec
from sfguard.supervisor.daemon.pacing import PageLoads
from sfguard.supervisor.daemon.run_proxy import short_id
from sfguard.supervisor.daemon.runs import Browser, Run, Stage
from sfguard.supervisor.daemon.shared_proxy import AnyPool, AnyRunProxy
from sfguard.supervisor.daemon.stage_browser import BROWSER_ERRORS, browser_failed
from sfguard.supervisor.errors import BadRequest, BrowserStartError, Conflict, Unavailable, swallowed
from sfguard.supervisor.home import private_dir
from sfguard.supervisor.profiles import store_ops
from sfguard.supervisor.profiles.local_store import pipeline_profile_name
from sfguard.supervisor.protocols import ProfileKey, StoreUnavailable, Waiting

if TYPE_CHECKING:
    from sfguard.supervisor.browsers.browser_pool import BrowserPool
    from sfguard.supervisor.browsers.browser_user import BrowserUser
    from sfguard.supervisor.browsers.host import BrowserHost
    from sfguard.supervisor.browsers.tools import Tool
    from sfguard.supervisor.daemon.crash import RunRecords
    from sfguard.supervisor.profiles.store_ops import StoreCalls
    from sfguard.supervisor.profiles.stores import Stores

    WriteRecorder = Callable[[str, dict[str, object]], None]

log = logging.getLogger("sfguard.guard")


class BrowserSupply:
    """Leases, browser users, run proxies and browsers, over the guard's parts."""

    def __init__(self, *, scope: str, stores: Stores, calls: StoreCalls, store_call: Callable[..., Awaitable[Any]],
                 records: RunRecords, host: BrowserHost, browser_tool: Tool, pool: Callable[[], BrowserPool | None],
                 proxies: AnyPool, runtime: Path, socket_dir: Path, config_path: Path, page_loads: PageLoads):
        """`pool`: a root guard's browser users (set when the guard starts), one per browser;
        `page_loads`: the HTTPS page loads each browser counts (daemon/pacing.py)."""
        self.scope, self.stores, self.store = scope, stores, stores.store
        self.calls, self.store_call = calls, store_call
        self.records, self.host, self.browser_tool, self.pool = records, host, browser_tool, pool
        self.proxies, self.runtime, self.socket_dir, self.config_path = proxies, runtime, socket_dir, config_path
        self.page_loads = page_loads
        self.on_user_back: list[Callable[[], None]] = []

    def user_back(self) -> None:
        for listener in self.on_user_back:
            listener()

    def profile_key(self, run: Run, name: str) -> ProfileKey:
        if name == models.PIPELINE_PROFILE:
            if not run.pipeline:
                raise BadRequest("no_pipeline", "profile '@pipeline' needs a run created with "
                                 "a pipeline path", "browser.profile")
            name = pipeline_profile_name(run.pipeline)
        return ProfileKey(self.scope, name)

    @staticmethod
    def identity(run: Run, key: ProfileKey) -> str | None:
        """A profile made for `@pipeline` keeps its workflow identity (PLAT-322): the same on
        every host, since it depends only on the normalised pipeline path."""
        return (pipeline_profile_name(run.pipeline) if run.pipeline
                and key.name == pipeline_profile_name(run.pipeline) else None)

    def lease_open(self, key: ProfileKey, run_id: str) -> bool:
        """Whether `run_id` would be granted `key` now: it holds it, or nobody does and nobody
        is queued before it (a store call: run it off the event loop). An unreachable store: no."""
        try:
            holder = self.stores.lease.holder(key)
            if holder is not None:
                return holder.run == run_id
            queue = self.stores.lease.queue(key)
        except StoreUnavailable:
            return False
        return not queue or queue[0].run == run_id

    def needs_browser(self, run: Run, key: ProfileKey | None) -> bool:
        """A stage of `key` (None: profile-less) needs a new browser in `run`."""
        browser = run.browsers.get(key.name) if key is not None else None
        return browser is None or browser.anchor is None

    async def take_user(self, run: Run) -> BrowserUser | None:
        """A browser user for a new browser of `run` (None without a pool). Unavailable when
        every user is in use (a login check or handoff: asked again by the runner)."""
        pool = self.pool()
        if pool is None:
            return None
        user = await asyncio.to_thread(pool.take, f"run {run.run_id}")
        if user is None:
            raise Unavailable("browser_failed", pool.full_reason(), "profile")
        return user

    async def retry_users(self) -> None:
        """Users kept out of the pool by a process that would not end: tried again."""
        pool = self.pool()
        if pool is None or not pool.stuck():
            return
        if await asyncio.to_thread(pool.retry_stuck):
            self.user_back()

    async def release_user(self, user: BrowserUser | None, leftovers: tuple[Path, ...] = ()) -> None:
        """Give a browser user back (its processes ended, `leftovers` it may still own taken back
        by root); the stages waiting for one are moved on."""
        pool = self.pool()
        if user is None or pool is None:
            return
        if await asyncio.to_thread(pool.give_back, user, leftovers):
            self.user_back()

    async def ensure_proxy(self, run: Run) -> AnyRunProxy:
        """The run's proxy: the pool's warm spare when one is ready (a proxy child takes ~0.7 s
        to start), else a new one; then a new spare is started in the background."""
        if run.proxy is None:
            run.workdir = private_dir(self.runtime / f"r-{short_id()}")
            run.proxy = await self.proxies.take(run.run_id)
            self.records.save(run)
            self.proxies.refill()
        return run.proxy

    async def launch(self, run: Run, browser: Browser, profile_dir: Path | None) -> Anchor:
        """Start `browser` (a first launch, a restart, a relaunch headed) as its user."""
        proxy = await self.ensure_proxy(run)
        assert run.workdir is not None
        if self.browser_tool.path is None:
            raise BrowserStartError("no browser found (install Chromium or set SFGUARD_BROWSER)")
        spec = AnchorSpec(session=f"sfa-{short_id()}", socket_dir=self.socket_dir,
                          config_path=self.config_path, browser_path=self.browser_tool.path,
                          profile_dir=profile_dir, proxy_url=proxy.url_for(browser.client),
                          headed=browser.headed, temp_root=run.workdir, user=browser.user,
                          window_title=xdisplay.window_title(
                              browser.profile.name if browser.profile else None, browser.site))
        return await self.host.launch_anchor(spec)

    async def ensure_anchor(self, run: Run, key: ProfileKey, headed: bool,
                            user: BrowserUser | None = None) -> Browser:
        """The run's browser on `key`, started when it has none. `user`: the browser user taken
        for it (given back when not needed or when the start fails); one is taken when needed."""
        browser = run.browsers.get(key.name)
        if browser is not None and browser.anchor is not None:
            await self.release_user(user)
            return browser
        user = user or await self.take_user(run)
        profile_dir: Path | None = None
        ready = False
        try:
            proxy = await self.ensure_proxy(run)
            t0 = time.monotonic()
            if not await self.calls.run(self.store.exists, key):   # the grant made it; deleted since?
                await self.calls.run(store_ops.create_profile, self.stores, key, self.identity(run, key),
                                  run=run.run_id)
            name = await proxy.add_client([], held=True,      # refused everything until attach
                                          pace_key=f"p:{key.scope}/{key.name}")
            browser = Browser(key.name, key, headed, name, user=user)
            run.browsers[key.name] = browser
            profile_dir = await self.calls.run(self.store.open, key)
            self.records.save(run)
            t1 = time.monotonic()
            try:
                browser.anchor = await self.launch(run, browser, profile_dir)
            finally:
                if browser.anchor is None:   # it never started, so it changed nothing: drop the working
                    # copy (the sealed profile stays as it was) so that the next request can open it again
                    run.browsers.pop(key.name, None)
                    with swallowed(log, f"profile {key.name}: closing after a failed launch"):
                        await self.calls.run(self.store.close, key, save=False)
                    with swallowed(log, "removing the failed browser's proxy client", (BrowserStartError,)):
                        await proxy.remove_client(name)
            ready = True
        finally:
            if not ready:
                await self.release_user(user, (profile_dir,) if profile_dir is not None else ())
        self.page_loads.watch(run, browser)      # the guard's own login checks count too
        log.info("run %s: anchor for profile %s ready (profile opened in %.0f ms, browser "
                 "launched in %.0f ms)", run.run_id, key.name, (t1 - t0) * 1000,
                 browser.anchor.launch_seconds * 1000, extra={"run": run.run_id, "profile": key.name})
        if browser.anchor.carried:    # what would have run before the guard: removed, and said
            removed = "; ".join(browser.anchor.carried)
            log.warning("run %s: profile %s carried what would have run before the guard; removed or "
                        "kept from loading: %s", run.run_id, key.name, removed,
                        extra={"run": run.run_id, "profile": key.name})
            with swallowed(log, "the audit record of a cleaned profile"):
                await self.calls.run(self.stores.audit.record, "profile_cleaned", profile=key.name,
                                     run=run.run_id, removed=removed[:500])
        return browser

    async def throwaway(self, run: Run, stage: Stage, user: BrowserUser | None = None) -> Browser:
        """A throw-away browser for a profile-less stage, as `user` (taken when not given)."""
        user = user or await self.take_user(run)
        key = f"tmp-{stage.stage_id}"
        ready = False
        try:
            proxy = await self.ensure_proxy(run)
            name = await proxy.add_client([], held=True,      # refused everything until attach
                                          pace_key=f"b:{run.run_id}/{key}")
            browser = Browser(key, None, stage.headed, name, user=user)
            run.browsers[key] = browser
            browser.anchor = await self.launch(run, browser, None)
            ready = True
        finally:
            if not ready:
                failed = run.browsers.get(key)
                if failed is not None and failed.anchor is None:    # never started: nothing of it stays
                    run.browsers.pop(key)
                    with swallowed(log, "removing the failed browser's proxy client", (BrowserStartError,)):
                        await proxy.remove_client(failed.client)
                await self.release_user(user)
        return browser

    async def leased_browser(self, run: Run, profile: str, headed: bool) -> Browser:
        """The run's browser on `profile` for a login check or handoff, leasing it now; a
        profile another run holds is a conflict (this run is queued)."""
        key = self.profile_key(run, profile)
        async with run.lock:
            result = await self.store_call(store_ops.grant, self.stores, key, run.run_id,
                                        self.identity(run, key))
            if isinstance(result, Waiting):
                raise Conflict("profile_leased", f"profile {key.name!r} is leased by run "
                               f"{result.holder_run!r}; this run is queued", "profile")
            try:
                return await self.ensure_anchor(run, key, headed)
            except BROWSER_ERRORS as exc:
                # the same answer as a stage request whose browser fails (never a 500)
                raise browser_failed(exc, f"could not start the browser of profile {key.name!r}",
                                     "profile") from None
            finally:
                self.records.save(run)
