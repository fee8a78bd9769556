"""Human handoff: how an operator gets to log in to a run's browser (docs/design.md 4.5).

A human login stage stops at a confirm gate. The gate's payload tells the console (or the
operator reading `sfguard`) what to do, as a `HandoffPayload`:

    {"kind": "local_window", "site": "127.0.0.1", "reason": "...", "url": "http://..."}
    {"kind": "live_view",    "site": "...",       "reason": "...", "url": "https://viewer..."}

`local_window` means: the run's anchor browser is shown as a visible window on this machine,
at `url`, and the operator logs in there. `live_view` means: the login tab is streamed to a
page of the guard's console (supervisor/console/handoff.py), at a one-time `url`; it is what a
guard without a screen (a container, CI) uses, and the seam for a hosted service.

A handoff is refused up front with `HandoffImpossible` when it cannot work, naming the cause:
a local window needs a screen, so on Linux DISPLAY or WAYLAND_DISPLAY must be set ("no_display"),
and an X display must answer this guard (`xdpyinfo` with the guard's DISPLAY and XAUTHORITY;
"display_unusable"). Being inside a container is no cause by itself: a container given a
display (its socket and cookie) shows the window like a desktop. A root guard's browser user
is probed again when its browser starts (xdisplay.probe, with its own grant).

The guard (daemon) uses it like this:

    handoff = LocalWindowHandoff()
    handoff.check_possible(profile="fixture")   # HandoffImpossible -> fail the stage, show message
    payload = handoff.payload(site="127.0.0.1", reason="...", url=check.url)
    # relaunch / show the anchor headed, put payload.model_dump() in the gate, audit handoff_opened
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Annotated, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, StringConstraints, model_validator

from sfguard.errors import SfguardError
from sfguard.supervisor.browsers import tools, xdisplay

__all__ = ["GateHandoff", "Handoff", "HandoffImpossible", "HandoffPayload", "LocalWindowHandoff"]

HandoffKind = Literal["local_window", "live_view"]
_URL = re.compile(r"^https?://[^\s/?#]+[^\s]*$")


class HandoffImpossible(SfguardError):
    """The handoff cannot work here. `cause` is a short code ("no_display", "display_unusable");
    str() is a full sentence saying why and what to do instead."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class HandoffPayload(BaseModel):
    """What a login gate shows. `url` is optional for local_window (the page the window opens
    on) and required for live_view (the link to the streamed browser). No secrets: a site
    name, a sentence, a page address; never a CDP address or credential."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: HandoffKind
    site: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    url: Annotated[str, StringConstraints(max_length=2048)] | None = None

    @model_validator(mode="after")
    def _url_rules(self) -> HandoffPayload:
        if self.url is not None and not _URL.match(self.url):
            raise ValueError("url must be an http:// or https:// address")
        if self.kind == "live_view" and self.url is None:
            raise ValueError("a live_view handoff needs the url of the live view")
        if self.url is not None and self.url.lower().startswith(("ws://", "wss://")):
            raise ValueError("url must be a page address, not a WebSocket")
        return self


class GateHandoff(BaseModel):
    """A pipeline gate's `handoff:` (what the runner sends as `POST /v1/runs/{id}/handoff`):
    `kind` as the API takes it (`auto`: a local window where the guard has a screen, else a live
    view), and `url` the page the login starts on. The live view's own link is made by the guard
    when the handoff opens, so a pipeline never holds one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["auto", "local_window", "live_view"]
    site: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    url: Annotated[str, StringConstraints(max_length=2048)] | None = None

    @model_validator(mode="after")
    def _url_rules(self) -> GateHandoff:
        if self.url is not None and not _URL.match(self.url):
            raise ValueError("url must be the http:// or https:// page the login starts on")
        return self


@runtime_checkable
class Handoff(Protocol):
    """The seam between the guard and however a person reaches the browser."""

    #: the payload kind this handoff produces
    kind: str
    #: True when the anchor browser must run headed (a visible window) for the handoff
    needs_headed: bool

    def check_possible(self, *, profile: str | None = None, url: str | None = None) -> None:
        """Raise HandoffImpossible (with a message naming the cause and the way out) when this
        handoff cannot work on this host."""

    def payload(self, *, site: str, reason: str, url: str | None = None) -> HandoffPayload:
        """The gate payload for a login on `site`. Calls check_possible first."""


def display_refusal() -> str | None:
    """Why this process cannot open its X display (a sentence, no cookie), or None when it
    can, or when there is no X display to probe (Wayland only, or none: see no_display)."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DISPLAY", "XAUTHORITY")}
    try:
        xdisplay.local_display(env)
        xdisplay.probe(env, None)
    except xdisplay.DisplayError as exc:
        return str(exc)
    return None


class LocalWindowHandoff:
    """The operator logs in through a visible browser window on this machine.

    The probes are injectable for tests; by default they look at this process's environment
    (`tools.display_available`), open the X display once (`display_refusal`) and read
    `sys.platform`."""

    kind = "local_window"
    needs_headed = True

    def __init__(self, *, display: Callable[[], str | None] = tools.display_available,
                 usable: Callable[[], str | None] = display_refusal,
                 platform: str | None = None):
        self._display = display
        self._usable = usable
        self._platform = platform or sys.platform
        self._checked = False

    def check_possible(self, *, profile: str | None = None, url: str | None = None) -> None:
        prepare = _prepare_hint(profile, url)
        if self._platform in ("darwin", "win32"):
            return
        if not self._display():
            raise HandoffImpossible(
                "a visible login window is not possible: neither DISPLAY nor WAYLAND_DISPLAY is "
                "set, so this host has no screen for the guard (sfguard never starts a hidden "
                "virtual display). Start the guard from a desktop session, ask for a live_view "
                "handoff in the guard's console (kind live_view, or auto with the console on), "
                f"or {prepare[0].lower()}{prepare[1:]}", "no_display")
        why = self._usable()
        if why:
            raise HandoffImpossible(
                f"a visible login window is not possible: {why.rstrip('.')}. In a container, "
                "give it the display's socket (/tmp/.X11-unix) and an X authority with the "
                "display's cookie (XAUTHORITY), or ask for a live_view handoff in the guard's "
                f"console. {prepare}", "display_unusable")
        self._checked = True

    def payload(self, *, site: str, reason: str, url: str | None = None) -> HandoffPayload:
        if not self._checked:   # one probe of the display per handoff
            self.check_possible(url=url)
        return HandoffPayload(kind="local_window", site=site, reason=reason, url=url)


def _prepare_hint(profile: str | None, url: str | None) -> str:
    name = profile or "NAME"
    where = url or "URL"
    return (f"Log in ahead of the run with `sfguard profiles login {name} --url {where}` on a "
            "machine with a display where this guard home lives, then run the pipeline again; "
            "copy nothing: the login stays sealed in the guard home.")
