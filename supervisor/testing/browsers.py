"""In-memory fakes of the browser seams, for tests of the guard's services (test support:
nothing in the product imports it).

- `FakeBrowserHost`: a `BrowserHost` whose anchors are records, not processes. It remembers
  what it launched and closed, can be told to fail a launch or a close, and `kill(anchor)`
  makes an anchor dead as a crashed browser would be. Each anchor's pipe (`FakePipe`) answers
  the browser-level calls the guard makes itself (`Target.*`, `Browser.getVersion`) and
  records every method, so a test can see what reached "the browser".
- `FakeHandoff`: a handoff that produces `live_view` payloads, or refuses.

What they do not stand for: agent-browser, Chromium's sandbox, processes and their teardown.
The contract suite in tests/browser_host runs those against the fake and the real
executables.
"""
from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

from sfguard.supervisor.browsers.handoff import HandoffImpossible, HandoffPayload
from sfguard.supervisor.browsers.host import (
    CLOSE_TIMEOUT,
    COMMAND_TIMEOUT,
    Anchor,
    AnchorError,
    AnchorSpec,
    CloseReport,
    StageSession,
)
from sfguard.supervisor.gate.cdp_pipe import PipeClosed

__all__ = ["FakeBrowserHost", "FakeHandoff", "FakePipe"]


class FakePipe:
    """A browser's DevTools pipe in memory: tabs made and closed, every method recorded."""

    def __init__(self) -> None:
        self.methods: list[str] = []
        self.targets: dict[str, str] = {}      # target id -> url
        self.closed = False
        self._ids = itertools.count(1)

    async def call(self, method: str, params: dict[str, Any] | None = None, *,
                   session: str | None = None, timeout: float = COMMAND_TIMEOUT) -> dict[str, Any]:
        if self.closed:
            raise PipeClosed("the fake browser is gone")
        self.methods.append(method)
        params = params or {}
        if method == "Target.createTarget":
            tid = f"T{next(self._ids)}"
            self.targets[tid] = str(params.get("url", "about:blank"))
            return {"targetId": tid}
        if method == "Target.closeTarget":
            return {"success": self.targets.pop(str(params.get("targetId")), None) is not None}
        if method == "Target.getTargets":
            return {"targetInfos": [{"targetId": t, "type": "page", "url": u, "attached": False}
                                    for t, u in self.targets.items()]}
        if method == "Browser.getVersion":
            return {"product": "FakeChrome/1.0", "protocolVersion": "1.3"}
        return {}

    async def close(self) -> None:
        self.closed = True


class _FakeProcess:
    """Stands where an anchor keeps its browser process; there is none."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None


class FakeBrowserHost:
    """A BrowserHost in memory. `fail_launch` / `fail_close`: the error the next launches /
    closes raise (an AnchorError, as the local host raises)."""

    def __init__(self, *, fail_launch: Exception | None = None, fail_close: Exception | None = None):
        self.fail_launch, self.fail_close = fail_launch, fail_close
        self.launched: list[AnchorSpec] = []
        self.closed: list[str] = []                       # anchor sessions, in close order
        self.sessions: dict[str, str | None] = {}         # open stage sessions -> their tab
        self.pool: object | None = None      # use_pool: a root guard's browser users
        self._dead: set[str] = set()
        self._pids = itertools.count(900_000)

    async def launch_anchor(self, spec: AnchorSpec) -> Anchor:
        if self.fail_launch is not None:
            raise self.fail_launch
        if spec.proxy_url is None and not spec.allow_direct:
            raise AnchorError("refusing to launch a browser without its run's proxy")
        self.launched.append(spec)
        temp = spec.profile_dir is None
        profile = spec.profile_dir or Path(tempfile.mkdtemp(prefix="fake-profile-", dir=spec.temp_root))
        pipe = FakePipe()
        blank = (await pipe.call("Target.createTarget", {"url": "about:blank"}))["targetId"]
        return Anchor(session=spec.session, pipe=pipe, proc=_FakeProcess(next(self._pids)),  # type: ignore[arg-type]
                      profile_dir=profile, temp_profile=temp, socket_dir=spec.socket_dir, processes=[],
                      launch_seconds=0.0, headed=spec.headed, blank_tab=blank, user=spec.user)

    async def close_anchor(self, anchor: Anchor, timeout: float = CLOSE_TIMEOUT) -> CloseReport:
        t0 = time.monotonic()
        if self.fail_close is not None:
            raise self.fail_close
        await anchor.pipe.close()
        self.closed.append(anchor.session)
        removed = []
        if anchor.temp_profile:
            removed.append(str(anchor.profile_dir))
        return CloseReport(graceful=anchor.session not in self._dead, terminated=[],
                           removed_files=removed, seconds=time.monotonic() - t0)

    def alive(self, anchor: Anchor) -> bool:
        pipe: object = anchor.pipe
        return anchor.session not in self._dead and not (isinstance(pipe, FakePipe) and pipe.closed)

    def kill(self, anchor: Anchor) -> None:
        """The browser crashed: its pipe is gone."""
        self._dead.add(anchor.session)
        pipe: object = anchor.pipe
        if isinstance(pipe, FakePipe):
            pipe.closed = True

    async def open_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT, *,
                                 nice: int = 0, target_id: str | None = None) -> StageSession:
        session = env["AGENT_BROWSER_SESSION"]
        self.sessions[session] = target_id
        return StageSession(session=session, target_id=target_id, processes=[])

    async def close_stage_session(self, env: dict[str, str], timeout: float = COMMAND_TIMEOUT, *,
                                  graceful: bool = True) -> CloseReport:
        self.sessions.pop(env.get("AGENT_BROWSER_SESSION", ""), None)
        return CloseReport(graceful=graceful, terminated=[], removed_files=[], seconds=0.0)

    def use_pool(self, pool: object) -> None:
        self.pool = pool


class FakeHandoff:
    """In-memory handoff: produces `live_view` payloads pointing at `view_url`, or refuses with
    `impossible` (a HandoffImpossible)."""

    kind = "live_view"
    needs_headed = False

    def __init__(self, view_url: str = "https://console.invalid/live/1",
                 impossible: HandoffImpossible | None = None):
        self.view_url = view_url
        self.impossible = impossible
        self.opened: list[HandoffPayload] = []

    def check_possible(self, *, profile: str | None = None, url: str | None = None) -> None:
        if self.impossible is not None:
            raise self.impossible

    def payload(self, *, site: str, reason: str, url: str | None = None) -> HandoffPayload:
        self.check_possible(url=url)
        p = HandoffPayload(kind="live_view", site=site, reason=reason, url=self.view_url)
        self.opened.append(p)
        return p
