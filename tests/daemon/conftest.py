"""A real `sfguard start` daemon (subprocess) with the fake agent-browser and a fake CDP
endpoint, talked to over its unix socket like a pipeline runner would."""
from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.browsers.browser_pool import existing_uids
from sfguard.supervisor.client.guard_client import GuardClient
from sfguard.supervisor.home import runtime_dir, runtime_path
from sfguard.supervisor.procs import scan_orphans, terminate_recorded
from tests.daemon.fake_cdp import FakeCdp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAKE_AB = ROOT / "tests" / "fake_agent_browser" / "agent-browser"
FAKE_CHROMIUM = ROOT / "tests" / "fake_chromium" / "chromium"


def fake_browser_for(base: Path) -> Path:
    """The SFGUARD_BROWSER for a guard whose fake Chromium logs to `base`/fake-chromium.jsonl
    and reads `base`/fake-chromium-control.json (base = the guard env's HOME, the home's parent).

    Not root: the fake itself (the guard passes HOME through). Root: the guard runs each browser
    as a user of its pool with a HOME of its own, and `base` (in root's private pytest folder)
    is out of those users' reach. So the fake gets a folder under /tmp that every browser user
    may cross, a log every one of them may append to, and a wrapper that points it there; those
    two names in `base` are links to it: the tests read and write them as before."""
    if os.geteuid() != 0:
        return FAKE_CHROMIUM
    log = base / "fake-chromium.jsonl"
    if log.is_symlink():                       # a second guard in the same folder
        return Path(os.readlink(log)).parent / "chromium"
    folder = Path(tempfile.mkdtemp(prefix="sfg-fc-"))
    atexit.register(shutil.rmtree, folder, True)
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    wrapper = folder / "chromium"
    wrapper.write_text(f"#!/bin/sh\nFAKE_CHROMIUM_HOME={shlex.quote(str(folder))} "
                       f"exec {shlex.quote(python)} {shlex.quote(str(FAKE_CHROMIUM))} \"$@\"\n")
    wrapper.chmod(0o755)
    (folder / "fake-chromium.jsonl").touch()
    (folder / "fake-chromium.jsonl").chmod(0o666)     # test data only: no secret in it
    folder.chmod(0o755)
    for name in ("fake-chromium.jsonl", "fake-chromium-control.json"):
        (base / name).symlink_to(folder / name)
    return wrapper


def browser_uids() -> tuple[int, ...]:
    """The uids a root guard runs its browsers as (the default pool's users that exist):
    leftover scans must see their processes too."""
    if os.geteuid() != 0:
        return ()
    return existing_uids()


class Daemon:
    def __init__(self, home: Path, env: dict[str, str], log: Path):
        self.home, self.env, self.log = home, env, log
        if os.environ.get("SFGUARD_PROXIES"):   # the suite run with the other proxy mode
            env["SFGUARD_PROXIES"] = os.environ["SFGUARD_PROXIES"]
        self.proc: subprocess.Popen | None = None
        self.client = GuardClient(home, timeout=60)
        self.out = b""
        #: what runs `sfguard start` (e.g. bubblewrap and setpriv for another user)
        self.argv_prefix: list[str] = []
        self.ready_timeout = 30.0

    def start(self, *extra: str, expect_ready: bool = True) -> None:
        self.last_args = extra
        self.proc = subprocess.Popen(
            [*self.argv_prefix, sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(self.home),
             *extra],
            cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=open(self.log, "ab"))
        if not expect_ready:
            return
        deadline = time.monotonic() + self.ready_timeout
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line.decode())
            if line.strip() == b"sfguard: ready" or line.startswith(b"{") and b'"event":"ready"' in line:
                self.banner = "".join(lines)
                return
        raise AssertionError(f"daemon did not get ready: {''.join(lines)}\n{self.log.read_text()[-3000:]}")

    def call(self, method: str, route: str, body=None):
        return self.client.call(method, route, body)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def finish(self) -> None:
        """Test teardown through the product, as an operator would clean up: stop the guard;
        one the test killed (or left with run records) is swept by one more start and stop.
        Then nothing of it may remain in the runtime folder (issue 11) - only the fake
        agent-browser's control file a fixture put there before the start."""
        code = self.stop()
        rt = runtime_path(self.home)
        dead_runs = list((self.home / "runs").glob("*.json")) if (self.home / "runs").is_dir() else []
        if (code is not None and code < 0) or dead_runs:
            try:
                self.start(*getattr(self, "last_args", ()))
            except AssertionError:
                pass                      # a guard that cannot start (the test broke its home)
            self.stop()
        # no process of it (a browser, an agent-browser daemon, a proxy: anything that names
        # its runtime folder in argv or env) may outlive it; bounded wait for ones exiting
        deadline = time.monotonic() + 10
        uids = browser_uids()
        while (orphans := scan_orphans([rt], uids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        terminate_recorded(orphans, 5)
        assert orphans == [], f"processes outlived the guard: {orphans}"
        left = sorted(str(p.relative_to(rt)) for p in rt.rglob("*")) if rt.exists() else []
        fixture_files = {"ab", "ab/fake-control.json"}
        if rt.exists() and set(left) <= fixture_files:
            shutil.rmtree(rt, ignore_errors=True)
            left = []
        assert left == [], f"the guard left {left[:20]} in its runtime folder {rt}"

    def browser_log(self) -> list[dict]:
        """What the fake Chromium saw: launches {"argv", "env", "pid"} and commands
        {"pid", "method", "params"} (it logs to $HOME/fake-chromium.jsonl)."""
        path = self.home.parent / "fake-chromium.jsonl"
        if not path.exists():
            return []
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]

    def calls(self) -> list[dict]:
        path = self.home.parent / "fake-ab.jsonl"
        if not path.exists():
            return []
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def start_real_guard(tmp_path: Path, site: int, *hosts: str, **env_extra: str) -> Daemon:
    """A real `sfguard start` (real Chromium and agent-browser) on a temp home, whose policy
    lets the browser reach the fixture site on `site` under each of `hosts` (resolved to
    127.0.0.1). No DISPLAY: headless only. The caller ends it with `finish()`."""
    home = (tmp_path / "home").absolute()
    pol = tmp_path / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT), **env_extra}
    d = Daemon(home, env, tmp_path / "daemon.log")
    resolve = [a for h in hosts for a in ("--resolve", f"{h}=127.0.0.1")]
    d.start("--policy", str(pol), *resolve)
    return d


def write_home_policy(home: Path) -> Path:
    """The guard home's live policy (HOME/sites.yaml, what `sfguard start` without --policy
    enforces): the shipped template with the reviewer's consent for the fixture site on
    127.0.0.1 (private_networks.allow), as `sfguard demo` writes it."""
    from sfguard import policy
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = policy.default_policy_path().read_text()
    assert text.endswith("private_networks:\n  allow: []\n")
    path = home / "sites.yaml"
    path.write_text(text.replace("allow: []\n", 'allow: ["127.0.0.1/32"]\n'))
    path.chmod(0o600)
    return path


@pytest.fixture
def fake_cdp():
    f = FakeCdp()
    f.start()
    yield f
    f.stop()


@pytest.fixture
def daemon(tmp_path, fake_cdp):
    home = tmp_path / "home"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "SFGUARD_AGENT_BROWSER": str(FAKE_AB), "SFGUARD_BROWSER": str(fake_browser_for(tmp_path)),
           "HTTP_PROXY": "http://leak.invalid:1", "AGENT_BROWSER_PROFILE": "/leak",
           "PYTHONPATH": str(ROOT)}
    if os.environ.get("XDG_RUNTIME_DIR"):
        env["XDG_RUNTIME_DIR"] = os.environ["XDG_RUNTIME_DIR"]
    rt = runtime_dir(home.absolute())   # the fake agent-browser reads its control file there
    ab = rt / "ab"
    ab.mkdir(mode=0o700, exist_ok=True)
    (ab / "fake-control.json").write_text(json.dumps(
        {"cdp_url": fake_cdp.url, "log": str(tmp_path / "fake-ab.jsonl")}))
    write_home_policy(home)
    d = Daemon(home.absolute(), env, tmp_path / "daemon.log")
    d.start()
    yield d
    d.finish()
    # nothing of this test may outlive it
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(home) in cmd or str(rt) in cmd:
            p.kill()


@pytest.fixture
def real_daemon(tmp_path, site):
    """A real `sfguard start` (real Chromium and agent-browser) whose policy lets the browser
    reach the fixture site as site-a.test and site-b.test."""
    home = (tmp_path / "home").absolute()
    pol = tmp_path / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT), "HTTP_PROXY": "http://leak.invalid:1"}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1",
            "--resolve", "site-b.test=127.0.0.1")
    yield d
    d.finish()
