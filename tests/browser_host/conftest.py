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

from sfguard.fixtures.login_server import start_login_server
from sfguard.supervisor.browsers import agent_browser as ab_mod
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.host import AnchorSpec, LocalBrowserHost
from sfguard.supervisor.gate.cdp_gate import CdpGate
from sfguard.supervisor.procs import scan_orphans, terminate_recorded

FAKE_AB = Path(__file__).resolve().parents[1] / "fake_agent_browser" / "agent-browser"
FAKE_CHROMIUM = Path(__file__).resolve().parents[1] / "fake_chromium" / "chromium"


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

    def browser_log(self) -> list[dict]:
        """Fake only: the fake Chromium's launches and commands ($HOME/fake-chromium.jsonl)."""
        path = self.root / "fake-chromium.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def browser_control(self, **values) -> None:
        """Fake only: failure injection for the fake Chromium."""
        (self.root / "fake-chromium-control.json").write_text(json.dumps(values))

    async def stage(self, anchor, gate) -> dict[str, str]:
        """A stage session env on `anchor` through `gate` (how stages drive a browser)."""
        url = gate.add_stage(f"st-{anchor.session}-{uuid.uuid4().hex[:4]}", anchor.pipe)
        return ab_mod.stage_env(session=f"st{uuid.uuid4().hex[:10]}", socket_dir=self.root / "s",
                                config_path=self.root / "cfg.json", cdp_url=url)

    def calls(self) -> list[dict]:
        if not self.log or not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def _short_root() -> Path:
    # tmp_path is too long for unix sockets (103 bytes): use a short private dir in /tmp.
    root = Path(tempfile.mkdtemp(prefix="sfgt-", dir="/tmp"))
    (root / "s").mkdir(mode=0o700)
    return root


def _make_rig(kind: str, monkeypatch):
    root = _short_root()
    # the browser's HOME (the fake Chromium logs there; the real one keeps its caches in the
    # machine's HOME, so a cold start is paid once per machine, not per test)
    if kind == "fake":
        monkeypatch.setenv("HOME", str(root))
    log = None
    if kind == "fake":
        log = root / "calls.jsonl"
        binary, browser = str(FAKE_AB), str(FAKE_CHROMIUM)
    else:
        ab, br = tools.find_agent_browser(), tools.find_browser()
        if not (ab.found and br.found):
            pytest.fail("agent-browser or Chromium missing: run ./dev setup")
        binary, browser = ab.path, br.path
    r = Rig(kind, LocalBrowserHost(binary, launch_timeout=60 if kind == "real" else 20),
            binary, browser, root, log)
    if kind == "fake":
        r.control(log=str(log))
    ab_mod.write_pinned_config(root / "cfg.json")
    yield r
    # Safety net: nothing a test started may survive it.
    leftovers = scan_orphans([root])
    if leftovers:
        terminate_recorded(leftovers, 5)
    shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.browser)])
def rig(request, monkeypatch):
    """The contract rig: each test runs against the fake and the real Chromium/agent-browser."""
    yield from _make_rig(request.param, monkeypatch)


@pytest.fixture
def fake_rig(monkeypatch):
    yield from _make_rig("fake", monkeypatch)


@pytest.fixture
def real_rig(monkeypatch):
    yield from _make_rig("real", monkeypatch)


@pytest.fixture
async def gate():
    g = CdpGate()
    await g.start()
    yield g
    await g.stop()


@pytest.fixture
async def site():
    runner, url = await start_login_server()
    yield url
    await runner.cleanup()
