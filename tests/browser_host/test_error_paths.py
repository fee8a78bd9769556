"""Launch/close error paths, driven through the fake Chromium's failure injection."""
from __future__ import annotations

import asyncio

import pytest

from sfguard.supervisor.browsers.host import AnchorError
from sfguard.supervisor.procs import scan_orphans


@pytest.mark.parametrize("control,message", [
    ({"fail_start": True}, "exited during start"),
    ({"hang_start": True}, "did not answer in time"),
])
async def test_failed_launch_raises_and_leaves_nothing_behind(fake_rig, control, message):
    fake_rig.host.launch_timeout = 2.0 if "hang_start" in control else 20.0
    fake_rig.browser_control(**control)
    with pytest.raises(AnchorError, match=message):
        await fake_rig.host.launch_anchor(fake_rig.spec(None))
    assert scan_orphans([fake_rig.root]) == []             # the browser of a failed launch is ended
    assert list((fake_rig.root / "tmp").iterdir()) == []   # throw-away profile removed


async def test_headed_without_display_fails_clearly(fake_rig, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    with pytest.raises(AnchorError, match="DISPLAY"):
        await fake_rig.host.launch_anchor(fake_rig.spec(fake_rig.root / "p1", headed=True))
    assert scan_orphans([fake_rig.root]) == [] and fake_rig.browser_log() == []


async def test_launch_without_proxy_is_refused_unless_explicitly_direct(fake_rig):
    with pytest.raises(AnchorError, match="without the run's proxy"):
        await fake_rig.host.launch_anchor(fake_rig.spec(fake_rig.root / "p1", allow_direct=False))
    assert fake_rig.browser_log() == []


async def test_bad_proxy_url_is_refused_without_echoing_the_token(fake_rig):
    spec = fake_rig.spec(None, proxy_url="http://run:t0ken-secret@10.1.1.1:8080", allow_direct=False)
    with pytest.raises(AnchorError) as info:
        await fake_rig.host.launch_anchor(spec)
    assert "t0ken-secret" not in str(info.value)
    assert list((fake_rig.root / "tmp").iterdir()) == [] if (fake_rig.root / "tmp").exists() else True
    assert fake_rig.browser_log() == []


async def test_proxy_credential_answered_over_the_pipe_never_on_the_command_line(fake_rig):
    spec = fake_rig.spec(None, proxy_url="http://run-1:t0ken-secret@127.0.0.1:8080", allow_direct=False)
    anchor = await fake_rig.host.launch_anchor(spec)
    try:
        # the fake's challenge follows its Fetch.enable answer; the guard answers it at once
        for _ in range(100):
            if any(e.get("method") == "Fetch.continueWithAuth" for e in fake_rig.browser_log()):
                break
            await asyncio.sleep(0.1)
    finally:
        await fake_rig.host.close_anchor(anchor)
    log = fake_rig.browser_log()
    (launch,) = [e for e in log if "argv" in e]
    assert "t0ken-secret" not in " ".join(launch["argv"]) + json_env(launch)
    assert "--proxy-server=http://127.0.0.1:8080" in launch["argv"]
    answers = [e["params"]["authChallengeResponse"] for e in log if e.get("method") == "Fetch.continueWithAuth"]
    assert answers == [{"response": "ProvideCredentials", "username": "run-1", "password": "t0ken-secret"}]


def json_env(entry: dict) -> str:
    import json
    return json.dumps(entry.get("env", {}))


async def test_close_when_the_browser_ignores_close_still_ends_everything(fake_rig):
    anchor = await fake_rig.host.launch_anchor(fake_rig.spec(None))
    # a browser that does not answer: SIGSTOP, so Browser.close gets no answer
    import os
    import signal
    os.kill(anchor.pid, signal.SIGSTOP)
    try:
        report = await fake_rig.host.close_anchor(anchor, timeout=1.0)
    finally:
        try:
            os.kill(anchor.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert not report.graceful
    assert {r.kind for r in report.terminated} == {"browser"}
    assert scan_orphans([fake_rig.root]) == []
    assert not anchor.profile_dir.exists()


async def test_a_stage_session_whose_stream_server_stays_on_is_refused(fake_rig, gate):
    anchor = await fake_rig.host.launch_anchor(fake_rig.spec(None))
    try:
        env = await fake_rig.stage(anchor, gate)
        fake_rig.control(stream_stuck="1")
        with pytest.raises(AnchorError, match="stream server is still enabled"):
            await fake_rig.host.open_stage_session(env)
        assert scan_orphans([fake_rig.root / "s"]) == []     # its daemon was ended
    finally:
        await fake_rig.host.close_anchor(anchor)
