"""The guard home on a full or read-only file system while a profile is resealed and audit
records are appended. The home lives on a small tmpfs mounted for the test (running as root,
chmod would not stop writes); every mount is unmounted in a finally."""
from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from sfguard.supervisor.home import runtime_path
from tests.reliability.conftest import assert_promises, audit_verify, request_stage
from tests.reliability.test_fault_daemon_kill import seed_profile

pytestmark = [pytest.mark.reliability,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]


@contextlib.contextmanager
def small_fs(path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True, timeout=20)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=20)


def remount(path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, timeout=20)


def unsealed(d):
    return runtime_path(d.home) / "profiles" / "local" / "acct"


def check_after(d, sealed_before: bytes) -> None:
    """The last good sealed copy survived and opens; the audit chain verifies."""
    sealed = d.home / "profiles" / "local" / "acct" / "profile.sealed"
    assert sealed.read_bytes() == sealed_before
    assert not list(sealed.parent.glob(".profile.sealed.*.tmp"))
    v = audit_verify(d.home)
    assert v.returncode == 0, v.stdout + v.stderr
    d.call("POST", "/v1/runs", {"run_id": "after"})
    st, body = request_stage(d, "after", "s1")
    assert st == 200, body
    assert (unsealed(d) / "Default" / "marker.txt").read_text() == "logged in"
    assert d.call("POST", "/v1/runs/after/end", {"outcome": "succeeded"})[1]["ok"]


def test_disk_full_while_resealing(make_fake_guard, tmp_path):
    """A run grows its profile past what the home can hold. Its end keeps the login (the
    unsealed copy and the run's lease stay; the last good sealed copy is untouched and nothing
    half-written is left); another run waits for the profile; when the operator gives the home
    more space the guard reseals and releases by itself, and the next run finds the grown login
    (docs/operator-guide.md, "A full disk")."""
    with small_fs(tmp_path / "mnt", "6m") as mnt:
        d = make_fake_guard(home=mnt / "home")
        seed_profile(d)
        sealed = d.home / "profiles/local/acct/profile.sealed"
        sealed_before = sealed.read_bytes()
        d.call("POST", "/v1/runs", {"run_id": "r1"})
        assert request_stage(d, "r1", "s1")[0] == 200
        # the run grew the profile past what the home can hold
        (unsealed(d) / "Default" / "big.bin").write_bytes(os.urandom(12 * 1024 * 1024))
        st, body = d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
        assert st == 200 and body["ok"] is False, body
        problem = " ".join(body["problems"])
        assert "resealing profile acct: no space left" in problem and "No space left" in problem, problem
        assert "unsealed copy and this run's lease are kept" in problem, problem
        # the login is kept: last good seal untouched, nothing half-written, the copy still there
        assert sealed.read_bytes() == sealed_before
        assert not list(sealed.parent.glob(".profile.sealed.*.tmp"))
        assert (unsealed(d) / "Default" / "big.bin").stat().st_size == 12 * 1024 * 1024
        status = d.call("GET", "/v1/status")[1]
        assert any("acct" in p and "reseal" in p for p in status["pending"]), status["pending"]
        assert [x["holder_run"] for x in status["leases"] if x["profile"] == "acct"] == ["r1"]
        # another run waits for the kept lease, naming its holder
        d.call("POST", "/v1/runs", {"run_id": "r2"})
        st, body = request_stage(d, "r2", "s1")
        assert st == 202 and body["holder_run"] == "r1", body
        # space returns (the operator grows the file system): reseal and release by themselves
        remount(mnt, "size=64m")
        st, body = d.call("GET", "/v1/runs/r2/stages/s1?wait=30")
        assert st == 200 and body["state"] == "ready", body
        assert d.call("GET", "/v1/status")[1]["pending"] == []
        assert sealed.read_bytes() != sealed_before           # the grown login was sealed
        assert (unsealed(d) / "Default" / "marker.txt").read_text() == "logged in"
        assert (unsealed(d) / "Default" / "big.bin").stat().st_size == 12 * 1024 * 1024
        assert d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})[1]["ok"]
        v = audit_verify(d.home)
        assert v.returncode == 0, v.stdout + v.stderr
        d.stop()
        d.start(*d.start_args)
        assert_promises(d)
        d.stop()


def test_home_read_only_while_resealing_and_auditing(make_fake_guard, tmp_path):
    """The sealed profiles folder and the audit log go read-only under a live run (the whole
    home cannot be remounted read-only while the daemon holds its instance lock open)."""
    home = (tmp_path / "home").absolute()
    home.mkdir(mode=0o700)
    (home / "profiles").mkdir(mode=0o700)
    with small_fs(home / "profiles", "16m"), small_fs(tmp_path / "amnt", "1m") as amnt:
        (amnt / "audit.log").touch(mode=0o600)
        (home / "audit.log").touch(mode=0o600)
        subprocess.run(["mount", "--bind", str(amnt / "audit.log"), str(home / "audit.log")],
                       check=True, timeout=20)
        try:
            d = make_fake_guard(home=home)
            seed_profile(d)
            sealed_before = (d.home / "profiles/local/acct/profile.sealed").read_bytes()
            d.call("POST", "/v1/runs", {"run_id": "r1"})
            assert request_stage(d, "r1", "s1")[0] == 200
            (unsealed(d) / "Default" / "new.txt").write_text("work of r1")
            remount(home / "profiles", "ro")
            subprocess.run(["mount", "-o", "remount,bind,ro", str(home / "audit.log")],
                           check=True, timeout=20)
            try:
                st, body = d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
            finally:
                remount(home / "profiles", "rw")
                subprocess.run(["mount", "-o", "remount,bind,rw", str(home / "audit.log")],
                               check=True, timeout=20)
            # a clear failure naming the cause, never an internal error
            assert "Read-only file system" in str(body), (st, body)
            assert not (st >= 500 and body["error"]["code"] == "internal"), body
            # the run is over and holds nothing, even though recording it failed
            run = d.call("GET", "/v1/runs/r1")[1]
            assert run["state"] == "ended", run
            assert d.call("GET", "/v1/status")[1]["leases"][0]["holder_run"] is None
            assert (d.home / "profiles/local/acct/profile.sealed").read_bytes() == sealed_before
            # after a restart: promises hold, nothing lost
            d.stop()
            d.start(*d.start_args)
            assert_promises(d)
            check_after_ro(d, sealed_before)
            d.stop()
        finally:
            subprocess.run(["umount", "-l", str(home / "audit.log")], timeout=20)


def test_read_only_home_recovers_after_restart(make_fake_guard, tmp_path):
    """Same fault; whatever the end answer was, a restart on the repaired disk keeps every
    promise and loses nothing (the seed's login, the audit chain)."""
    home = (tmp_path / "home").absolute()
    home.mkdir(mode=0o700)
    (home / "profiles").mkdir(mode=0o700)
    with small_fs(home / "profiles", "16m"), small_fs(tmp_path / "amnt", "1m") as amnt:
        (amnt / "audit.log").touch(mode=0o600)
        (home / "audit.log").touch(mode=0o600)
        subprocess.run(["mount", "--bind", str(amnt / "audit.log"), str(home / "audit.log")],
                       check=True, timeout=20)
        try:
            d = make_fake_guard(home=home)
            seed_profile(d)
            sealed_before = (d.home / "profiles/local/acct/profile.sealed").read_bytes()
            d.call("POST", "/v1/runs", {"run_id": "r1"})
            assert request_stage(d, "r1", "s1")[0] == 200
            remount(home / "profiles", "ro")
            subprocess.run(["mount", "-o", "remount,bind,ro", str(home / "audit.log")],
                           check=True, timeout=20)
            try:
                d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
                assert (d.home / "profiles/local/acct/profile.sealed").read_bytes() == sealed_before
                v = audit_verify(d.home)
                assert v.returncode == 0, v.stdout + v.stderr   # no partial record written
            finally:
                remount(home / "profiles", "rw")
                subprocess.run(["mount", "-o", "remount,bind,rw", str(home / "audit.log")],
                               check=True, timeout=20)
            d.stop()
            d.start(*d.start_args)
            assert_promises(d)
            check_after_ro(d, sealed_before)
            d.stop()
        finally:
            subprocess.run(["umount", "-l", str(home / "audit.log")], timeout=20)


def check_after_ro(d, sealed_before: bytes) -> None:
    """After the read-only episode the sealed copy is the old one or the sweep's complete
    reseal of the crashed run's copy; either way it opens and holds the seed's login."""
    v = audit_verify(d.home)
    assert v.returncode == 0, v.stdout + v.stderr
    d.call("POST", "/v1/runs", {"run_id": "after"})
    st, body = request_stage(d, "after", "s1")
    assert st == 200, body
    assert (unsealed(d) / "Default" / "marker.txt").read_text() == "logged in"
    assert d.call("POST", "/v1/runs/after/end", {"outcome": "succeeded"})[1]["ok"]
