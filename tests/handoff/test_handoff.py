"""The human handoff seam: payload schema and when a local login window is refused."""
from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from sfguard.supervisor.browsers.handoff import (
    GateHandoff,
    Handoff,
    HandoffImpossible,
    HandoffPayload,
    LocalWindowHandoff,
)
from sfguard.supervisor.testing import FakeHandoff

SITE_URL = "http://127.0.0.1:8080/login"


def local(display=None, refusal=None, platform="linux"):
    return LocalWindowHandoff(display=lambda: display, usable=lambda: refusal, platform=platform)


CANNOT = "this user cannot open the display :5 (refused or not running)"


@pytest.mark.parametrize("display,refusal,platform,cause", [
    (None, None, "linux", "no_display"),
    (None, CANNOT, "linux", "no_display"),
    (":5", CANNOT, "linux", "display_unusable"),   # set, but it does not answer this guard
    (None, None, "freebsd14", "no_display"),
])
def test_local_window_refused_with_the_cause(display, refusal, platform, cause):
    h = local(display, refusal, platform)
    with pytest.raises(HandoffImpossible) as exc:
        h.payload(site="127.0.0.1", reason="log in", url=SITE_URL)
    assert exc.value.cause == cause
    msg = str(exc.value)
    assert "not possible" in msg and "live_view" in msg
    # says what to do instead, with the URL, and that nothing is to be copied
    assert f"sfguard profiles login NAME --url {SITE_URL}" in msg
    assert "copy nothing" in msg
    if cause == "no_display":
        assert "DISPLAY" in msg and "WAYLAND_DISPLAY" in msg
    else:
        assert "cannot open the display :5" in msg and "XAUTHORITY" in msg


def test_check_possible_names_the_profile():
    with pytest.raises(HandoffImpossible) as exc:
        local().check_possible(profile="fixture", url=SITE_URL)
    assert f"sfguard profiles login fixture --url {SITE_URL}" in str(exc.value)


@pytest.mark.parametrize("display,platform", [(":0", "linux"), ("wayland-0", "linux"),
                                              (None, "darwin"), (None, "win32")])
def test_local_window_payload_when_possible(display, platform):
    h = local(display, None, platform)
    assert isinstance(h, Handoff) and h.needs_headed
    p = h.payload(site="127.0.0.1", reason="The fixture site needs a login.", url=SITE_URL)
    assert p.model_dump() == {"kind": "local_window", "site": "127.0.0.1",
                              "reason": "The fixture site needs a login.", "url": SITE_URL}


def test_a_container_is_no_cause_by_itself(monkeypatch):
    """This host may be a container (/.dockerenv): without a display the cause is the missing
    display; a display that does not answer is named as such, never 'container'."""
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    with pytest.raises(HandoffImpossible) as exc:
        LocalWindowHandoff(platform="linux").check_possible()
    assert exc.value.cause == "no_display"
    monkeypatch.setenv("DISPLAY", ":239")   # no X server there
    monkeypatch.setenv("XAUTHORITY", os.devnull)
    with pytest.raises(HandoffImpossible) as exc:
        LocalWindowHandoff(platform="linux").check_possible()
    assert exc.value.cause == "display_unusable" and "container" not in exc.value.cause
    assert "cannot open the display :239" in str(exc.value)
    monkeypatch.setenv("DISPLAY", "other-host:0")   # X over TCP: not this machine's display
    with pytest.raises(HandoffImpossible, match="not a display of this machine"):
        LocalWindowHandoff(platform="linux").check_possible()


@pytest.mark.parametrize("data", [
    {"kind": "local_window", "site": "127.0.0.1", "reason": "log in"},
    {"kind": "local_window", "site": "127.0.0.1", "reason": "log in", "url": SITE_URL},
    {"kind": "live_view", "site": "example.com", "reason": "log in", "url": "https://console.example/live/7"},
])
def test_payload_schema_accepts(data):
    assert HandoffPayload.model_validate(data).model_dump(exclude_none=True) == data


@pytest.mark.parametrize("data,needle", [
    ({"kind": "live_view", "site": "a", "reason": "r"}, "needs the url"),
    ({"kind": "popup", "site": "a", "reason": "r"}, "kind"),
    ({"kind": "local_window", "site": "", "reason": "r"}, "site"),
    ({"kind": "local_window", "site": "a", "reason": "r", "url": "ws://127.0.0.1:9222/devtools"}, "http"),
    ({"kind": "local_window", "site": "a", "reason": "r", "url": "file:///etc/passwd"}, "http"),
    ({"kind": "local_window", "site": "a", "reason": "r", "cdp": "x"}, "cdp"),
    ({"kind": "local_window", "site": "a", "reason": "x" * 501}, "reason"),
])
def test_payload_schema_rejects(data, needle):
    with pytest.raises(ValidationError) as exc:
        HandoffPayload.model_validate(data)
    assert needle in str(exc.value)


@pytest.mark.parametrize("data,error", [
    ({"kind": "auto", "site": "example.com", "reason": "log in"}, None),
    ({"kind": "live_view", "site": "example.com", "reason": "log in"}, None),   # the guard makes the link
    ({"kind": "local_window", "site": "a", "reason": "r", "url": "https://a.example/login"}, None),
    ({"kind": "popup", "site": "a", "reason": "r"}, "kind"),
    ({"kind": "auto", "site": "a", "reason": "r", "url": "file:///etc/passwd"}, "http"),
    ({"site": "a", "reason": "r"}, "kind"),
])
def test_a_pipeline_gate_handoff_takes_the_apis_kinds(data, error):
    if error is None:
        assert GateHandoff.model_validate(data).model_dump(exclude_none=True) == data
    else:
        with pytest.raises(ValidationError, match=error):
            GateHandoff.model_validate(data)


def test_fake_handoff_is_a_live_view_and_can_refuse():
    fake = FakeHandoff("https://console.example/live/1")
    assert isinstance(fake, Handoff) and not fake.needs_headed
    p = fake.payload(site="127.0.0.1", reason="log in")
    assert p.kind == "live_view" and p.url == "https://console.example/live/1"
    assert fake.opened == [p]
    refusing = FakeHandoff(impossible=HandoffImpossible("no viewer", "no_viewer"))
    with pytest.raises(HandoffImpossible, match="no viewer"):
        refusing.payload(site="a", reason="r")
