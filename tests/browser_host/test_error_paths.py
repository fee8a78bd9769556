"""Launch/close error paths, driven through the fake agent-browser's failure injection."""
from __future__ import annotations

import pytest

from supervisor.browser_host import AnchorError
from supervisor.sweep import scan_orphans


@pytest.mark.parametrize("control,message", [
    ({"fail": "open"}, "open failed"),
    ({"fail": "get cdp-url"}, "get cdp-url failed"),
    ({"stream_stuck": "1"}, "stream server is still enabled"),
    ({"hang": "stream disable"}, "timed out"),
])
async def test_failed_launch_raises_and_leaves_nothing_behind(fake_rig, control, message):
    # short only where the command hangs on purpose; the fake's other calls need the time a
    # Python start takes on a busy machine
    fake_rig.host.command_timeout = 1.0 if "hang" in control else 15.0
    fake_rig.control(**control)
    with pytest.raises(AnchorError, match=message):
        await fake_rig.host.launch_anchor(fake_rig.spec(None))
    assert scan_orphans([fake_rig.root]) == []             # the daemon a failed open leaves is ended
    assert list((fake_rig.root / "tmp").iterdir()) == []   # throw-away profile removed
    names = {p.name for p in (fake_rig.root / "s").iterdir()}
    assert names <= {"fake-control.json", "fake-calls.jsonl", ".fake-state"}


async def test_headed_without_display_fails_clearly(fake_rig, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    with pytest.raises(AnchorError, match="DISPLAY"):
        await fake_rig.host.launch_anchor(fake_rig.spec(fake_rig.root / "p1", headed=True))
    assert scan_orphans([fake_rig.root]) == []


async def test_launch_without_proxy_is_refused_unless_explicitly_direct(fake_rig):
    with pytest.raises(AnchorError, match="without the run's proxy"):
        await fake_rig.host.launch_anchor(fake_rig.spec(fake_rig.root / "p1", allow_direct=False))
    assert fake_rig.calls() == []


async def test_bad_proxy_url_is_refused_without_echoing_the_token(fake_rig):
    spec = fake_rig.spec(None, proxy_url="http://run:t0ken-secret@10.1.1.1:8080", allow_direct=False)
    with pytest.raises(AnchorError) as info:
        await fake_rig.host.launch_anchor(spec)
    assert "t0ken-secret" not in str(info.value)
    assert list((fake_rig.root / "tmp").iterdir()) == []


async def test_duplicate_session_name_is_refused(fake_rig):
    anchor = await fake_rig.host.launch_anchor(fake_rig.spec(fake_rig.root / "p1", session="dup"))
    try:
        with pytest.raises(AnchorError, match="already running"):
            await fake_rig.host.launch_anchor(fake_rig.spec(fake_rig.root / "p2", session="dup"))
    finally:
        await fake_rig.host.close_anchor(anchor)


async def test_close_when_close_command_fails_still_ends_everything(fake_rig):
    anchor = await fake_rig.host.launch_anchor(fake_rig.spec(None))
    fake_rig.control(hang="close")
    report = await fake_rig.host.close_anchor(anchor, timeout=1.0)
    assert not report.graceful
    assert {r.kind for r in report.terminated} == {"daemon", "browser"}
    assert scan_orphans([fake_rig.root]) == []
    assert not anchor.profile_dir.exists()


async def test_every_command_of_a_session_carries_the_identical_env(fake_rig):
    anchor = await fake_rig.host.launch_anchor(fake_rig.spec(fake_rig.root / "p1"))
    await fake_rig.host.close_anchor(anchor)
    calls = [c for c in fake_rig.calls() if c["env"].get("AGENT_BROWSER_SESSION") == anchor.session]
    verbs = [c["argv"][-1] if c["argv"][0] != "--json" else c["argv"][1] for c in calls]
    assert verbs[0] == "about:blank" and calls[-1]["argv"] == ["close"]
    assert len({tuple(sorted(c["env"].items())) for c in calls}) == 1
    assert calls[0]["env"] == {k: v for k, v in anchor.env.items() if k.startswith("AGENT_BROWSER_")}
