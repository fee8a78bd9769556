"""Fixtures for `sfguard stage-exec`: a workspace the stage user can write, and a runner-side
helper that runs stage-exec like a pipeline runner would (with a sentinel in its env)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sfguard.supervisor.stage import sandbox
from tests.daemon.conftest import ROOT, daemon, fake_cdp  # noqa: F401 (fixtures)

SENTINEL = "sfg-sentinel-3b9c"
#: the system Python, readable by the stage user (the venv's may live in root's home)
STAGE_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def stage_user() -> sandbox.StageUser | None:
    return sandbox.ensure_stage_user() if os.geteuid() == 0 else None


@pytest.fixture
def workspace():
    """The stage's workspace: crossable from / and owned by the stage user when we are root
    (the runner's job in a real deployment)."""
    ws = Path(tempfile.mkdtemp(prefix="sfg-ws-", dir="/tmp"))
    os.chmod(ws, 0o755)
    user = stage_user()
    if user is not None:
        os.chown(ws, user.uid, user.gid)
    yield ws
    shutil.rmtree(ws, ignore_errors=True)


def runner_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home.parent), "LANG": "C.UTF-8",
            "TERM": "dumb", "PYTHONPATH": str(ROOT), "SFG_TEST_SENTINEL": SENTINEL,
            "HTTP_PROXY": "http://runner-proxy.invalid:1"}


def stage_exec_argv(home: Path, run: str, stage: str, *cmd: str) -> list[str]:
    return [sys.executable, "-m", "sfguard.cli.main", "stage-exec", "--home", str(home), "--run", run,
            "--stage", stage, "--", *cmd]


def stage_exec(home: Path, ws: Path, run: str, stage: str, *cmd: str,
               timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(stage_exec_argv(home, run, stage, *cmd), cwd=ws, env=runner_env(home),
                          capture_output=True, text=True, timeout=timeout)


def start_fake_daemon(tmp_path: Path, cdp, *args: str, path_prefix: str = "",
                      expect_ready: bool = True):
    """A guard like tests/daemon's `daemon` fixture (fake agent-browser and CDP), with extra
    start arguments and an optional PATH prefix (`expect_ready=False`: do not wait for it)."""
    import json

    from sfguard.supervisor.home import runtime_dir
    from tests.daemon.conftest import FAKE_AB, Daemon
    home = (tmp_path / "home").absolute()
    env = {"PATH": path_prefix + os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "SFGUARD_AGENT_BROWSER": str(FAKE_AB), "PYTHONPATH": str(ROOT)}
    ab = runtime_dir(home) / "ab"
    ab.mkdir(mode=0o700, exist_ok=True)
    (ab / "fake-control.json").write_text(json.dumps(
        {"cdp_url": cdp.url, "log": str(tmp_path / "fake-ab.jsonl")}))
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start(*args, expect_ready=expect_ready)
    return d
