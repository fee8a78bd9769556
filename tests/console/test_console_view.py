"""The console reaches the guard only through a ConsoleView (supervisor/console/view.py,
docs/decisions/0036-console-view.md): the daemon's view of a Guard built here with the in-memory
seams serves every page, and the in-memory view (supervisor/testing/console_view.py) drives the
controls, the audit records before them and what happens when the audit chain cannot take one
(the action or the sign-in is refused: fail closed). No browser: the console on loopback, spoken
to with aiohttp."""
from __future__ import annotations

import contextlib
import re
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sfguard.supervisor import models
from sfguard.supervisor.console.listen import ConsoleConfig
from sfguard.supervisor.console.server import CONSOLE_COOKIE, PAGES, ConsoleServer
from sfguard.supervisor.console.view import ConsoleView
from sfguard.supervisor.daemon.console_view import GuardConsoleView, console_view
from sfguard.supervisor.daemon.guard import Guard
from sfguard.supervisor.daemon.runs import Browser, Run, Stage
from sfguard.supervisor.profiles.stores import Stores
from sfguard.supervisor.protocols import LOCAL_SCOPE, ProfileKey
from sfguard.supervisor.testing import FakeAuditSink, FakeKeyProvider, FakeProfileLease, FakeProfileStore
from sfguard.supervisor.testing.console_view import FakeConsoleView


class Console:
    """A ConsoleServer on a loopback port over `view`, and a signed-in client of it."""

    def __init__(self, server: ConsoleServer, http: aiohttp.ClientSession):
        self.server, self.http = server, http
        self.base = server.base_url
        self.cookie = ""

    async def sign_in(self) -> int:
        async with self.http.get(self.server.login_link()["url"], allow_redirects=False) as resp:
            if CONSOLE_COOKIE in resp.cookies:
                self.cookie = resp.cookies[CONSOLE_COOKIE].value
            return resp.status

    async def get(self, path: str) -> tuple[int, str]:
        async with self.http.get(self.base + path, headers={"Cookie": f"{CONSOLE_COOKIE}={self.cookie}"},
                                 allow_redirects=False) as resp:
            return resp.status, await resp.text()

    async def post(self, path: str) -> int:
        _, page = await self.get("/")
        m = re.search(r'name="csrf" value="([^"]+)"', page)
        assert m, page[:300]
        async with self.http.post(self.base + path, data={"csrf": m.group(1)}, allow_redirects=False,
                                  headers={"Cookie": f"{CONSOLE_COOKIE}={self.cookie}", "Origin": self.base}) as resp:
            return resp.status


@contextlib.asynccontextmanager
async def serve(view: ConsoleView) -> AsyncIterator[Console]:
    server = ConsoleServer(view, ConsoleConfig(host="127.0.0.1", port=0))
    await server.start()
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            yield Console(server, http)
    finally:
        await server.stop()


@pytest.fixture
async def guard(tmp_path: Path) -> AsyncIterator[Guard]:
    keys = FakeKeyProvider()
    stores = Stores("fake", "in-memory (test fakes)", keys,
                    FakeProfileStore(scopes=(LOCAL_SCOPE,), keys=keys), FakeProfileLease(), FakeAuditSink())
    g = Guard(tmp_path / "home", stores=stores)
    yield g
    await g.stop()


@pytest.fixture
def fake(tmp_path: Path) -> FakeConsoleView:
    view = FakeConsoleView(tmp_path)
    run = Run("r1", None, 0.0)
    run.stages["s1"] = Stage("r1", "s1", 1, models.BrowserField(profile="alpha", allow_domains=["a.test"]), False)
    run.browsers["alpha"] = Browser("alpha", ProfileKey(LOCAL_SCOPE, "alpha"), False, "c1", stages={"s1"})
    view.runs[run.run_id] = run
    return view


def events(view: Any) -> list[str]:
    return [r["event"] for r in view.audit.records()]


def test_both_views_are_console_views(guard, fake):
    view = console_view(guard)
    assert isinstance(view, GuardConsoleView) and isinstance(view, ConsoleView)
    assert isinstance(fake, ConsoleView)
    # the guard's own parts, not copies: a run the guard makes is one the console sees
    assert view.runs is guard.runs and view.approvals is guard.approvals and view.audit is guard.audit
    assert view.decisions_log == guard.logs_dir / "decisions.log" and view.policy_path == guard.policy_path
    assert not hasattr(view, "guard") and not hasattr(view, "_guard")


async def test_the_daemons_view_serves_every_page_and_the_metrics(guard):
    await guard.create_run(models.CreateRun(run_id="r1"))
    async with serve(console_view(guard)) as c:
        assert await c.sign_in() == 200
        for page in PAGES:
            status, html = await c.get("/" if page == "overview" else f"/{page}")
            assert status == 200, (page, html[:300])
        status, html = await c.get("/runs/r1")
        assert status == 200 and "r1" in html
        status, text = await c.get("/metrics")
        assert status == 200 and "sfguard" in text
        # the sign-in was audited through the view, with the guard's own chain
        assert "console_signed_in" in events(guard)


async def test_a_control_is_audited_then_done_through_the_view(fake):
    fake.runs["r1"].browsers["alpha"].anchor = types.SimpleNamespace()   # a running browser (no pipe needed)
    async with serve(fake) as c:
        assert await c.sign_in() == 200
        assert await c.post("/runs/r1/browsers/alpha/restart") == 303
        assert await c.post("/runs/r1/stages/s1/cancel") == 303
        assert await c.post("/runs/r1/end") == 303
    assert fake.asked[0][:3] == ("restart_browser", "r1", "alpha") and fake.asked[0][3].startswith("console:")
    # s1 has not started (pending): cancelling it takes it out of its queue
    assert fake.asked[1:] == [("cancel_stage", "r1", "s1"), ("end_run", "r1", "cancelled")]
    assert fake.runs["r1"].browsers["alpha"].restarts == 1
    assert events(fake)[-3:] == ["console_browser_restarted", "console_stage_cancelled", "console_run_ended"]


class BrokenAudit(FakeAuditSink):
    """An audit chain that takes sign-ins, then refuses with `error`."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error, self.broken = error, False

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        if self.broken:
            raise self.error
        return super().record(event, **fields)


async def test_a_control_the_audit_chain_cannot_record_is_not_done(tmp_path, fake):
    fake.audit = audit = BrokenAudit(OSError(28, "No space left on device"))
    async with serve(fake) as c:
        assert await c.sign_in() == 200
        audit.broken = True
        assert await c.post("/runs/r1/end") == 503
    assert fake.asked == [] and fake.runs["r1"].state == "active"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), LookupError("a bug")])
async def test_a_sign_in_the_audit_chain_cannot_record_leaves_no_session(fake, error, monkeypatch):
    fake.audit = audit = BrokenAudit(error)
    audit.broken = True
    async with serve(fake) as c:
        redeemed: list[Any] = []
        redeem = c.server.auth.redeem
        monkeypatch.setattr(c.server.auth, "redeem", lambda token, scope: redeemed.append(redeem(token, scope))
                            or redeemed[-1])
        # the chain's own failures are answered 503; anything else is a bug (500, in the log)
        assert await c.sign_in() == (503 if isinstance(error, OSError) else 500)
        cookie, sess = redeemed[0]
        assert c.cookie == "" and not c.server.auth.live(sess) and c.server.auth.session(cookie) is None


async def test_a_live_view_handoff_needs_the_console(tmp_path):
    from sfguard.supervisor.console import handoff as live
    from sfguard.supervisor.errors import Conflict, NotFound
    body = models.HandoffRequest(profile="alpha", site="a.test", reason="login", url="https://a.test/",
                                 kind="live_view")
    run = Run("r1", None, 0.0)
    assert live.wants_live_view(None, body) and live.newest(None, "r1") is None
    with pytest.raises(Conflict):
        await live.open_live(None, run, body)
    async with serve(FakeConsoleView(tmp_path)) as c:
        assert live.wants_live_view(c.server, body) and live.newest(c.server, "r1") is None
        with pytest.raises(NotFound):
            await live.state(c.server, "r1")
