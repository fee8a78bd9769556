"""The console's approvals page with real browsers: a guarded stage (writes: gate) submits the
login form; a person, in a browser of their own signed in to the console, sees the held write
on /approvals (the request, the masked password, a screenshot of the tab); then alice, on a
phone-sized screen (390x844, a mobile viewport) with a link made for her (`sfguard console --as
alice`), sees the same page fit her screen and approves it with the page's button: the site
receives exactly one POST, and the audit chain names alice as the decider. Screenshots go to
.ci-artifacts/console/."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from sfguard.supervisor.console.viewer import Viewer
from tests.console.conftest import ARTIFACTS, PHONE, ROOT, assert_fits_a_phone, link, phone_fit
from tests.daemon.test_real_browser import as_stage

pytestmark = pytest.mark.browser


def submits(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/submits.json", timeout=10) as r:
        return len(json.load(r)["submits"])


def api_get(d, path: str) -> tuple[int, str, bytes]:
    """A raw GET on the guard's unix socket (the answer may be a picture, not JSON)."""
    from sfguard.supervisor.client.guard_client import _UnixConnection, socket_path
    conn = _UnixConnection(str(socket_path(d.home)), 30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", "").split(";")[0], resp.read()
    finally:
        conn.close()


def test_a_person_approves_a_held_write_from_the_console(guard):
    d, port = guard, guard.site
    assert d.call("POST", "/v1/runs", {"run_id": "ap-1"})[0] == 201
    status, ans = d.call("POST", "/v1/runs/ap-1/stages", {"stage_id": "post", "attempt": 1, "browser": {
        "profile": "fixture", "headed": False, "allow_domains": [f"site-a.test:{port}"], "writes": "gate"}})
    assert status == 200, ans
    env = ans["env"]
    assert as_stage(env, "open", f"http://site-a.test:{port}/login").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    as_stage(env, "click", "button[type=submit]", timeout=60)
    status, body = d.call("GET", "/v1/approvals?state=pending&wait=20")
    assert status == 200 and len(body["approvals"]) == 1, body
    held = body["approvals"][0]
    assert held["screenshot"] is True and held["tab_url"] == f"http://site-a.test:{port}/login", held
    # the control API serves the same picture
    status, ctype, png = api_get(d, f"/v1/approvals/{held['id']}/screenshot")
    assert (status, ctype) == (200, "image/png") and png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    before = submits(port)

    named = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "console", "--as", "alice",
                            "--home", str(d.home)], cwd=ROOT, env=d.env, capture_output=True, text=True,
                           timeout=60)
    assert named.returncode == 0, named.stderr
    alice_link = named.stdout.splitlines()[0]

    async def show(v: Viewer, url: str) -> str:
        """Sign in with `url`, open the approvals page; the overview's text on the way."""
        await v.goto(url)
        await v.wait_for("location.pathname === '/'", 20, "the console after sign-in")
        overview = await v.eval("document.body.innerText")
        await v.goto(d.console + "/approvals")
        await v.wait_for(f"document.getElementById('{held['id']}') !== null", 20, "the held write")
        await v.wait_for(f"document.querySelector('#{held['id']} img.shot').naturalWidth > 0", 20,
                         "the tab's screenshot")
        return overview

    async def person() -> dict:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        async with Viewer() as v:                  # at a desk
            overview = await show(v, link(d))
            text = await v.eval(f"document.getElementById('{held['id']}').innerText")
            await v.screenshot(ARTIFACTS / "approvals-pending.png")
        async with Viewer(width=PHONE[0], height=PHONE[1], mobile=True) as v:   # alice, on her phone
            await show(v, alice_link)
            fit = await phone_fit(v)
            await v.screenshot(ARTIFACTS / "approvals-phone.png")
            await v.click_selector(f"#{held['id']} button[value=approve]")
            await v.wait_for("document.getElementById('no-pending') !== null", 20, "the page after approving")
            await v.screenshot(ARTIFACTS / "approvals-phone-decided.png")
            after = await v.eval("document.body.innerText")
            return {"overview": overview, "text": text, "after": after, "fit": fit}

    seen = asyncio.run(person())
    assert_fits_a_phone(seen["fit"], buttons=2)
    assert {b[0] for b in seen["fit"]["buttons"]} == {"approve", "deny"}
    assert "1 held write" in seen["overview"]
    assert f"POST site-a.test:{port}/login" in seen["text"] or "POST site-a.test/login" in seen["text"], seen["text"]
    assert "operator" in seen["text"] and "********" in seen["text"]
    assert "correct-horse" not in seen["text"]
    assert "approved" in seen["after"] and "console:alice" in seen["after"]
    deadline = time.monotonic() + 20
    while submits(port) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    assert submits(port) == before + 1                      # exactly once
    status, _, gone = api_get(d, f"/v1/approvals/{held['id']}/screenshot")
    assert status == 404 and json.loads(gone)["error"]["code"] == "screenshot_not_found"
    status, _, gone = api_get(d, "/v1/approvals/ap_" + "0" * 20 + "/screenshot")
    assert status == 404 and json.loads(gone)["error"]["code"] == "approval_not_found"
    status, one = d.call("GET", f"/v1/approvals/{held['id']}")
    assert one["state"] == "approved" and one["decided_by"] == "console:alice" and one["screenshot"] is False
    audit = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "audit", "show", "--run", "ap-1",
                            "--home", str(d.home)], cwd=ROOT, env=d.env, capture_output=True, text=True,
                           timeout=60)
    assert "write_approved" in audit.stdout and "console:alice" in audit.stdout, audit.stdout + audit.stderr
