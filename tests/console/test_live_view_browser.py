"""The live-view login handoff with real browsers: a headless guard, a login stage, and a
second headless Chromium (unguarded, the "person") that signs in through the live-view page."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from sfguard.supervisor.console.viewer import Viewer, scripted_login
from sfguard.supervisor.profiles.audit import LOG_FILE
from tests.console.conftest import ARTIFACTS, link

pytestmark = pytest.mark.browser

CHECK = {"logged_in": "http://site-a.test:{p}/account", "logged_out": ["http://site-a.test:{p}/login*"],
         "url": "http://site-a.test:{p}/account", "selector": "#signed-in"}


def check_spec(port: int) -> dict:
    return {k: ([x.format(p=port) for x in v] if isinstance(v, list) else v.format(p=port))
            for k, v in CHECK.items()}


def browser(port: int) -> dict:
    return {"profile": "fixture", "headed": False, "allow_domains": [f"site-a.test:{port}"],
            "login_check": check_spec(port)}


def site_json(port: int, what: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{what}.json", timeout=10) as r:
        return json.load(r)


def hits(port: int, host: str) -> int:
    return sum(r["count"] for r in site_json(port, "hits")["hits"] if r["host"].split(":")[0] == host)


def get(url: str, cookie: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_live_view_login_then_link_dead_then_second_run_logged_in(guard):
    started = time.time() - 1
    port = guard.site
    d = guard
    # run 1: the check says logged out, the login stage opens a live_view handoff
    assert d.call("POST", "/v1/runs", {"run_id": "lv-1"})[0] == 201
    status, ans = d.call("POST", "/v1/runs/lv-1/stages", {"stage_id": "login", "attempt": 1,
                                                         "browser": browser(port)})
    assert status == 200, ans
    status, res = d.call("POST", "/v1/runs/lv-1/login-check", {"profile": "fixture",
                                                               "login_check": check_spec(port)})
    assert status == 200 and res["logged_in"] is False, res
    status, payload = d.call("POST", "/v1/runs/lv-1/handoff", {
        "profile": "fixture", "site": "site-a.test", "reason": "please sign in",
        "url": f"http://site-a.test:{port}/login", "kind": "auto", "stage_id": "login"})
    assert status == 200, payload
    assert payload["kind"] == "live_view" and payload["url"].startswith(d.console + "/live/")
    assert d.call("GET", "/v1/runs/lv-1/handoff")[1]["state"] == "open"

    # the person, in a browser of their own, signs in through the page and presses Done
    seen_before_click = []

    async def before_click():
        seen_before_click.append(await asyncio.to_thread(site_json, port, "submits"))

    out = asyncio.run(scripted_login(payload["url"], "operator", "correct-horse", shots=ARTIFACTS,
                                     before_click=before_click))
    assert out["pixels_changed"], "the login tab's pixels did not change after typing"
    assert out["frames_after"] > out["frames_before"]
    assert "logged in" in out["result"] and "NOT" not in out["result"], out
    # the form went to the site once, after the click, and it was sent by a pointer on the
    # button: the page's own submit handler says so (Enter would have said "keyboard")
    assert seen_before_click == [{"submits": []}]
    assert site_json(port, "submits")["submits"] == [
        {"host": f"site-a.test:{port}", "via": "click", "ok": True}]
    assert "Enter" not in out["keys"], out["keys"]

    status, st = d.call("GET", "/v1/runs/lv-1/handoff?wait=5")
    assert status == 200 and st["state"] == "done" and st["logged_in"] is True, st
    # the guard's own check is what verify compares with
    assert d.call("POST", "/v1/runs/lv-1/login-check/verify",
                  {"profile": "fixture", "reported": {"logged_in": True, "url": st["url"]}})[0] == 200

    # the link is dead now: the page, its WebSocket, Done again
    code, body = get(payload["url"])
    assert code in (401, 410), code
    code, _ = get(payload["url"].split("?")[0])
    assert code in (401, 410)
    # the work stage finds the profile logged in (same run)
    assert d.call("POST", "/v1/runs/lv-1/stages/login/end", {"outcome": "succeeded"})[0] == 200
    status, res = d.call("POST", "/v1/runs/lv-1/login-check", {"profile": "fixture",
                                                               "login_check": check_spec(port)})
    assert res["logged_in"] is True
    assert d.call("POST", "/v1/runs/lv-1/end", {"outcome": "succeeded"})[0] == 200

    # run 2: the sealed profile is still logged in: no handoff needed
    assert d.call("POST", "/v1/runs", {"run_id": "lv-2"})[0] == 201
    assert d.call("POST", "/v1/runs/lv-2/stages", {"stage_id": "check", "attempt": 1,
                                                   "browser": browser(port)})[0] == 200
    status, res = d.call("POST", "/v1/runs/lv-2/login-check", {"profile": "fixture",
                                                               "login_check": check_spec(port)})
    assert res["logged_in"] is True, res
    assert d.call("POST", "/v1/runs/lv-2/end", {"outcome": "succeeded"})[0] == 200

    # audit: opened, viewed, confirmed; no token, cookie or CDP address anywhere
    audit = (d.home / LOG_FILE).read_text() if (d.home / LOG_FILE).exists() else ""
    events = [json.loads(l)["event"] for l in audit.splitlines() if l.strip()]
    assert "handoff_opened" in events and "handoff_viewed" in events and "handoff_confirmed" in events
    token = payload["url"].split("t=")[1]
    assert token not in audit and token not in d.log.read_text()

    # the console's pages, as an operator sees them: screenshots for the CI artifacts and the
    # docs, and a scan of everything shown for secrets
    seen = asyncio.run(console_pages(link(d), out["console_log"]))
    secrets_scan(seen + [audit, d.log.read_text()], [token])
    # every page's picture was written by this test, for CI to keep
    for name in ("console-overview", "console-decisions", "console-profiles", "console-audit",
                 "console-live-view", "live-before", "live-typed", "live-result"):
        shot = ARTIFACTS / f"{name}.png"
        assert shot.stat().st_mtime >= started and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot


async def console_pages(url: str, live_console: list[str]) -> list[str]:
    texts = []
    async with Viewer() as v:
        await v.goto(url)
        for name, path in (("overview", "/"), ("decisions", "/decisions?decision=deny"),
                           ("profiles", "/profiles"), ("audit", "/audit")):
            await v.goto(url.split("/login")[0] + path)
            await v.wait_for("document.getElementById('live') && document.getElementById('live').dataset.updated",
                             20, f"the {name} page's live update")
            texts.append(await v.eval("document.documentElement.outerHTML"))
            await v.screenshot(ARTIFACTS / f"console-{name}.png")
        texts += v.console_log + live_console
        # the session cookie is HttpOnly: no script of the page can read it
        assert await v.eval("document.cookie") == ""
    return texts


SECRET_PATTERNS = [
    re.compile(r"sf_(persist|session)=[^;\s\"']"),        # the fixture site's cookie values
    re.compile(r"wss?://[^\s\"']*devtools", re.I),          # a CDP address
    re.compile(r"b-[0-9a-f]{8}:[A-Za-z0-9_-]{20,}@"),        # a proxy credential in a URL
    re.compile(r"[?&]t=[A-Za-z0-9_-]{20,}"),                 # a link token
]


def secrets_scan(texts: list[str], values: list[str]) -> None:
    for text in texts:
        for pat in SECRET_PATTERNS:
            assert not pat.search(text), f"{pat.pattern} in {text[:200]!r}"
        for v in values:
            assert v not in text


def stage_agent_browser(env: dict, *args: str) -> subprocess.CompletedProcess:
    """agent-browser as the stage runs it: with the env the guard's stage answer gave, nothing
    else."""
    from sfguard.supervisor.browsers import tools
    stage_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env}
    return subprocess.run([tools.find_agent_browser().path, *args], env=stage_env,
                          capture_output=True, text=True, timeout=90)


def test_live_view_refuses_navigation_outside_the_allowed_sites(guard):
    """From the live-view page, the person types a site the stage does not allow into the
    address box: refused, the login tab stays where it was, nothing reaches that site. The
    address box itself works (an allowed address opens), and the run's proxy refuses the same
    site to the same browser."""
    started = time.time() - 1
    port, d = guard.site, guard
    a, b = f"http://site-a.test:{port}", f"http://site-b.test:{port}"
    assert d.call("POST", "/v1/runs", {"run_id": "lv-n"})[0] == 201
    status, ans = d.call("POST", "/v1/runs/lv-n/stages", {"stage_id": "login", "attempt": 1,
                                                         "browser": browser(port)})
    assert status == 200, ans
    status, payload = d.call("POST", "/v1/runs/lv-n/handoff", {
        "profile": "fixture", "site": "site-a.test", "reason": "please sign in",
        "url": f"{a}/login", "kind": "live_view", "stage_id": "login"})
    assert status == 200, payload

    async def person() -> dict:
        async with Viewer() as v:
            await v.open_live_view(payload["url"])
            await v.wait_for(f"document.getElementById('address').textContent === '{a}/login'", 20,
                             "the login page's address")

            async def go(url: str) -> None:          # the page's address box, typed and clicked
                await v.eval("document.getElementById('go-url').value = ''")
                await v.click_selector("#go-url")
                await v.type_text(url)
                await v.click_selector("#go-button")

            await go(f"{b}/account")
            refused = await v.wait_for("document.getElementById('refused').textContent", 20,
                                       "the refusal to show")
            await asyncio.sleep(1.0)      # time for a navigation that should not happen
            frames = await v.frames()
            await v.screenshot(ARTIFACTS / "console-live-view-refused.png")
            assert (ARTIFACTS / "console-live-view-refused.png").stat().st_mtime >= started
            stayed = await v.eval("document.getElementById('address').textContent")
            # an allowed address from the same box opens (the box is not what refuses)
            await go(f"{a}/")
            await v.wait_for(f"document.getElementById('address').textContent === '{a}/'", 20,
                             "the allowed address to open")
            await v.wait_for(f"Number(document.getElementById('screen').dataset.frames || 0) > {frames}",
                             45, "a frame of the allowed page")
            await v.click_selector("#cancel")
            await v.wait_for("!!document.getElementById('result')", 20, "the end of the live view")
            return {"refused": refused, "stayed": stayed}

    out = asyncio.run(person())
    assert out["refused"] == f"Refused (outside this login's allowed sites): {b}/account", out
    assert out["stayed"] == f"{a}/login", out
    assert hits(port, "site-b.test") == 0            # the refused site was never reached
    assert hits(port, "site-a.test") >= 2            # the login page, then the allowed address

    # the run's proxy refuses the same site to the same browser: a stage of this run, through
    # its own env, gets the guard's 403 and the site sees nothing
    status, ans = d.call("POST", "/v1/runs/lv-n/stages", {"stage_id": "probe", "attempt": 1,
                                                         "browser": browser(port)})
    assert status == 200, ans
    r = stage_agent_browser(ans["env"], "open", f"{b}/account")
    if r.returncode == 0:                            # plain HTTP: the guard's 403 page shows
        page = stage_agent_browser(ans["env"], "get", "text", "body").stdout
        assert "site-b.test is not in this run's allow_domains" in page, page
    assert hits(port, "site-b.test") == 0
    decisions = [json.loads(l) for l in (d.home / "logs" / "decisions.log").read_text().splitlines() if l.strip()]
    assert any(x["host"] == "site-b.test" and x["decision"] == "deny" and x["run"] == "lv-n"
               for x in decisions), decisions[-5:]
    assert d.call("POST", "/v1/runs/lv-n/stages/probe/end", {"outcome": "succeeded"})[0] == 200
    assert d.call("POST", "/v1/runs/lv-n/end", {"outcome": "failed"})[0] == 200


def test_cancel_fails_the_stage_and_the_link_and_its_socket_die(guard):
    port, d = guard.site, guard
    assert d.call("POST", "/v1/runs", {"run_id": "lv-c"})[0] == 201
    assert d.call("POST", "/v1/runs/lv-c/stages", {"stage_id": "login", "attempt": 1,
                                                   "browser": browser(port)})[0] == 200
    status, payload = d.call("POST", "/v1/runs/lv-c/handoff", {
        "profile": "fixture", "site": "site-a.test", "reason": "please sign in",
        "url": f"http://site-a.test:{port}/login", "kind": "live_view", "stage_id": "login"})
    assert status == 200, payload
    # a stage_id the run does not have is refused
    assert d.call("POST", "/v1/runs/lv-c/handoff", {
        "profile": "fixture", "site": "s", "reason": "r", "url": f"http://site-a.test:{port}/login",
        "kind": "live_view", "stage_id": "nope"})[0] == 404

    async def person() -> dict:
        async with Viewer() as v:
            await v.open_live_view(payload["url"])
            ws = ("location.href.replace(/^http/, 'ws').replace(/[?#].*$/, '').replace(/\\/$/, '') + '/ws'")
            assert await v.eval(f"window.__ws = new WebSocket({ws}); new Promise(r => "
                                "{ __ws.onopen = () => r(true); __ws.onerror = () => r(false); })")
            # Cancel as the page's form would send it, but from a script, so this page (and its
            # sockets) stay open to watch what happens to them
            text = await v.eval("(() => { const f = document.querySelector('form[action$=\"/cancel\"]'); "
                                "return fetch(f.action, {method: 'POST', body: new URLSearchParams(new FormData(f))})"
                                ".then(r => r.text()); })()")
            await v.wait_for("document.body.dataset.ended === 'cancelled'", 10, "the page to show the end")
            # the socket opened before is closed by the guard: no more input can reach the tab
            await v.wait_for("window.__ws.readyState === 3", 10, "the old socket to close")
            sent = await v.eval("(() => { try { __ws.send(JSON.stringify({t: 'text', text: 'x'})); "
                                "return 'sent'; } catch (e) { return 'refused'; } })()")
            again = await v.eval(f"new Promise(r => {{ const w = new WebSocket({ws}); "
                                 "w.onopen = () => r('open'); w.onerror = () => r('refused'); })")
            page = await v.eval("fetch('/live/' + location.pathname.split('/')[2]).then(r => r.status)")
            return {"text": text, "again": again, "page": page, "sent": sent}

    out = asyncio.run(person())
    assert "cancelled" in out["text"], out
    assert out["again"] == "refused" and out["page"] in (401, 410), out
    status, st = d.call("GET", "/v1/runs/lv-c/handoff")
    assert st["state"] == "cancelled"
    status, stage = d.call("GET", "/v1/runs/lv-c/stages/login")
    assert stage == {"state": "ended", "outcome": "failed"}, stage
    # the link itself is dead too
    code, _ = get(payload["url"])
    assert code == 401
    assert d.call("POST", "/v1/runs/lv-c/end", {"outcome": "failed"})[0] == 200
    audit = (d.home / LOG_FILE).read_text()
    closed = [json.loads(l) for l in audit.splitlines() if '"handoff_closed"' in l]
    assert closed and closed[-1]["fields"]["outcome"] == "cancelled" and closed[-1]["fields"]["stage"] == "login"
    assert closed[-1]["fields"]["by"].startswith("s-")


def test_profiles_login_without_a_display_uses_the_live_view(guard):
    """`sfguard profiles login` on a guard with no screen prints a one-time live-view link; a
    person signs in through it and presses Done; --logged-in then checks the login."""
    import subprocess
    import sys
    import time

    from tests.demo.conftest import ROOT, cli_env
    port = guard.site
    proc = subprocess.Popen(
        [sys.executable, "-m", "sfguard.cli.main", "profiles", "login", "acct", "--home", str(guard.home),
         "--url", f"http://site-a.test:{port}/account", "--logged-in", f"http://site-a.test:{port}/account",
         "--logged-out", f"http://site-a.test:{port}/login*",
         "--wait", "120"],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "/live/" in line:
                url = line.strip()
        assert url, "".join(lines) + proc.stderr.read() if proc.poll() is not None else "".join(lines)
        out = asyncio.run(scripted_login(url, "operator", "correct-horse"))
        assert "logged in" in out["result"]
        assert site_json(port, "submits")["submits"] == [
            {"host": f"site-a.test:{port}", "via": "click", "ok": True}]
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, (rest, err)
    assert "live view ended: done" in rest and "logged in" in rest.lower(), rest


def test_an_unused_live_view_expires_and_its_link_dies(guard):
    port, d = guard.site, guard
    assert d.call("POST", "/v1/runs", {"run_id": "lv-t"})[0] == 201
    assert d.call("POST", "/v1/runs/lv-t/stages", {"stage_id": "login", "attempt": 1,
                                                   "browser": browser(port)})[0] == 200
    status, payload = d.call("POST", "/v1/runs/lv-t/handoff", {
        "profile": "fixture", "site": "site-a.test", "reason": "please sign in",
        "url": f"http://site-a.test:{port}/login", "kind": "live_view", "stage_id": "login",
        "timeout_s": 10})
    assert status == 200, payload
    status, st = d.call("GET", "/v1/runs/lv-t/handoff?wait=30")
    assert st["state"] == "expired", st
    assert get(payload["url"])[0] == 401
    # the stage itself goes on (only Cancel fails it); the runner decides what to do
    assert d.call("GET", "/v1/runs/lv-t/stages/login")[1]["state"] == "ready"
    assert d.call("POST", "/v1/runs/lv-t/end", {"outcome": "failed"})[0] == 200
    audit = (d.home / LOG_FILE).read_text()
    assert '"outcome":"expired"' in audit.replace(" ", "")
