"""Guards on one PostgreSQL: real `sfguard start` daemons (fake agent-browser and Chromium),
each with a home of its own, sharing one database and one key file."""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.home import runtime_dir, runtime_path
from tests.daemon.conftest import FAKE_AB, Daemon, fake_browser_for
from tests.daemon.fake_cdp import FakeCdp

ROOT = Path(__file__).resolve().parents[2]
TTL = 2.0          # seconds: short, so expiry tests stay quick (the default is 30)


@pytest.fixture
def key_file(tmp_path) -> Path:
    """The operator's shared key: one 0600 file every guard host is given."""
    path = tmp_path / "shared.key"
    path.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    path.chmod(0o600)
    return path


class Guards:
    """Start guards with their own homes on one store; end them (and what they started)."""

    def __init__(self, tmp: Path, url: str, key_file: Path, cdp_url: str, ttl: float = TTL):
        self.tmp, self.url, self.key_file, self.cdp_url = tmp, url, key_file, cdp_url
        self.ttl = ttl
        self.started: list[Daemon] = []

    def env(self, base: Path) -> dict[str, str]:
        env = {"PATH": os.environ["PATH"], "HOME": str(base), "LANG": "C.UTF-8",
               "SFGUARD_AGENT_BROWSER": str(FAKE_AB), "SFGUARD_BROWSER": str(fake_browser_for(base)),
               "PYTHONPATH": str(ROOT), "SFGUARD_STORE": self.url,
               "SFGUARD_KEY_FILE": str(self.key_file), "SFGUARD_LEASE_TTL": str(self.ttl)}
        if os.environ.get("XDG_RUNTIME_DIR"):
            env["XDG_RUNTIME_DIR"] = os.environ["XDG_RUNTIME_DIR"]
        return env

    def start(self, name: str, *extra: str) -> Daemon:
        base = self.tmp / name
        base.mkdir()
        home = (base / "home").absolute()
        ab = runtime_dir(home) / "ab"
        ab.mkdir(mode=0o700, exist_ok=True)
        (ab / "fake-control.json").write_text(json.dumps(
            {"cdp_url": self.cdp_url, "log": str(base / "fake-ab.jsonl")}))
        d = Daemon(home, self.env(base), base / "daemon.log")
        d.start(*extra)
        self.started.append(d)
        return d

    def close(self) -> None:
        for d in self.started:
            if d.proc is not None and d.proc.poll() is None:
                with_suppress_kill(d.proc.pid, signal.SIGCONT)
                d.stop()
        for d in self.started:     # a killed guard is cleaned up as an operator would
            if d.proc is not None and (d.proc.returncode or 0) < 0:
                subprocess.run([sys.executable, "-m", "sfguard.cli.main", "sweep", "--home", str(d.home)],
                               cwd=ROOT, env=d.env, capture_output=True, timeout=120)
        for d in self.started:     # nothing a guard of this test started may outlive it
            rt = str(runtime_path(d.home))
            for p in psutil.process_iter(["cmdline"]):
                try:
                    cmd = " ".join(p.info["cmdline"] or [])
                    if str(d.home) in cmd or rt in cmd:
                        p.kill()
                except psutil.Error:
                    continue
            # the fixture made this folder (for the fake's control file): it removes it
            shutil.rmtree(rt, ignore_errors=True)


def with_suppress_kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
def guards(tmp_path, pg_url, key_file):
    cdp = FakeCdp()
    cdp.start()
    g = Guards(tmp_path, pg_url, key_file, cdp.url)
    yield g
    g.close()
    cdp.stop()
