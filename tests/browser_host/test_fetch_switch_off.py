"""Fetch only while needed: the pipe answers the run proxy's first challenge, then switches the
browser-wide Fetch interception off; Chromium keeps sending the credential from its auth cache.

The real-browser tests drive the daemon's run proxy (`RunProxy`, its decision log on disk) and
an anchor started by `LocalBrowserHost.launch_anchor`; pages are loaded over the anchor's pipe.
They show what a switched-off Fetch must not break: new origins, many parallel requests, new
connections after the proxy dropped every connection it had, and a new browser context. And
that it fails closed: a credential the proxy no longer accepts ends in an error page, never in
a request without the guard.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sfguard.supervisor.daemon.run_proxy import RunProxy
from sfguard.supervisor.gate.cdp_pipe import FETCH_QUIET

SCRIPTS = 10  # per origin


class Origin:
    """A loopback origin serving a page (scripts from every origin) and scripts; counts hits."""

    def __init__(self, page_fn) -> None:
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                outer.hits += 1
                if self.path.split("?")[0].endswith(".js"):
                    body, ctype = b"window.__n = (window.__n || 0) + 1;\n", "text/javascript"
                else:
                    body, ctype = page_fn().encode(), "text/html; charset=utf-8"
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Cache-Control", "no-store")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def page(origins: list[str]) -> str:
    tags = "".join(f'<script src="{o}/s{i}.js"></script>' for o in origins for i in range(SCRIPTS))
    return f"<!doctype html><html><head><title>p</title>{tags}</head><body>ok</body></html>"


class Tab:
    """A tab of an anchor driven over its pipe (as the guard's own login check does)."""

    def __init__(self, anchor, context: str | None = None) -> None:
        self.anchor, self.context = anchor, context

    async def open(self) -> Tab:
        self.cdp = await self.anchor.pipe.session("test")
        params = {"url": "about:blank"}
        if self.context:
            params["browserContextId"] = self.context
        self.target = (await self.cdp.call("Target.createTarget", params))["targetId"]
        self.session = (await self.cdp.call("Target.attachToTarget",
                                            {"targetId": self.target, "flatten": True}))["sessionId"]
        await self.cdp.call("Page.enable", session=self.session)
        return self

    async def load(self, url: str) -> tuple[str | None, int | None]:
        """Navigate; (error text, scripts run) once the load event fired or the navigation failed."""
        while not self.cdp.events.empty():
            self.cdp.events.get_nowait()
        nav = await self.cdp.call("Page.navigate", {"url": url}, session=self.session)
        if nav.get("errorText"):
            return nav["errorText"], None
        deadline = time.monotonic() + 30
        while True:
            ev = await asyncio.wait_for(self.cdp.events.get(), max(0.1, deadline - time.monotonic()))
            if ev.get("sessionId") == self.session and ev.get("method") == "Page.loadEventFired":
                break
        res = await self.cdp.call("Runtime.evaluate", {"expression": "window.__n || 0",
                                                       "returnByValue": True}, session=self.session)
        return None, res["result"]["value"]


async def wait_for(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.05)


async def settled(origins: list[Origin]) -> list[int]:
    """The origins' hit counts once no request (a late favicon) came for 0.5 s (bounded)."""
    last: list[int] = []
    for _ in range(40):
        now = [o.hits for o in origins]
        if now == last:
            break
        last = now
        await asyncio.sleep(0.5)
    return last


def decisions(log: Path) -> list[dict]:
    """The decision-log lines about the test's sites (Chromium's own background calls, e.g. to
    accounts.google.com, are logged too: denied, checked apart)."""
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    others = [d for d in lines if not str(d.get("host")).endswith(".test")]
    assert all(d["decision"] == "deny" for d in others), others
    return [d for d in lines if d not in others]


@pytest.fixture
async def guarded(real_rig):
    """Three origins, a run proxy resolving site-N.test to them, and an anchor behind it."""
    origins: list[Origin] = []
    names: list[str] = []
    for _ in range(3):
        origins.append(Origin(lambda: page(names)))
    names += [f"http://site-{i + 1}.test:{o.port}" for i, o in enumerate(origins)]
    policy = real_rig.root / "sites.yaml"
    policy.write_text("version: 1\nmode: enforce\nports: [80, 443, "
                      + ", ".join(str(o.port) for o in origins) + "]\nallow_always: []\nblock: []\n"
                      'private_networks:\n  allow: ["127.0.0.1/32"]\n')
    log = real_rig.root / "decisions.log"
    proxy = RunProxy("run-f", policy, log, {f"site-{i + 1}.test": "127.0.0.1" for i in range(3)})
    await proxy.start()
    anchor = None
    try:
        client = await proxy.add_client([f"site-{i + 1}.test" for i in range(3)])
        anchor = await real_rig.host.launch_anchor(real_rig.spec(
            None, proxy_url=proxy.url_for(client), allow_direct=False))
        yield anchor, proxy, client, names, origins, log
    finally:
        if anchor is not None:
            await real_rig.host.close_anchor(anchor)
        await proxy.stop()
        for o in origins:
            o.close()


@pytest.mark.browser
async def test_after_the_switch_off_new_origins_parallel_requests_and_new_connections_authenticate(guarded):
    anchor, proxy, client, names, origins, log = guarded
    tab = await Tab(anchor).open()
    # the first load: only site-1's page, so site-2 and site-3 are first seen after the switch-off
    err, n = await tab.load(f"{names[0]}/s0.js?first")
    assert err is None
    await wait_for(lambda: not anchor.pipe.fetch_on, "Fetch switched off", FETCH_QUIET + 10)
    hits = sum(await settled(origins))
    before = len(decisions(log))
    # 1 page + 30 scripts from 3 origins, the scripts in parallel, twice
    for k in range(2):
        err, n = await tab.load(f"{names[1]}/?after-{k}")
        assert (err, n) == (None, 3 * SCRIPTS)
    now = sum(await settled(origins))
    got = decisions(log)[before:]
    # every request that reached an origin (a favicon too) was decided and logged; a request
    # Chromium gives up after the decision (a favicon, on the next navigation) has a line only
    assert len(got) >= now - hits >= 2 * (1 + 3 * SCRIPTS)
    assert {(d["decision"], d["client"]) for d in got} == {("allow", client)}   # ... as this client
    assert not anchor.pipe.fetch_on

    # the proxy drops every connection it had (killed, restarted on its port by the guard)
    pid = proxy.proc.pid
    os.kill(pid, signal.SIGKILL)  # the run proxy this test started
    await proxy.proc.wait()
    await proxy.start()
    assert proxy.proc.pid != pid
    hits = sum(await settled(origins))
    before = len(decisions(log))
    err, n = await tab.load(f"{names[2]}/?after-restart")
    assert (err, n) == (None, 3 * SCRIPTS)
    now = sum(await settled(origins))
    got = decisions(log)[before:]
    assert len(got) >= now - hits >= 1 + 3 * SCRIPTS
    assert {d["client"] for d in got} == {client}
    assert not any(d["reason"] == "proxy_auth_failed" for d in decisions(log))


@pytest.mark.browser
async def test_loads_under_way_while_fetch_is_switched_off_complete(guarded):
    anchor, proxy, client, names, origins, log = guarded
    tab = await Tab(anchor).open()
    # loads back to back from the first challenge on: the switch-off (FETCH_QUIET after the
    # challenge) falls while requests are paused or in flight; two more loads follow it
    results, off_at = [], None
    for k in range(40):
        results.append(await tab.load(f"{names[k % 3]}/?k={k}"))
        if off_at is None and not anchor.pipe.fetch_on:
            off_at = k
        if off_at is not None and k >= off_at + 2:
            break
    assert off_at is not None, "Fetch was never switched off"
    assert results == [(None, 3 * SCRIPTS)] * len(results)


@pytest.mark.browser
async def test_a_new_browser_context_gets_its_challenge_answered_again(guarded):
    anchor, proxy, client, names, origins, log = guarded
    tab = await Tab(anchor).open()
    assert (await tab.load(f"{names[0]}/?first"))[0] is None
    await wait_for(lambda: not anchor.pipe.fetch_on, "Fetch switched off", FETCH_QUIET + 10)
    # a new context has an auth cache of its own (measured: without Fetch its first request
    # fails with ERR_INVALID_AUTH_CREDENTIALS); the pipe turns Fetch back on for it
    ctx = (await tab.cdp.call("Target.createBrowserContext"))["browserContextId"]
    assert anchor.pipe.fetch_on
    other = await Tab(anchor, ctx).open()
    assert await other.load(f"{names[1]}/?ctx") == (None, 3 * SCRIPTS)
    await wait_for(lambda: not anchor.pipe.fetch_on, "Fetch switched off again", FETCH_QUIET + 10)
    assert await other.load(f"{names[2]}/?ctx-2") == (None, 3 * SCRIPTS)
    assert await tab.load(f"{names[2]}/?default-ctx") == (None, 3 * SCRIPTS)


@pytest.mark.browser
async def test_a_credential_the_proxy_no_longer_accepts_fails_closed(guarded):
    anchor, proxy, client, names, origins, log = guarded
    tab = await Tab(anchor).open()
    assert (await tab.load(f"{names[0]}/?first"))[0] is None
    await wait_for(lambda: not anchor.pipe.fetch_on, "Fetch switched off", FETCH_QUIET + 10)
    hits = await settled(origins)
    await proxy.remove_client(client)     # what the guard does when the browser's run ends
    err, _ = await tab.load(f"{names[1]}/?removed")
    assert err == "net::ERR_INVALID_AUTH_CREDENTIALS"
    assert await settled(origins) == hits             # nothing reached any origin
    assert decisions(log)[-1]["reason"] == "proxy_auth_failed"


async def test_fetch_goes_off_after_the_answered_challenge_and_on_again_for_a_new_context(fake_rig):
    spec = fake_rig.spec(None, proxy_url="http://run-1:t0ken-secret@127.0.0.1:8080", allow_direct=False)
    anchor = await fake_rig.host.launch_anchor(spec)

    def fetch_calls() -> list[str]:
        return [e["method"] for e in fake_rig.browser_log()
                if str(e.get("method", "")).startswith(("Fetch.", "Target.createBrowserContext"))]

    try:
        # the fake challenges right after Fetch.enable; answered, then switched off once quiet
        await wait_for(lambda: "Fetch.disable" in fetch_calls(), "Fetch.disable", FETCH_QUIET + 10)
        assert fetch_calls() == ["Fetch.enable", "Fetch.continueWithAuth", "Fetch.disable"]
        assert not anchor.pipe.fetch_on
        cdp = await anchor.pipe.session("guard")
        await cdp.call("Target.createBrowserContext")
        await wait_for(lambda: fetch_calls().count("Fetch.disable") == 2, "second Fetch.disable",
                       FETCH_QUIET + 10)
        assert fetch_calls()[3:] == ["Fetch.enable", "Target.createBrowserContext",
                                     "Fetch.continueWithAuth", "Fetch.disable"]
    finally:
        await fake_rig.host.close_anchor(anchor)
