"""A full guard home (a small tmpfs made for the test), as an operator would meet it:

- a stage asked for while the disk is full gets 503 `disk_full` with a clear message, and no
  lease is left behind;
- a run that ends while the disk is full keeps its login: the unsealed profile and its lease
  stay (another run waits, `status` says why), nothing half-written is left, and when space
  returns the guard reseals and releases by itself; the next run finds the login and the audit
  chain verifies;
- `status` shows free space, `disk_low`, and what waits."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from sfguard.supervisor.home import runtime_dir
from tests.daemon.conftest import FAKE_AB, Daemon, fake_browser_for
from tests.disk import fill

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def body(sid: str) -> dict:
    return {"stage_id": sid, "attempt": 1,
            "browser": {"profile": "acct", "headed": False, "allow_domains": ["site-a.test"]}}


@pytest.fixture
def full_disk_daemon(tmp_path, fake_cdp):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(disk)], check=True)
    home = (disk / "home").absolute()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "SFGUARD_AGENT_BROWSER": str(FAKE_AB), "SFGUARD_BROWSER": str(fake_browser_for(tmp_path)),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    ab = runtime_dir(home) / "ab"
    ab.mkdir(mode=0o700, exist_ok=True)
    (ab / "fake-control.json").write_text(json.dumps({"cdp_url": fake_cdp.url, "log": str(tmp_path / "ab.jsonl")}))
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start()
    try:
        yield d, disk
    finally:
        with contextlib.suppress(FileNotFoundError):
            (disk / "filler").unlink()
        d.finish()
        subprocess.run(["umount", "-l", str(disk)], check=False)


def wait_for(pred, what: str, bound: float = 30.0):
    deadline = time.monotonic() + bound
    while not (got := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return got


def status(d) -> dict:
    code, answer = d.call("GET", "/v1/status")
    assert code == 200
    return answer


def test_a_full_home_fails_closed_keeps_the_login_and_resumes(full_disk_daemon):
    d, disk = full_disk_daemon
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    assert d.call("POST", "/v1/runs/r1/stages", body("s"))[0] == 200
    marker = runtime_dir(d.home) / "profiles" / "local" / "acct" / "sfguard-test-marker"
    marker.write_text("the login of run r1")        # what the run's browser wrote to its profile
    filler = fill(disk)
    st = status(d)
    home_disk = next(x for x in st["disk"] if x["folder"] == "home")
    assert home_disk["low"] is True and home_disk["free_bytes"] < 64 * 1024

    # the run ends with no space: its login and lease are kept, nothing is torn
    code, end = d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
    assert code == 200 and end["ok"] is False
    assert any("no space left" in p and "kept" in p for p in end["problems"]), end
    assert marker.exists()
    st = status(d)
    assert any("acct" in p and "reseal" in p for p in st["pending"]), st["pending"]
    assert [x["holder_run"] for x in st["leases"] if x["profile"] == "acct"] == ["r1"]

    # a new run's stage, while the disk is full: it queues behind the kept lease (202, naming
    # the holder) when its place in the queue could be written, else 503 disk_full; never ready
    assert d.call("POST", "/v1/runs", {"run_id": "r2"})[0] == 201
    code, answer = d.call("POST", "/v1/runs/r2/stages", body("s"))
    assert (code == 202 and answer["holder_run"] == "r1") or \
        (code == 503 and answer["error"]["code"] == "disk_full"), answer
    sid = "s" if code == 202 else "s2"
    proc = subprocess.run([str(Path(os.sys.executable).parent / "sfguard"), "status", "--home", str(d.home)],
                          capture_output=True, text=True, timeout=30)
    assert "DISK LOW" in proc.stdout and "pending profile acct" in proc.stdout, proc.stdout

    # space returns: the reseal and the release happen by themselves, r2 gets the profile
    filler.unlink()
    if sid == "s2":
        wait_for(lambda: status(d)["pending"] == [], "the reseal and release did not happen")
        code, answer = d.call("POST", "/v1/runs/r2/stages", body(sid))
    else:
        code, answer = d.call("GET", "/v1/runs/r2/stages/s?wait=20")
    assert code == 200 and answer["state"] == "ready", answer
    assert status(d)["pending"] == []
    # r2's unsealed copy is the one r1 left: its login survived the full disk
    again = runtime_dir(d.home) / "profiles" / "local" / "acct" / "sfguard-test-marker"
    assert again.read_text() == "the login of run r1"
    d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})
    verify = subprocess.run([str(Path(os.sys.executable).parent / "sfguard"), "audit", "verify",
                             "--home", str(d.home)], capture_output=True, text=True, timeout=30)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_stage_asked_for_on_a_full_home_gets_disk_full(full_disk_daemon):
    d, disk = full_disk_daemon
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    filler = fill(disk)
    code, answer = d.call("POST", "/v1/runs/r1/stages", body("s"))
    assert code == 503 and answer["error"]["code"] == "disk_full", answer
    assert "free space" in answer["error"]["message"]
    assert all(x["holder_run"] is None for x in status(d)["leases"])
    filler.unlink()
    code, answer = d.call("POST", "/v1/runs/r1/stages", body("s2"))
    assert code == 200, answer
    d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
