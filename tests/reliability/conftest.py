"""Shared pieces of the reliability suites: a real `sfguard start` daemon (fake or real
agent-browser), the fixture login site, and the checks every fault test ends with.

Every fault test ends with `assert_promises(home)`: after a restart of the guard
  - no process of the guard is left (scan: any process whose command line or environment
    names the home or its runtime dir, other than the live daemon itself),
  - no unsealed profile is on disk (runtime/profiles is empty),
  - no lease is held or queued,
  - `sfguard audit verify --home H` succeeds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Set
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.home import runtime_dir, runtime_path
from tests.daemon.conftest import FAKE_AB, ROOT, Daemon, fake_browser_for
from tests.daemon.fake_cdp import FakeCdp

SFGUARD = [sys.executable, "-m", "sfguard.cli.main"]


# --------------------------------------------------------------------------- processes

def guard_processes(home: Path, exclude: Set[int] = frozenset()) -> list[psutil.Process]:
    """Live processes whose command line or environment names `home` or its runtime dir."""
    marks = (str(home), str(runtime_path(home)))
    me = os.getpid()
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.pid == me or p.pid in exclude or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            hit = any(m in cmd for m in marks)
            if not hit and any(w in cmd for w in ("chrom", "agent-browser", "proxy_child", "proxy_zygote", "mitm")):
                try:
                    hit = any(m in v for v in p.environ().values() for m in marks)
                except psutil.Error:
                    hit = False
            if hit:
                out.append(p)
        except psutil.Error:
            continue
    return out


def daemon_tree(d) -> set[int]:
    if d.proc is None or d.proc.poll() is not None:
        return set()
    try:
        return {d.proc.pid, *(c.pid for c in psutil.Process(d.proc.pid).children(recursive=True))}
    except psutil.Error:
        return {d.proc.pid}


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            pass
    return out


def kill_all(procs: list[psutil.Process]) -> None:
    """Test cleanup: SIGKILL processes this test's guard started (found by its home)."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def wait_for(pred, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


# --------------------------------------------------------------------------- promises

def audit_verify(home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*SFGUARD, "audit", "verify", "--home", str(home)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def unsealed_left(home: Path) -> list[Path]:
    root = runtime_path(home) / "profiles"
    return [p for p in root.glob("*/*")] if root.is_dir() else []


def leases_held(home: Path) -> dict[str, dict]:
    out = {}
    for f in (home / "leases").glob("*/*.lease"):
        data = json.loads(f.read_text())
        if data.get("holder") or data.get("queue"):
            out[f.name] = data
    return out


def assert_promises(d: Daemon) -> None:
    """The section-1 promises after a crash, checked on a running (restarted) daemon."""
    home = d.home
    # The live daemon and its children (e.g. its warm spare proxy) are not leftovers; what a
    # dead daemon left would have been re-parented away from it.
    exclude = daemon_tree(d)
    deadline = time.monotonic() + 15
    while (left := guard_processes(home, exclude)) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert left == [], describe(left)
    assert unsealed_left(home) == [], "an unsealed profile is left on disk"
    st, body = d.call("GET", "/v1/status")
    assert st == 200
    assert all(l["holder_run"] is None and l["queue"] == [] for l in body["leases"]), body["leases"]
    assert leases_held(home) == {}
    assert list((home / "runs").glob("*.json")) == [], "a dead run's record was not swept"
    v = audit_verify(home)
    assert v.returncode == 0, v.stdout + v.stderr


# --------------------------------------------------------------------------- daemons

def write_policy(path: Path, *ports: int) -> Path:
    plist = ", ".join(str(p) for p in (80, 443, *ports))
    path.write_text(f"version: 1\nmode: enforce\nports: [{plist}]\nblock: []\n"
                    "private_networks:\n  allow: [127.0.0.1/32]\n")
    return path


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT)}
    if os.environ.get("XDG_RUNTIME_DIR"):
        env["XDG_RUNTIME_DIR"] = os.environ["XDG_RUNTIME_DIR"]
    return env


class RealGuard(Daemon):
    """A daemon with the real agent-browser; `start_args` start it again after a fault."""

    start_args: tuple[str, ...] = ()


class FakeGuard(RealGuard):
    """A daemon with the fake agent-browser; `control` writes the fake's control file."""

    port: int     # with --tcp: its port and bearer token (the API fuzz tests)
    token: str

    def __init__(self, home: Path, env: dict, log: Path, cdp: FakeCdp, calls: Path):
        super().__init__(home, env, log)
        self.cdp_url, self.calls_log = cdp.url, calls
        self.control()

    def control(self, **extra: str) -> None:
        """Failure injection: {"hang": "launch"} makes the fake Chromium never answer at start;
        anything else goes to the fake agent-browser's control file."""
        browser = {"hang_start": True} if extra.pop("hang", None) == "launch" else {}
        (self.home.parent / "fake-chromium-control.json").write_text(json.dumps(browser))
        ab = runtime_dir(self.home) / "ab"
        ab.mkdir(mode=0o700, parents=True, exist_ok=True)
        (ab / "fake-control.json").write_text(json.dumps(
            {"cdp_url": self.cdp_url, "log": str(self.calls_log), **extra}))

    def calls(self) -> list[dict]:
        if not self.calls_log.exists():
            return []
        return [json.loads(l) for l in self.calls_log.read_text().splitlines() if l.strip()]

    def proxy_urls(self) -> list[str]:
        """The proxy URLs of the guard's browsers: the fake Chromium logs its --proxy-server
        and the credential the guard answered the proxy challenge with over the pipe."""
        seen = []
        log = self.browser_log()
        for c in log:
            if "argv" not in c:
                continue
            server = next((a.split("=", 1)[1] for a in c["argv"] if a.startswith("--proxy-server=")), None)
            auth = next((e["params"]["authChallengeResponse"] for e in log if e.get("pid") == c["pid"]
                         and e.get("method") == "Fetch.continueWithAuth"), None)
            if server and auth:
                u = server.replace("http://", f"http://{auth['username']}:{auth['password']}@")
                if u not in seen:
                    seen.append(u)
        return seen


def hits(port: int, host: str, path: str | None = None) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hits.json", timeout=10) as r:
        rows = json.load(r)["hits"]
    # (the counter's own page is fetched directly by the tests: never counted)
    return sum(r["count"] for r in rows if r["path"] != "/hits.json"
               and r["host"].split(":")[0] == host and (path is None or r["path"] == path))


@pytest.fixture
def fake_cdp():
    f = FakeCdp()
    f.start()
    yield f
    f.stop()


@pytest.fixture
def make_fake_guard(tmp_path, fake_cdp, site):
    """Factory: a FakeGuard on `tmp_path/<name>` whose proxies may reach the fixture site."""
    made: list[FakeGuard] = []

    def make(name: str = "home", start: bool = True, home: Path | None = None) -> FakeGuard:
        home = (home or tmp_path / name).absolute()
        pol = write_policy(tmp_path / f"{name}-sites.yaml", site)
        d = FakeGuard(home, {**base_env(tmp_path), "SFGUARD_AGENT_BROWSER": str(FAKE_AB),
                             "SFGUARD_BROWSER": str(fake_browser_for(tmp_path))},
                      tmp_path / f"{name}-daemon.log", fake_cdp, tmp_path / f"{name}-fake-ab.jsonl")
        d.start_args = ("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1",
                        "--resolve", "site-b.test=127.0.0.1")
        if start:
            d.start(*d.start_args)
        made.append(d)
        return d

    yield make
    for d in made:
        d.finish()
        kill_all(guard_processes(d.home))


@pytest.fixture
def real_guard(tmp_path, site):
    """A daemon with the real agent-browser and Chromium (headless)."""
    home = (tmp_path / "home").absolute()
    pol = write_policy(tmp_path / "sites.yaml", site)
    d = RealGuard(home, base_env(tmp_path), tmp_path / "daemon.log")
    d.start_args = ("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1",
                    "--resolve", "site-b.test=127.0.0.1")
    d.start(*d.start_args)
    yield d
    d.finish()
    kill_all(guard_processes(home))


# --------------------------------------------------------------------------- API helpers

def request_stage(d, run: str, sid: str, profile: str | None = "acct", allow=("site-a.test",),
                  attempt: int = 1):
    browser: dict[str, object] = {"headed": False, "allow_domains": list(allow)}
    if profile is not None:
        browser["profile"] = profile
    body = {"stage_id": sid, "attempt": attempt, "browser": browser}
    return d.call("POST", f"/v1/runs/{run}/stages", body)


def wait_stage_ready(d, run: str, sid: str, timeout: float = 60) -> dict:
    def ready():
        st, body = d.call("GET", f"/v1/runs/{run}/stages/{sid}")
        return body if st == 200 and body.get("state") == "ready" else None
    return wait_for(ready, timeout, 0.2, f"stage {run}/{sid} ready")


def as_stage(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    from sfguard.supervisor.browsers import tools
    ab = tools.find_agent_browser().path
    assert ab is not None, "agent-browser missing: run ./dev setup"
    stage_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env}
    return subprocess.run([ab, *args], env=stage_env, capture_output=True, text=True, timeout=timeout)


def login_as_stage(env: dict, base: str) -> None:
    assert as_stage(env, "open", f"{base}/login").returncode == 0
    assert as_stage(env, "fill", "input[name=user]", "operator").returncode == 0
    assert as_stage(env, "fill", "input[name=password]", "correct-horse").returncode == 0
    assert as_stage(env, "click", "button[type=submit]").returncode == 0
    as_stage(env, "wait", "1000")


def cookies_seen(env: dict, base: str) -> str:
    r = as_stage(env, "open", f"{base}/cookies")
    assert r.returncode == 0, r.stderr
    return as_stage(env, "get", "text", "#cookies").stdout


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability: the reliability proof (faults, load, bad input)")
