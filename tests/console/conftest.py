"""Console and live-view tests: a real `sfguard start` (console on by default, headless, no
display) with the fixture login site as site-a.test, and helpers to speak to the console.
`fake_guard` starts the same guard with the fake agent-browser and fake Chromium instead (no
real browser: a live view's login tab opens, but shows no frames)."""
from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sfguard.supervisor.home import runtime_dir, runtime_path
from tests.daemon.conftest import (
    FAKE_AB,
    Daemon,
    fake_browser_for,
    fake_cdp,  # noqa: F401  (a fixture fake_guard uses)
    start_real_guard,
)
from tests.demo.conftest import leftovers

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".ci-artifacts" / "console"


def console_url(banner: str) -> str:
    m = re.search(r"sfguard: console on (http://127\.0\.0\.1:\d+)", banner)
    assert m, banner
    return m.group(1)


def _start(tmp_path: Path, site: int) -> Daemon:
    d = start_real_guard(tmp_path, site, "site-a.test", "site-b.test")
    d.console = console_url(d.banner)
    d.site = site
    return d


def _stop(d: Daemon) -> None:
    d.stop()
    assert leftovers(str(d.home), str(runtime_path(d.home))) == []


@pytest.fixture
def guard(tmp_path, site):
    """A guard with the fixture login site reachable as site-a.test (and as site-b.test, which
    no stage here allows)."""
    d = _start(tmp_path, site)
    yield d
    _stop(d)


@pytest.fixture(scope="module")
def shared_guard(tmp_path_factory):
    """One guard for a module's console tests that need no site and no browser."""
    d = _start(tmp_path_factory.mktemp("console"), 9)
    yield d
    _stop(d)


def link(d: Daemon, ttl: int = 600) -> str:
    status, body = d.call("POST", "/v1/console/link", {"ttl_s": ttl})
    assert status == 200, body
    return body["url"]


@contextlib.contextmanager
def fake_guards(tmp_path: Path, cdp) -> Iterator[Callable[..., Daemon]]:
    """`start(*args)` -> a real `sfguard start` with the fake agent-browser and fake Chromium
    (no real browser), its console on; every guard started is stopped and checked for
    leftovers at the end."""
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        home = (tmp_path / f"home{len(started)}").absolute()
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
               "SFGUARD_AGENT_BROWSER": str(FAKE_AB),
               "SFGUARD_BROWSER": str(fake_browser_for(tmp_path)), "PYTHONPATH": str(ROOT)}
        if os.environ.get("XDG_RUNTIME_DIR"):
            env["XDG_RUNTIME_DIR"] = os.environ["XDG_RUNTIME_DIR"]
        ab = runtime_dir(home) / "ab"      # the fake agent-browser reads its control file there
        ab.mkdir(mode=0o700, exist_ok=True)
        (ab / "fake-control.json").write_text(json.dumps(
            {"cdp_url": cdp.url, "log": str(tmp_path / "fake-ab.jsonl")}))
        d = Daemon(home, env, tmp_path / f"daemon{len(started)}.log")
        started.append(d)
        d.start(*args)
        d.console = console_url(d.banner)
        return d

    try:
        yield start
    finally:
        for d in started:
            d.finish()


@pytest.fixture
def fake_guard(tmp_path, fake_cdp):  # noqa: F811
    with fake_guards(tmp_path, fake_cdp) as start:
        yield start
