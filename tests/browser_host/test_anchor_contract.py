"""BrowserHost contract: the same behaviours against the fake and the real Chromium (the guard
starts both itself, DevTools over a pipe)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import psutil
import pytest

from sfguard.supervisor.browsers import agent_browser as ab
from sfguard.supervisor.browsers.host import AnchorError
from sfguard.supervisor.procs import scan_orphans, terminate_recorded
from tests.netscan import listening_ports_of_tree


async def settle(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


async def open_page(anchor, url: str) -> str:
    """Open `url` in a new tab over the anchor's pipe; returns the final location."""
    s = await anchor.pipe.session("test")
    try:
        tid = (await s.call("Target.createTarget", {"url": "about:blank"}))["targetId"]
        sid = (await s.call("Target.attachToTarget", {"targetId": tid, "flatten": True}))["sessionId"]
        await s.call("Page.navigate", {"url": url}, session=sid)
        for _ in range(100):
            res = await s.call("Runtime.evaluate", {"expression": "document.readyState + ' ' + location.href",
                                                    "returnByValue": True}, session=sid)
            value = (res.get("result") or {}).get("value")
            if value is None:     # the fake browser answers {}
                return url
            state, _, href = value.partition(" ")
            if state == "complete" and href != "about:blank":
                return href
            await asyncio.sleep(0.1)
        raise AssertionError("page did not load")
    finally:
        await s.close()


async def test_launch_gives_live_anchor_on_a_pipe_with_a_scrubbed_env(rig, monkeypatch):
    for name in ("HTTP_PROXY", "https_proxy", "ALL_PROXY", "NO_PROXY", "AGENT_BROWSER_PROFILE"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        assert rig.host.alive(anchor)
        assert [r.kind for r in anchor.processes] == ["browser"]
        proc = psutil.Process(anchor.record("browser").pid)
        cmd = proc.cmdline()
        assert "--remote-debugging-pipe" in cmd
        assert not any("remote-debugging-port" in a for a in cmd)
        assert f"--user-data-dir={rig.root / 'p1'}" in cmd
        env = proc.environ()
        for leak in ("HTTP_PROXY", "https_proxy", "ALL_PROXY", "NO_PROXY", "AGENT_BROWSER_PROFILE"):
            assert leak not in env
        assert os.getpgid(proc.pid) == proc.pid          # its own process group
        assert "pipe" not in repr(anchor) and "pipe" not in json.dumps(anchor.describe())
        assert (rig.root / "s").stat().st_mode & 0o777 == 0o700
        assert (rig.root / "p1").stat().st_mode & 0o777 == 0o700
    finally:
        await rig.host.close_anchor(anchor)


async def test_no_browser_process_listens_on_any_tcp_port(rig, site):
    """Issue 13 layer 1: scan every listening TCP socket of the machine (/proc/net/tcp, tcp6,
    inodes mapped to pids through /proc/PID/fd) while the browser has a page open."""
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        await open_page(anchor, site + "/")
        tree = [anchor.record("browser").pid] + [c.pid for c in psutil.Process(anchor.pid).children(recursive=True)]
        if rig.kind == "real":
            assert len(tree) > 2                          # renderers, GPU, network service...
        assert listening_ports_of_tree(anchor.pid) == {}
    finally:
        await rig.host.close_anchor(anchor)


async def test_open_page_of_fixture_site_over_the_pipe(rig, site):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        url = await open_page(anchor, site + "/account")
        if rig.kind == "real":
            assert url == site + "/login?next=/account"   # the site redirected a logged-out visitor
    finally:
        await rig.host.close_anchor(anchor)


async def test_close_is_graceful_and_leaves_no_process(rig):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    report = await rig.host.close_anchor(anchor)
    assert report.graceful and report.terminated == []
    assert not any(r.alive() for r in anchor.processes)
    assert not rig.host.alive(anchor)
    assert await settle(lambda: scan_orphans([rig.root]) == [])
    assert (rig.root / "p1").is_dir()          # a real profile stays (the store reseals it)
    assert not (rig.root / "p1" / "SingletonLock").exists()


async def test_throwaway_profile_is_deleted_at_close(rig):
    anchor = await rig.host.launch_anchor(rig.spec(None))
    assert anchor.temp_profile and anchor.profile_dir.is_dir()
    assert anchor.profile_dir.parent == rig.root / "tmp"
    await rig.host.close_anchor(anchor)
    assert not anchor.profile_dir.exists()


async def test_a_killed_browser_is_seen_dead_through_its_pipe(rig):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    browser = anchor.record("browser")
    try:
        os.kill(browser.pid, signal.SIGKILL)
        await asyncio.wait_for(anchor.pipe.closed.wait(), 10)    # the pipe closing = browser dead
        assert not rig.host.alive(anchor)
        terminate_recorded(anchor.processes, 5)
        assert await settle(lambda: scan_orphans([rig.root]) == [])
    finally:
        await rig.host.close_anchor(anchor)


async def test_stage_session_through_the_gate_gets_own_tab_stream_off(rig, gate):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        env = await rig.stage(anchor, gate)
        # a tab to bind to that is not a target id is refused, and nothing is left of the try
        with pytest.raises(AnchorError, match="target id"):
            await rig.host.open_stage_session(env, target_id="../x")
        assert ab.session_files(rig.root / "s", env["AGENT_BROWSER_SESSION"]) == []
        stage = await rig.host.open_stage_session(env)
        assert [r.kind for r in stage.processes] == ["daemon"]
        assert (await ab.run_json(env, "stream", "status", binary=rig.binary))["enabled"] is False
        report = await rig.host.close_stage_session(env)
        assert report.graceful and report.terminated == []
        assert not any(r.alive() for r in stage.processes)
        assert ab.session_files(rig.root / "s", env["AGENT_BROWSER_SESSION"]) == []
        assert rig.host.alive(anchor)             # Chrome stays for the next stage
    finally:
        await rig.host.close_anchor(anchor)


async def test_stage_session_bound_to_a_given_tab_makes_no_tab_of_its_own(rig, gate, site):
    """A session given a tab that is the stage's (the start-up tab, or one the gate made) is
    pinned to it: the stage sees that one tab, and its first `open` loads there."""
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        key = f"bound-{anchor.session}"
        url = gate.add_stage(key, anchor.pipe)
        env = ab.stage_env(session=f"stb{os.getpid()}", socket_dir=rig.root / "s",
                           config_path=rig.root / "cfg.json", cdp_url=url)
        tab = await gate.create_stage_tab(key)
        stage = await rig.host.open_stage_session(env, target_id=tab)
        assert stage.target_id == tab
        pin = rig.root / "s" / f"{env['AGENT_BROWSER_SESSION']}.target"
        assert pin.stat().st_mode & 0o777 == 0o600
        assert json.loads(pin.read_text())["targetId"] == tab
        tabs = (await ab.run_json(env, "tab", "list", binary=rig.binary))["tabs"]
        assert [t["targetId"] for t in tabs] == [tab]
        await ab.run_json(env, "open", site + "/", binary=rig.binary)
        tabs = (await ab.run_json(env, "tab", "list", binary=rig.binary))["tabs"]
        assert [(t["targetId"], t["url"]) for t in tabs] == [(tab, site + "/")]
        assert gate.stage_targets(key) == {tab}          # the page loaded in the given tab
        await rig.host.close_stage_session(env)
        await gate.revoke(key, close_tabs=True)
    finally:
        await rig.host.close_anchor(anchor)


async def test_second_anchor_on_a_profile_in_use_is_refused(rig):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        with pytest.raises(AnchorError, match="already open"):
            await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
        assert rig.host.alive(anchor)
    finally:
        await rig.host.close_anchor(anchor)


async def test_a_profile_in_use_is_found_without_its_singleton_lock(rig):
    """The safety net behind the lease: with the profile's SingletonLock gone, the process
    scan still finds the browser that runs on it, and a second launch is refused."""
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        (rig.root / "p1" / "SingletonLock").unlink()
        with pytest.raises(AnchorError, match="already open"):
            await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
        assert rig.host.alive(anchor)
    finally:
        await rig.host.close_anchor(anchor)
