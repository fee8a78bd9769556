"""Helpers for the demo and `profiles check|login` tests: the CLI as a subprocess, a real guard
(`sfguard start`) with the fixture login site, and a look for processes left behind."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.home import runtime_path
from tests.daemon.conftest import Daemon

ROOT = Path(__file__).resolve().parents[2]
# The console script's entry (see tests/profiles/conftest.py for why not `-m sfguard.cli.main`).
SFGUARD = [sys.executable, "-c", "import sys; from sfguard.cli.main import main; sys.exit(main())"]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    for k in ("SFGUARD_HOME", "DISPLAY", "WAYLAND_DISPLAY"):
        env.pop(k, None)
    return env


def sfguard(*args: str, env: dict | None = None, input: str | None = "", timeout: float = 120):
    return subprocess.run([*SFGUARD, *args], cwd=ROOT, env=env or cli_env(), capture_output=True,
                          text=True, timeout=timeout, input=input)


def leftovers(*marks: str) -> list[str]:
    """Live processes whose command line names one of `marks` (a home, a runtime dir...)."""
    out = []
    for p in psutil.process_iter(["cmdline", "pid"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if any(m in cmd for m in marks) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.info['pid']}: {cmd[:200]}")
        except psutil.Error:
            pass
    return out


@pytest.fixture
def guard(tmp_path, site):
    """A real `sfguard start` on a short temp home whose policy lets the browser reach the
    fixture site as site-a.test (resolved to 127.0.0.1). No DISPLAY: headless only."""
    home = (tmp_path / "home").absolute()
    pol = tmp_path / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1")
    yield d
    d.finish()
    assert leftovers(str(home), str(runtime_path(home))) == []
