"""Fixtures for the BrowserHost contract suite: the same tests run against the fake
agent-browser (default suite) and the real one (marked `browser`)."""
from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.login_server import start_login_server
from supervisor import tools
from supervisor.browser_host import AnchorSpec, LocalBrowserHost
from supervisor.sweep import scan_orphans, terminate_recorded

FAKE_AB = Path(__file__).resolve().parents[1] / "fake_agent_browser" / "agent-browser"


@dataclass
class Rig:
    kind: str                 # "fake" | "real"
    host: LocalBrowserHost
    binary: str
    browser_path: str
    root: Path                # short private dir: sockets, config, profiles
    log: Path | None          # the fake's call log

    def spec(self, profile: Path | None = None, **kw) -> AnchorSpec:
        kw.setdefault("allow_direct", True)
        return AnchorSpec(session=kw.pop("session", f"a{uuid.uuid4().hex[:10]}"),
                          socket_dir=self.root / "s", config_path=self.root / "cfg.json",
                          browser_path=self.browser_path, profile_dir=profile,
                          temp_root=self.root / "tmp", **kw)

    def control(self, **values) -> None:
        """Fake only: set its log path / failure injection through <socket dir>/fake-control.json
        (the guard scrubs the env, so env variables would not reach the fake)."""
        path = self.root / "s" / "fake-control.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(values)
        path.write_text(json.dumps(data))

    def calls(self) -> list[dict]:
        if not self.log or not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def _short_root() -> Path:
    # tmp_path is too long for unix sockets (103 bytes): use a short private dir in /tmp.
    root = Path(tempfile.mkdtemp(prefix="sfgt-", dir="/tmp"))
    (root / "s").mkdir(mode=0o700)
    return root


def _make_rig(kind: str):
    root = _short_root()
    log = None
    if kind == "fake":
        log = root / "calls.jsonl"
        binary, browser = str(FAKE_AB), "/usr/bin/chromium-fake"
    else:
        ab, br = tools.find_agent_browser(), tools.find_browser()
        if not (ab.found and br.found):
            pytest.fail("agent-browser or Chromium missing: run ./dev setup")
        binary, browser = ab.path, br.path
    r = Rig(kind, LocalBrowserHost(binary, launch_timeout=60 if kind == "real" else 20),
            binary, browser, root, log)
    if kind == "fake":
        r.control(log=str(log))
    yield r
    # Safety net: nothing a test started may survive it.
    leftovers = scan_orphans([root])
    if leftovers:
        terminate_recorded(leftovers, 5)
    shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.browser)])
def rig(request):
    """The contract rig: each test runs against the fake and the real agent-browser."""
    yield from _make_rig(request.param)


@pytest.fixture
def fake_rig():
    yield from _make_rig("fake")


@pytest.fixture
def real_rig():
    yield from _make_rig("real")


@pytest.fixture
async def site():
    runner, url = await start_login_server()
    yield url
    await runner.cleanup()
