"""The proxy runs only on the mitmproxy and h11 versions it was tested on
(proxy_addons/versions.py): on any other version `sfguard proxy` and `sfguard start` refuse to
start and `sfguard doctor` reports it, rather than running fast paths on names an upgrade may
have changed. Another version is made visible the way an upgrade would: a distribution's
metadata found first on the import path."""
from __future__ import annotations

import os
import subprocess

import pytest

from sfguard.proxy_addons import versions

from .conftest import ROOT, SFGUARD, write_policy


def pretend(tmp_path, name: str, version: str) -> dict[str, str]:
    """An environment in which importlib.metadata reports `name` at `version`."""
    site = tmp_path / "site"
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_the_tested_versions_are_the_installed_ones():
    assert versions.untested() is None
    assert versions.installed_versions() == versions.TESTED
    assert versions.describe().endswith("(tested)")
    r = subprocess.run(SFGUARD + ["doctor"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if "proxy versions" in x)
    assert line.startswith("ok") and "mitmproxy 11.0.2, h11 0.14.0 (tested)" in line


@pytest.mark.parametrize("name, version", [("mitmproxy", "11.0.3"), ("h11", "0.16.0")])
def test_another_version_refuses_to_start(tmp_path, name, version):
    env = pretend(tmp_path, name, version)
    pol = write_policy(tmp_path / "sites.yaml")
    want = f"{name} {version} (tested: {versions.TESTED[name]})"

    proxy = subprocess.run(SFGUARD + ["proxy", "--policy", str(pol), "--allow", "a.test"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proxy.returncode != 0
    assert want in proxy.stderr and "ready" not in proxy.stdout

    home = tmp_path / "home"
    start = subprocess.run(SFGUARD + ["start", "--home", str(home), "--policy", str(pol)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert start.returncode == 2, start.stderr
    assert "cannot start" in start.stderr and want in start.stderr

    doctor = subprocess.run(SFGUARD + ["doctor"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert doctor.returncode == 1
    assert "MISSING  proxy versions: the proxy runs only on" in doctor.stdout and want in doctor.stdout


def test_the_table_names_tests_that_exist():
    for fp in versions.FAST_PATHS:
        for test in fp.test.split(","):
            path = ROOT / test.strip().split(" ")[0]
            assert path.exists(), (fp.name, path)
