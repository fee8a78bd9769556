"""The control API refuses bad input with the error shape, never a traceback."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from tests.daemon.conftest import ROOT


def err(answer):
    status, body = answer
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field"}, body
    return status, body["error"]


@pytest.mark.parametrize("body, field", [
    ({"run_id": "../x"}, "run_id"),
    ({"run_id": "a" * 200}, "run_id"),
    ({"run_id": "ok", "extra": 1}, "extra"),
    ({}, "run_id"),
    ({"run_id": 5}, "run_id"),
])
def test_create_run_bad_input(daemon, body, field):
    status, e = err(daemon.call("POST", "/v1/runs", body))
    assert status == 400 and e["field"] == field


@pytest.mark.parametrize("browser, field", [
    ({"profile": "../etc", "allow_domains": []}, "browser.profile"),
    ({"profile": "Acct", "allow_domains": []}, "browser.profile"),
    ({"profile": "a/b", "allow_domains": []}, "browser.profile"),
    ({"allow_domains": ["*"]}, "browser.allow_domains.0"),
    ({"allow_domains": [".example.com"]}, "browser.allow_domains.0"),
    ({"allow_domains": "example.com"}, "browser.allow_domains"),
    ({"allow_domains": [], "headed": "yes"}, "browser.headed"),
    ({"allow_domains": [], "login_check": {"url": "file:///etc/passwd", "logged_in": "*"}}, "browser.login_check.url"),
    ({"allow_domains": [], "surprise": True}, "browser.surprise"),
])
def test_stage_browser_field_errors_name_the_field(daemon, browser, field):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    status, e = err(daemon.call("POST", "/v1/runs/r1/stages", {"stage_id": "s", "attempt": 1, "browser": browser}))
    assert status == 400 and e["field"] == field, e


def test_headed_without_display_is_a_clear_error(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    status, e = err(daemon.call("POST", "/v1/runs/r1/stages",
                                {"stage_id": "s", "attempt": 1, "browser": {"headed": True, "allow_domains": []}}))
    assert status == 400 and "DISPLAY" in e["message"] and e["field"] == "browser.headed"


def test_unknown_routes_runs_and_bad_json(daemon):
    assert err(daemon.call("GET", "/v1/nope"))[0] == 404
    assert err(daemon.call("GET", "/v1/runs/missing"))[1]["code"] == "run_not_found"
    assert err(daemon.call("POST", "/v1/runs/missing/end", {"outcome": "succeeded"}))[0] == 404
    assert err(daemon.call("POST", "/v1/runs", ["list"]))[0] == 400
    assert err(daemon.call("POST", "/v1/runs/x/end", {"outcome": "exploded"}))[0] == 400
    assert err(daemon.call("DELETE", "/v1/profiles/..%2Fx"))[0] in (400, 404)


def test_huge_body_is_refused(daemon):
    status, e = err(daemon.call("POST", "/v1/runs", {"run_id": "r", "pipeline": "x" * 400_000}))
    assert status == 413


def test_socket_is_private_and_second_instance_refused(daemon):
    assert stat.S_IMODE(os.stat(daemon.home / "guard.sock").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.home).st_mode) == 0o700
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(daemon.home)],
                         cwd=ROOT, env=daemon.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "already running" in out.stderr and "Traceback" not in out.stderr


def test_openapi_document_covers_every_route(daemon):
    status, doc = daemon.call("GET", "/v1/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    for path in ("/v1/runs", "/v1/runs/{run_id}/stages", "/v1/runs/{run_id}/end", "/v1/status"):
        assert path in doc["paths"]
    assert "BrowserField" in doc["components"]["schemas"]


def test_status_cli(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "status", "--home", str(daemon.home)],
                         cwd=ROOT, env=daemon.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "run     r1 active" in out.stdout


def test_policy_edits_apply_live_and_an_invalid_edit_keeps_the_last_good(daemon, tmp_path):
    pol = tmp_path / "sites.yaml"
    pol.write_text("version: 1\nmode: enforce\n")
    daemon.stop()
    daemon.start("--policy", str(pol))
    assert daemon.call("GET", "/v1/status")[1]["policy"]["mode"] == "enforce"
    pol.write_text("version: 1\nmode: report\n")
    deadline = time.monotonic() + 5
    while daemon.call("GET", "/v1/status")[1]["policy"]["mode"] != "report":
        assert time.monotonic() < deadline, "the edit was not applied"
        time.sleep(0.1)
    pol.write_text("version: 1\nmode: report\nsurprise: 1\n")
    deadline = time.monotonic() + 5
    while (st := daemon.call("GET", "/v1/status")[1]["policy"])["state"] != "error":
        assert time.monotonic() < deadline, "the invalid edit was not reported"
        time.sleep(0.1)
    assert st["mode"] == "report" and "surprise" in st["error"] and ":3:" in st["error"]
    out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "status", "--home", str(daemon.home)],
                         cwd=ROOT, env=daemon.env, capture_output=True, text=True, timeout=60)
    assert "last good policy kept" in out.stdout
    audit = (daemon.home / "audit.log").read_text()
    assert '"policy_reloaded"' in audit
