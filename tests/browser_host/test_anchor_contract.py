"""BrowserHost contract: the same behaviours against the fake and the real agent-browser."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import psutil
import pytest

from supervisor import agent_browser as ab
from supervisor.browser_host import AnchorError
from supervisor.sweep import scan_orphans, terminate_recorded

EXPECTED_AB_KEYS = {
    "AGENT_BROWSER_SESSION", "AGENT_BROWSER_SOCKET_DIR", "AGENT_BROWSER_CONFIG",
    "AGENT_BROWSER_EXECUTABLE_PATH", "AGENT_BROWSER_PROFILE", "AGENT_BROWSER_IDLE_TIMEOUT_MS",
    "AGENT_BROWSER_ARGS", "AGENT_BROWSER_HEADED", "AGENT_BROWSER_NO_XVFB",
    "AGENT_BROWSER_NO_VERSION_CHECK",
}


def process_environ(pid: int) -> dict[str, str]:
    return psutil.Process(pid).environ()


async def settle(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


async def test_launch_gives_live_anchor_with_exact_env_and_no_leaks(rig, monkeypatch):
    # Ambient variables agent-browser would fall back to must not reach it.
    for name in ("HTTP_PROXY", "https_proxy", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("AGENT_BROWSER_USER_AGENT", "ambient")
    monkeypatch.setenv("AGENT_BROWSER_ALLOWED_DOMAINS", "ambient.test")
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        assert rig.host.alive(anchor)
        assert {r.kind for r in anchor.processes} == {"daemon", "browser"}
        assert {k for k in anchor.env if k.startswith("AGENT_BROWSER_")} == EXPECTED_AB_KEYS
        assert set(anchor.env) - EXPECTED_AB_KEYS <= set(ab.INHERITED_VARS)
        assert anchor.env["AGENT_BROWSER_PROFILE"] == str(rig.root / "p1")
        assert anchor.env["AGENT_BROWSER_IDLE_TIMEOUT_MS"] == "0"
        daemon_env = process_environ(anchor.record("daemon").pid)
        for leak in ("HTTP_PROXY", "https_proxy", "ALL_PROXY", "NO_PROXY",
                     "AGENT_BROWSER_USER_AGENT", "AGENT_BROWSER_ALLOWED_DOMAINS"):
            assert leak not in daemon_env
        assert daemon_env["AGENT_BROWSER_SESSION"] == anchor.session
        # The raw CDP address is browser-level and stays out of repr/describe.
        assert anchor.cdp_url.startswith("ws://127.0.0.1:") and "/devtools/browser/" in anchor.cdp_url
        assert anchor.cdp_url not in repr(anchor) and anchor.cdp_url not in json.dumps(anchor.describe())
        # Private dirs and the pinned config.
        assert (rig.root / "s").stat().st_mode & 0o777 == 0o700
        assert (rig.root / "cfg.json").read_bytes() == b"{}\n"
        assert (rig.root / "cfg.json").stat().st_mode & 0o777 == 0o600
        if rig.kind == "fake":
            calls = rig.calls()
            assert calls and all(c["leaked"] == [] for c in calls)
            # every command of the session carried the same env, from the socket dir as cwd
            envs = {json.dumps(c["env"], sort_keys=True) for c in calls}
            assert len(envs) == 1
            assert all(c["cwd"] == str(rig.root / "s") for c in calls)
    finally:
        await rig.host.close_anchor(anchor)


async def test_stream_server_is_disabled(rig):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        status = await ab.run_json(anchor.env, "stream", "status", binary=rig.binary)
        assert status["enabled"] is False and status.get("port") is None
        assert not (rig.root / "s" / f"{anchor.session}.stream").exists()
    finally:
        await rig.host.close_anchor(anchor)


async def test_open_page_of_fixture_site(rig, site):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        await ab.run_ok(anchor.env, "open", site + "/account", binary=rig.binary)
        url = (await ab.run_ok(anchor.env, "get", "url", binary=rig.binary)).strip()
        if rig.kind == "real":
            assert url == site + "/login?next=/account"   # the site redirected a logged-out visitor
        else:
            assert url == site + "/account"
    finally:
        await rig.host.close_anchor(anchor)


async def test_close_leaves_no_process_and_no_session_files(rig):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    report = await rig.host.close_anchor(anchor)
    assert report.graceful and report.terminated == []
    assert not any(r.alive() for r in anchor.processes)
    assert not rig.host.alive(anchor)
    assert await settle(lambda: scan_orphans([rig.root]) == [])
    assert ab.session_files(rig.root / "s", anchor.session) == []
    assert (rig.root / "p1").is_dir()          # a real profile stays (the store reseals it)


async def test_throwaway_profile_is_deleted_at_close(rig):
    anchor = await rig.host.launch_anchor(rig.spec(None))
    assert anchor.temp_profile and anchor.profile_dir.is_dir()
    assert anchor.profile_dir.parent == rig.root / "tmp"
    await rig.host.close_anchor(anchor)
    assert not anchor.profile_dir.exists()


async def test_killed_daemon_leaves_browser_alive_and_terminate_recorded_ends_it(rig):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    daemon, browser = anchor.record("daemon"), anchor.record("browser")
    try:
        os.kill(daemon.pid, signal.SIGKILL)
        assert await settle(lambda: not daemon.alive(), 5)
        await asyncio.sleep(0.5)
        assert browser.alive()                    # Chrome survives a SIGKILLed daemon
        assert not rig.host.alive(anchor)
        ended = terminate_recorded(anchor.processes, 5)
        assert [r.kind for r in ended] == ["browser"]
        assert not browser.alive()
        assert await settle(lambda: scan_orphans([rig.root]) == [])
    finally:
        await rig.host.close_anchor(anchor)


async def test_stage_session_gets_own_tab_and_close_removes_only_it(rig):
    anchor = await rig.host.launch_anchor(rig.spec(rig.root / "p1"))
    try:
        env = ab.stage_env(session="st-" + anchor.session, socket_dir=rig.root / "s",
                           config_path=rig.root / "cfg.json", cdp_url=anchor.cdp_url)
        stage = await rig.host.open_stage_session(env)
        assert stage.target_id and [r.kind for r in stage.processes] == ["daemon"]
        assert (await ab.run_json(env, "stream", "status", binary=rig.binary))["enabled"] is False
        before = await ab.run_json(env, "tab", "list", binary=rig.binary)
        assert stage.target_id in {t["targetId"] for t in before["tabs"]}
        report = await rig.host.close_stage_session(env)
        assert report.graceful and report.terminated == []
        assert not any(r.alive() for r in stage.processes)
        assert ab.session_files(rig.root / "s", env["AGENT_BROWSER_SESSION"]) == []
        assert rig.host.alive(anchor)             # Chrome stays for the next stage
        if rig.kind == "real":
            after = await ab.run_json(anchor.env, "tab", "list", binary=rig.binary)
            assert stage.target_id not in {t["targetId"] for t in after["tabs"]}
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
