"""The installed distribution: one `sfguard` namespace, usable outside the checkout.

Builds the wheel from a copy of the tracked files (so nothing untracked can leak in), installs
it into a fresh venv in a temporary folder (dependencies pinned by requirements.lock, from pip's
cache after ./dev setup), and runs the console script and `python -m sfguard` from there.
Marked slow (not in the default suite, which must keep CI under 30 minutes; it builds a wheel
and installs a whole venv): `./dev test -m "slow or not slow" tests/packaging`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GENERIC = {"cli", "policy", "proxy_addons", "supervisor", "fixtures", "tests", "bench"}


def run(argv: list[str], cwd: Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "LANG": "C.UTF-8",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CACHE_DIR"):
        if k in os.environ:
            env[k] = os.environ[k]
    if "PIP_CACHE_DIR" not in env and os.environ.get("HOME"):
        env["PIP_CACHE_DIR"] = str(Path(os.environ["HOME"]) / ".cache" / "pip")  # reuse ./dev's
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if name.startswith(("tests/", "bench/", "node_modules/")) or not (ROOT / name).is_file():
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    dist = work / "dist"
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                 "-w", str(dist), str(src)], cwd=work)
    assert built.returncode == 0, built.stderr[-2000:]
    wheels = list(dist.glob("sfguard-*.whl"))
    assert len(wheels) == 1, wheels
    top = {n.split("/", 1)[0] for n in zipfile.ZipFile(wheels[0]).namelist()}
    assert top <= {"sfguard", *(t for t in top if t.endswith(".dist-info"))}, top
    venv = work / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], cwd=work)
    assert made.returncode == 0, made.stderr
    inst = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c",
                str(ROOT / "requirements.lock"), str(wheels[0])], cwd=work)
    assert inst.returncode == 0, inst.stderr[-2000:]
    return venv


def test_wheel_installs_only_the_sfguard_namespace(installed):
    site = next((installed / "lib").glob("python3*/site-packages"))
    assert (site / "sfguard" / "supervisor" / "daemon" / "guard.py").is_file()
    assert (site / "sfguard" / "policy" / "sites.yaml").is_file()
    assert (site / "sfguard" / "supervisor" / "demo" / "login-pipeline.yaml").is_file()
    assert not GENERIC & {p.name for p in site.iterdir()}
    assert not list(site.glob("__editable__*"))


@pytest.mark.parametrize("argv, expect", [
    (["sfguard", "--version"], "sfguard 0.1.0"),
    (["sfguard", "policy", "explain", "example.com"], "example.com"),
    (["sfguard", "demo", "--help"], "usage: sfguard demo"),
    (["python", "-m", "sfguard", "--version"], "sfguard 0.1.0"),
])
def test_commands_run_from_the_installed_wheel(installed, tmp_path, argv, expect):
    exe = installed / "bin" / argv[0]
    r = run([str(exe), *argv[1:]], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert expect in r.stdout, r.stdout[-2000:]


def test_the_installed_code_is_the_wheel_not_the_checkout(installed, tmp_path):
    r = run([str(installed / "bin" / "python"), "-c",
             "import sfguard.supervisor.daemon.guard as g, sfguard.cli.main as m; "
             "print(g.__file__); print(m.__file__)"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.split():
        assert Path(line).resolve().is_relative_to(installed.resolve()), line


def test_stage_exec_fast_entry_runs_from_the_installed_wheel(installed, tmp_path):
    """The guard's stage prefix runs cli/stage_exec_cmd.py with `python -I -S` (no site): from
    the wheel it must still import the sfguard namespace (here it reaches 'no guard running')."""
    site = next((installed / "lib").glob("python3*/site-packages"))
    entry = site / "sfguard" / "cli" / "stage_exec_cmd.py"
    r = run([str(installed / "bin" / "python"), "-I", "-S", str(entry), "--home", str(tmp_path / "home"),
             "--run", "r1", "--stage", "s1", "--", "true"], cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "no guard is running" in r.stderr and "Traceback" not in r.stderr, r.stderr
