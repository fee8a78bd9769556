"""Console and live-view tests: a real `sfguard start` (console on by default, headless, no
display) with the fixture login site as site-a.test, and helpers to speak to the console.
`fake_guard` starts the same guard with the fake agent-browser and fake Chromium instead (no
real browser: a live view's login tab opens, but shows no frames)."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from sfguard.supervisor.home import runtime_dir, runtime_path
from sfguard.supervisor.procs import scan_orphans
from tests.conftest import free_port
from tests.daemon.conftest import (
    FAKE_AB,
    Daemon,
    browser_uids,
    fake_browser_for,
    fake_cdp,  # noqa: F401  (a fixture fake_guard uses)
    start_real_guard,
)
from tests.daemon.fake_cdp import FakeCdp
from tests.demo.conftest import leftovers
from tests.tls_site import issue, make_ca

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".ci-artifacts" / "console"


def console_url(banner: str) -> str:
    """The console's URL from the start banner (its public URL when one is set)."""
    m = re.search(r"sfguard: console on (https?://\S+) \(", banner)
    assert m, banner
    return m.group(1)


#: CA files a test's client trusts, by the console's netloc (see `connect`)
TRUST: dict[str, ssl.SSLContext] = {}


def trust(base: str, ca_file: Path) -> None:
    """Make `connect` trust `ca_file` for the console at `base` (an https:// URL)."""
    TRUST[urlsplit(base).netloc] = ssl.create_default_context(cafile=str(ca_file))


class _Https(http.client.HTTPSConnection):
    """TLS to 127.0.0.1 whatever the name: the client's own resolver, never DNS. The name is
    still what the certificate is checked against (SNI) and what the Host header says."""

    def __init__(self, host: str, port: int, *, source: str | None, context: ssl.SSLContext, timeout: float):
        super().__init__(host, port, timeout=timeout, context=context)
        self._src, self._ctx = source, context

    def connect(self) -> None:
        raw = socket.create_connection(("127.0.0.1", self.port), self.timeout,
                                       (self._src, 0) if self._src else None)
        self.sock = self._ctx.wrap_socket(raw, server_hostname=self.host)


class _Http(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, *, source: str | None, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._src = source

    def connect(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), self.timeout,
                                             (self._src, 0) if self._src else None)


def connect(base: str, timeout: float = 10, source: str | None = None) -> http.client.HTTPConnection:
    """A connection to the console at `base`, on 127.0.0.1 whatever its host name (from the
    `source` address when given); https trusts what `trust` registered, nothing else."""
    u = urlsplit(base)
    port = u.port or (443 if u.scheme == "https" else 80)
    if u.scheme == "https":
        ctx = TRUST.get(u.netloc) or ssl.create_default_context()
        return _Https(u.hostname or "", port, source=source, context=ctx, timeout=timeout)
    return _Http(u.hostname or "", port, source=source, timeout=timeout)


def _start(tmp_path: Path, site: int) -> Daemon:
    d = start_real_guard(tmp_path, site, "site-a.test", "site-b.test")
    d.console = console_url(d.banner)
    d.site = site
    return d


def _stop(d: Daemon) -> None:
    d.stop()
    assert leftovers(str(d.home), str(runtime_path(d.home))) == []
    # nor one that names its runtime folder only in its environment (an agent-browser daemon)
    assert scan_orphans([runtime_path(d.home)], browser_uids()) == []


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


def end_session_daemons(env: dict) -> None:
    """End the agent-browser daemons a test's own command started for a stage's session (one
    sent after the run ended starts a daemon that never idles out), by pid."""
    for proc in psutil.process_iter(["name"]):
        try:
            if "agent-browser" in (proc.info["name"] or "") and \
                    proc.environ().get("AGENT_BROWSER_SESSION") == env["AGENT_BROWSER_SESSION"]:
                proc.kill()
                proc.wait(5)
        except (psutil.Error, psutil.TimeoutExpired):
            pass


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


@pytest.fixture(scope="module")
def shared_tls(tmp_path_factory):
    """A fake-browser guard whose console is served over TLS at its public URL
    https://console.test:PORT: a name only the tests' client resolves (to 127.0.0.1,
    `connect`), a certificate from an authority made here, which that client alone trusts.
    `.ca` is that authority's file."""
    tmp = tmp_path_factory.mktemp("console-tls")
    ca = make_ca("sfguard console test CA")
    cert, key = issue(ca, "console.test", tmp)
    port = free_port()
    cdp = FakeCdp()
    cdp.start()
    try:
        with fake_guards(tmp, cdp) as start:
            ca_file = ca.write(tmp / "ca.pem")
            trust(f"https://console.test:{port}", ca_file)
            d = start("--console", f"127.0.0.1:{port}", "--console-url", f"https://console.test:{port}",
                      "--console-tls-cert", str(cert), "--console-tls-key", str(key))
            d.ca, d.key_file = ca_file, key
            yield d
    finally:
        cdp.stop()


#: a phone's window (CSS pixels), as the approvals page is checked at (issue 46)
PHONE = (390, 844)
#: what a narrow page shows: its layout width, how wide its content is, and where each button
#: of the approvals forms sits (left, right, width, height)
FIT_JS = ("JSON.stringify({iw: innerWidth, sw: document.scrollingElement.scrollWidth, "
          "buttons: [...document.querySelectorAll('form.decide button')].map(b => { "
          "const r = b.getBoundingClientRect(); return [b.value, r.left, r.right, r.width, r.height]; })})")


async def phone_fit(viewer) -> dict:
    """How the current page fits the phone: `{iw, sw, buttons}`; a page wider than the phone
    makes a mobile browser widen its layout (iw > 390), so both are asserted on."""
    return json.loads(await viewer.eval(FIT_JS))


def assert_fits_a_phone(fit: dict, buttons: int = 0) -> None:
    assert fit["iw"] == PHONE[0], f"the page widened the phone's layout to {fit['iw']}px"
    assert fit["sw"] <= fit["iw"], f"content {fit['sw']}px wide on a {fit['iw']}px screen"
    assert len(fit["buttons"]) == buttons, fit["buttons"]
    for value, left, right, width, height in fit["buttons"]:
        assert 0 <= left and right <= fit["iw"] and width > 0, (value, left, right)
        assert height >= 40, f"the {value} button is {height}px high: too small for a finger"
