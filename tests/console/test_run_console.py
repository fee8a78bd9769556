"""The console's runs, in a real browser (issue 48): a signed-in person finds a running run in
the list, opens its page (timeline with screenshots, filters), watches the stage's tab
read-only (frames come, nothing sent reaches the tab), and ends the run; each action is in the
audit chain with who did it, and in the run's record. Screenshots in .ci-artifacts/console/."""
from __future__ import annotations

import asyncio
import json
import time
from http.cookies import SimpleCookie
from urllib.parse import urlsplit

import aiohttp
import pytest

from sfguard.supervisor.console.server import CONSOLE_COOKIE
from sfguard.supervisor.console.viewer import Viewer
from sfguard.supervisor.profiles.audit import LocalAuditSink
from tests.console.conftest import ARTIFACTS, connect, end_session_daemons
from tests.daemon.test_real_browser import as_stage

pytestmark = pytest.mark.browser


def person_link(d, person: str) -> str:
    status, body = d.call("POST", "/v1/console/link", {"ttl_s": 600, "person": person})
    assert status == 200, body
    return body["url"]


def cookie_of(d, url: str) -> str:
    u = urlsplit(url)
    conn = connect(d.console)
    conn.request("GET", f"{u.path}?{u.query}")
    r = conn.getresponse()
    r.read()
    jar = SimpleCookie(r.headers.get("Set-Cookie") or "")
    return jar[CONSOLE_COOKIE].value


async def poke(d, cookie: str, path: str) -> list[str]:
    """Everything a viewer could send, sent on the watch socket; what the socket said back."""
    said = []
    async with aiohttp.ClientSession() as s, s.ws_connect(
            f"{d.console}{path}/ws", headers={"Cookie": f"{CONSOLE_COOKIE}={cookie}", "Origin": d.console}) as ws:
        for msg in ({"t": "mouse", "type": "mousePressed", "x": 100, "y": 100, "button": "left"},
                    {"t": "mouse", "type": "mouseReleased", "x": 100, "y": 100, "button": "left"},
                    {"t": "text", "text": "typed-by-a-watcher"}, {"t": "key", "type": "keyDown", "key": "Enter"},
                    {"t": "navigate", "url": "http://site-b.test/"}):
            await ws.send_str(json.dumps(msg))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.5):
                async for m in ws:
                    said.append(m.type.name)
    return said


def test_a_console_session_watches_a_running_stage_read_only_and_ends_its_run(guard):
    d, port = guard, guard.site
    a, run = f"http://site-a.test:{port}", "console-run"
    assert d.call("POST", "/v1/runs", {"run_id": run, "pipeline": "/srv/pipes/nightly-report.yaml"})[0] == 201
    env = d.call("POST", f"/v1/runs/{run}/stages", {"stage_id": "report", "attempt": 1, "browser": {
        "profile": "fixture", "headed": False, "allow_domains": [f"site-a.test:{port}"]}})[1]["env"]
    assert as_stage(env, "open", f"{a}/login").returncode == 0
    as_stage(env, "open", f"http://site-b.test:{port}/")
    assert as_stage(env, "open", f"{a}/login").returncode == 0
    link = person_link(d, "ana")

    async def person() -> None:
        async with Viewer(width=1300, height=1000) as v:
            await v.goto(link)
            await v.wait_for("location.pathname === '/'", 20, "the console after sign-in")
            await v.goto(f"{d.console}/runs?pipeline=nightly")
            await v.wait_for(f"!!document.querySelector('a[href=\"/runs/{run}\"]')", 20, "the run in the list")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            await v.screenshot(ARTIFACTS / "runs-list.png")
            await v.goto(f"{d.console}/runs?outcome=failed")
            assert await v.eval(f"document.querySelector('a[href=\"/runs/{run}\"]') === null")
            await v.goto(f"{d.console}/runs/{run}")
            await v.wait_for("[...document.querySelectorAll('#timeline img.shot')].some(i => i.naturalWidth > 0)",
                             30, "a screenshot on the run page")
            text = await v.eval("document.getElementById('timeline').innerText")
            assert f"loaded {a}/login" in text and "proxy deny" in text and "site-b.test" in text
            await v.screenshot(ARTIFACTS / "run-page.png")
            await v.goto(f"{d.console}/runs/{run}?kind=proxy&refused=1")
            kinds = await v.eval("[...document.querySelectorAll('#timeline tr[data-kind]')].map(r => r.className)")
            assert kinds and all("deny" in k for k in kinds), kinds
            await v.screenshot(ARTIFACTS / "run-page-refused.png")
            await v.goto(f"{d.console}/runs/{run}")
            await v.click_selector("#stage-report a.watch")
            await v.wait_for("document.body.dataset.live === '1' && "
                             "+document.getElementById('screen').dataset.frames > 0", 30, "the stage's tab, watched")
            assert await v.eval("document.querySelectorAll('textarea, input:not([type=hidden])').length") == 0
            await v.screenshot(ARTIFACTS / "run-watch.png")
            cookie = await v.eval("document.cookie")      # HttpOnly: the page cannot read it
            assert CONSOLE_COOKIE not in cookie
            await v.goto(f"{d.console}/runs/{run}")
            await v.click_selector("#end-run")
            await v.wait_for(f"location.pathname === '/runs/{run}' && !document.getElementById('end-run')", 60,
                             "the run page after ending the run")
            await v.screenshot(ARTIFACTS / "run-ended.png")

    # the watch socket carries no input: what a viewer sends never reaches the tab
    cookie = cookie_of(d, person_link(d, "bo"))
    said = asyncio.run(poke(d, cookie, f"/runs/{run}/stages/report/watch"))
    assert "BINARY" in said or "TEXT" in said
    assert as_stage(env, "get", "value", "input[name=user]").stdout.strip() == ""
    assert as_stage(env, "get", "url").stdout.strip() == f"{a}/login"
    asyncio.run(person())
    deadline = time.monotonic() + 30
    while d.call("GET", f"/v1/runs/{run}")[1]["state"] != "ended" and time.monotonic() < deadline:
        time.sleep(0.3)
    ended = d.call("GET", f"/v1/runs/{run}")[1]
    assert ended["state"] == "ended" and ended["outcome"] == "cancelled", ended
    assert as_stage(env, "get", "url").returncode != 0          # its gate token is gone
    # that command started a session daemon of its own (as a stage's would): the test ends it
    end_session_daemons(env)
    records = [(r["event"], r["fields"]) for r in LocalAuditSink(d.home, read_only=True).records(run=run)]
    watched = [f["by"] for e, f in records if e == "console_stage_watched"]
    assert set(watched) == {"console:ana", "console:bo"}, records
    assert [f["by"] for e, f in records if e == "console_run_ended"] == ["console:ana"]
    timeline = (d.home / "records" / run / "timeline.jsonl").read_text()
    kinds = [json.loads(x)["kind"] for x in timeline.splitlines()]
    assert kinds.count("console") == 3 and kinds[-1] == "run_ended"
    for secret in (cookie, link.split("t=", 1)[1], env["AGENT_BROWSER_CDP"].rsplit("/", 1)[1]):
        assert secret not in timeline
