"""Whole runs through the control API, with the fake agent-browser (no real browser)."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time

import psutil
import pytest

from sfguard.supervisor.home import runtime_path
from tests.daemon.conftest import FAKE_AB

STAGE_ENV_KEYS = {"AGENT_BROWSER_CDP", "AGENT_BROWSER_SESSION", "AGENT_BROWSER_SOCKET_DIR",
                  "AGENT_BROWSER_PIN_TAB", "AGENT_BROWSER_CONFIG", "AGENT_BROWSER_IDLE_TIMEOUT_MS"}


def stage(d, run, sid, profile="acct", attempt=1, **browser):
    body = {"stage_id": sid, "attempt": attempt,
            "browser": {"allow_domains": ["site-a.test"], "headed": False, **browser}}
    if profile is not None:
        body["browser"]["profile"] = profile
    return d.call("POST", f"/v1/runs/{run}/stages", body)


def wait_ready(d, run, sid, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = d.call("GET", f"/v1/runs/{run}/stages/{sid}")
        if status == 200:
            return body
        time.sleep(0.1)
    raise AssertionError(f"stage {run}/{sid} not ready: {body}")


def launches(d):
    """Browser launches seen by the fake Chromium: {"argv", "env", "pid", "profile", "auth"}
    where auth is the credential the guard answered the (simulated) proxy challenge with."""
    out = []
    log = d.browser_log()
    for c in log:
        if "argv" in c:
            c["profile"] = next(a.split("=", 1)[1] for a in c["argv"] if a.startswith("--user-data-dir="))
            answers = [e["params"]["authChallengeResponse"] for e in log
                       if e.get("pid") == c["pid"] and e.get("method") == "Fetch.continueWithAuth"]
            c["auth"] = answers[0] if answers else None
            out.append(c)
    return out


def test_profile_stage_gets_only_the_stage_env_and_a_guarded_anchor(daemon):
    assert daemon.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    status, body = stage(daemon, "r1", "s1")
    assert status == 200 and body["state"] == "ready", body
    env = body["env"]
    assert set(env) == STAGE_ENV_KEYS
    assert env["AGENT_BROWSER_PIN_TAB"] == "1" and env["AGENT_BROWSER_IDLE_TIMEOUT_MS"] == "0"
    assert env["AGENT_BROWSER_CDP"].startswith("ws://127.0.0.1:")
    (anchor,) = launches(daemon)
    argv = anchor["argv"]
    # DevTools over the pipe only, never a port; the run proxy with loopback through it
    assert "--remote-debugging-pipe" in argv
    assert not any(a.startswith("--remote-debugging-port") for a in argv)
    assert "--proxy-bypass-list=<-loopback>" in argv
    (proxy_arg,) = [a for a in argv if a.startswith("--proxy-server=")]
    assert proxy_arg.startswith("--proxy-server=http://127.0.0.1:") and "@" not in proxy_arg
    assert "--force-webrtc-ip-handling-policy=disable_non_proxied_udp" in argv
    assert anchor["profile"] != "/leak" and anchor["profile"] not in json.dumps(body)
    assert not {"HTTP_PROXY", "AGENT_BROWSER_PROFILE"} & set(anchor["env"])  # guard's env scrubbed
    # the guard answered the proxy's challenge itself, with the run's credential
    auth = anchor["auth"]
    assert auth["response"] == "ProvideCredentials" and auth["username"].startswith("b-")
    proxy_secret = auth["password"]
    assert proxy_secret not in " ".join(argv) and proxy_secret not in json.dumps(anchor["env"])
    # neither the proxy credential nor the profile path in API answers about runs
    for route in ("/v1/runs/r1", "/v1/status", "/v1/profiles"):
        text = json.dumps(daemon.call("GET", route)[1])
        assert proxy_secret not in text and anchor["profile"] not in text
        assert env["AGENT_BROWSER_CDP"].rsplit("/", 1)[1] not in text  # no gate token either
    # the stage session was started with stream off
    assert any(c["argv"][-2:] == ["stream", "disable"] for c in daemon.calls()
               if c["env"].get("AGENT_BROWSER_SESSION") == env["AGENT_BROWSER_SESSION"])
    assert daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200


def test_resume_returns_identical_env_and_stages_share_one_anchor(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    _, a = stage(daemon, "r1", "s1")
    _, b = stage(daemon, "r1", "s2")
    assert a["env"]["AGENT_BROWSER_SESSION"] != b["env"]["AGENT_BROWSER_SESSION"]
    assert a["env"]["AGENT_BROWSER_CDP"] != b["env"]["AGENT_BROWSER_CDP"]
    again = stage(daemon, "r1", "s1")[1]
    polled = daemon.call("GET", "/v1/runs/r1/stages/s1")[1]
    assert json.dumps(again, sort_keys=True) == json.dumps(a, sort_keys=True) == json.dumps(polled, sort_keys=True)
    assert len(launches(daemon)) == 1
    daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})


def test_second_run_waits_with_holder_named_and_starts_when_first_ends(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    daemon.call("POST", "/v1/runs", {"run_id": "r2"})
    assert stage(daemon, "r1", "s1")[0] == 200
    status, body = stage(daemon, "r2", "s1")
    assert status == 202 and body["state"] == "waiting" and body["holder_run"] == "r1"
    status, polled = daemon.call("GET", "/v1/runs/r2/stages/s1")
    assert status == 202 and polled["holder_run"] == "r1"
    st = daemon.call("GET", "/v1/status")[1]
    (lease,) = [l for l in st["leases"] if l["profile"] == "acct"]
    assert lease["holder_run"] == "r1" and [q["run"] for q in lease["queue"]] == ["r2"]
    daemon.call("POST", "/v1/runs/r1/end", {"outcome": "failed"})
    ready = wait_ready(daemon, "r2", "s1")
    assert ready["state"] == "ready"
    daemon.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled", "timed_out"])
def test_stage_end_closes_its_session_and_refuses_its_token(daemon, outcome):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    env = stage(daemon, "r1", "s1")[1]["env"]
    # the stage worker uses its env (its agent-browser session starts a daemon)
    worker = subprocess.run([str(FAKE_AB), "get", "url"], env={"PATH": os.environ["PATH"], **env},
                            capture_output=True, text=True, timeout=30)
    assert worker.returncode == 0, worker.stderr
    status, body = daemon.call("POST", "/v1/runs/r1/stages/s1/end", {"outcome": outcome})
    assert status == 200 and body["ok"], body
    closes = [c for c in daemon.calls() if c["argv"][-1:] == ["close"]
              and c["env"].get("AGENT_BROWSER_SESSION") == env["AGENT_BROWSER_SESSION"]]
    assert closes and closes[0]["env"]["AGENT_BROWSER_CDP"] == env["AGENT_BROWSER_CDP"]
    assert daemon.call("GET", "/v1/runs/r1/stages/s1")[1] == {"state": "ended", "outcome": outcome}
    run = daemon.call("GET", "/v1/runs/r1")[1]
    assert run["state"] == "active" and run["browsers"][0]["alive"]   # the anchor stays for the run
    daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled", "abandoned"])
def test_run_end_closes_anchor_reseals_and_releases(daemon, outcome):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    stage(daemon, "r1", "s1")
    status, body = daemon.call("POST", "/v1/runs/r1/end", {"outcome": outcome})
    assert status == 200 and body["ok"], body
    profiles = daemon.call("GET", "/v1/profiles")[1]["profiles"]
    assert [(p["name"], p["leased_by"]) for p in profiles] == [("acct", None)]
    sealed = daemon.home / "profiles" / "local" / "acct"
    assert stat.S_IMODE(os.stat(sealed).st_mode) == 0o700
    assert not any(p.name == "Cookies" for p in daemon.home.rglob("*"))   # nothing unsealed in the home
    time.sleep(0.5)
    fake_browsers = [p for p in psutil.process_iter(["cmdline"])
                     if "--fake-chromium" in " ".join(p.info["cmdline"] or [])
                     and str(daemon.home) in " ".join(p.info["cmdline"] or [])]
    assert fake_browsers == []
    assert not (daemon.home / "runs" / "r1.json").exists()


def test_stage_at_a_gate_keeps_everything_open(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    env = stage(daemon, "r1", "s1")[1]["env"]
    time.sleep(1.5)  # the run "waits at a gate": nothing is torn down by time
    assert daemon.call("GET", "/v1/runs/r1/stages/s1")[1]["env"] == env
    assert daemon.call("GET", "/v1/runs/r1")[1]["browsers"][0]["alive"]
    daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})


def test_profileless_stage_gets_a_throwaway_browser_without_lease(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    status, body = stage(daemon, "r1", "s1", profile=None)
    assert status == 200
    assert daemon.call("GET", "/v1/profiles")[1]["profiles"] == []
    (launch,) = launches(daemon)
    tmp_profile = launch["profile"]
    assert os.path.isdir(tmp_profile)
    daemon.call("POST", "/v1/runs/r1/stages/s1/end", {"outcome": "succeeded"})
    assert not os.path.exists(tmp_profile)
    daemon.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})


def test_kill_9_of_the_daemon_then_restart_sweeps_everything(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    stage(daemon, "r1", "s1")
    time.sleep(0.3)
    marks = (str(daemon.home), str(runtime_path(daemon.home)))
    owned = [p for p in psutil.process_iter(["cmdline"])
             if any(m in " ".join(p.info["cmdline"] or []) for m in marks)
             and p.pid != daemon.proc.pid]
    assert any("--fake-chromium" in " ".join(p.cmdline()) for p in owned)
    daemon.stop(signal.SIGKILL)
    daemon.start()
    assert "1 dead run(s)" in daemon.banner, daemon.banner
    time.sleep(0.5)
    for p in owned:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, (p.cmdline(), daemon.banner)
    st = daemon.call("GET", "/v1/status")[1]
    assert all(l["holder_run"] is None for l in st["leases"])
    assert not (daemon.home / "runs" / "r1.json").exists()
    # the profile can be leased again
    daemon.call("POST", "/v1/runs", {"run_id": "r2"})
    assert stage(daemon, "r2", "s1")[0] == 200
    daemon.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})
    time.sleep(0.5)
    left = [p for p in psutil.process_iter(["cmdline"])
            if any(m in " ".join(p.info["cmdline"] or []) for m in marks)
            and ("agent-browser-fake" in " ".join(p.info["cmdline"] or [])
                 or "--fake-chromium" in " ".join(p.info["cmdline"] or []))
            and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], [p.info["cmdline"][-4:] for p in left]


def test_no_secret_in_any_file_of_the_home_or_the_guard_log(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "r1"})
    env = stage(daemon, "r1", "s1")[1]["env"]
    stage(daemon, "r1", "s2", profile=None)
    (anchor, *_) = launches(daemon)
    proxy_token = anchor["auth"]["password"]
    gate_token = env["AGENT_BROWSER_CDP"].rsplit("/", 1)[1]
    daemon.call("POST", "/v1/runs/r1/end", {"outcome": "failed"})
    daemon.stop()
    secrets = [proxy_token.encode(), gate_token.encode(), b"/devtools/browser/"]
    files = [p for p in daemon.home.rglob("*") if p.is_file() and p.name != "guard.lock"]
    files.append(daemon.log)
    assert files
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            assert secret not in data, f"{secret!r} found in {path}"
