"""Console and live-view tests: a real `sfguard start` (console on by default, headless, no
display) with the fixture login site as site-a.test, and helpers to speak to the console."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from sfguard.supervisor.home import runtime_path
from tests.daemon.conftest import Daemon, start_real_guard
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
