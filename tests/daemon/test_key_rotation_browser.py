"""Keys that rotate, with the real tools (issue 51's proof): a login made by real Chromium
through the guard is sealed under key version 1; while another run holds a profile the keys
rotate; the login still works afterwards (and after the old version is retired), the held
profile follows when its run ends, and the audit chain verifies across the rotation and fails
on an edited segment from before it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.daemon.conftest import ROOT
from tests.reliability.conftest import cookies_seen, login_as_stage

pytestmark = pytest.mark.browser


def sfguard(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args, "--home", str(d.home)],
                          cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=180)


def env_of(d, run: str, profile: str) -> dict:
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    st, body = d.call("POST", f"/v1/runs/{run}/stages", {
        "stage_id": "s1", "attempt": 1,
        "browser": {"profile": profile, "headed": False, "allow_domains": ["site-a.test"]}})
    assert st == 200, body
    return body["env"]


def end(d, run: str) -> None:
    st, body = d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})
    assert st == 200 and body["ok"], body


def test_a_real_login_survives_a_key_rotation(real_daemon, site):
    d, a = real_daemon, f"http://site-a.test:{site}"
    login_as_stage(env_of(d, "login", "acct"), a)
    end(d, "login")
    held = env_of(d, "held", "other")                      # a run holds another profile
    assert "sf_persist" not in cookies_seen(held, a)
    out = sfguard(d, "keys", "rotate")
    assert out.returncode == 0, out.stderr
    assert "1 profile(s) resealed at rest" in out.stdout
    assert "waiting: local/other is leased by run held" in out.stdout
    assert "sf_persist" in cookies_seen(env_of(d, "after", "acct"), a)    # logged in, under version 2
    end(d, "after")
    login_as_stage(held, a)                                # the held run logs in meanwhile
    end(d, "held")                                         # its profile is resealed under version 2
    assert "rotation" not in sfguard(d, "keys", "status").stdout
    assert sfguard(d, "keys", "retire", "1").returncode == 0
    for run, profile in (("after-retire", "acct"), ("other-after", "other")):
        assert "sf_persist" in cookies_seen(env_of(d, run, profile), a)
        end(d, run)
    assert sfguard(d, "audit", "verify").returncode == 0
    (segment,) = sorted((d.home / "audit.d").glob("*.log"))
    segment.write_text(segment.read_text().replace('"run":"login"', '"run":"forged"', 1))
    broken = sfguard(d, "audit", "verify")
    assert broken.returncode == 1 and f"audit.d/{segment.name}" in broken.stderr, broken.stderr
