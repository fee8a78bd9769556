"""Damaged files in the guard home: a corrupted lease file, a truncated audit log, a tampered
sealed profile, a half-written run record. Each is detected with a clear message naming the
file, and nothing is silently reset (the damaged bytes stay as they were)."""
from __future__ import annotations

import time

import pytest

from tests.reliability.conftest import audit_verify, request_stage
from tests.reliability.test_fault_daemon_kill import seed_profile

pytestmark = pytest.mark.reliability


def prepared(make_fake_guard):
    """A home with one profile and a few audit records; the guard stopped cleanly."""
    d = make_fake_guard()
    seed_profile(d)
    d.stop()
    return d


def start_and_collect(d, timeout: float = 30) -> tuple[int | None, str]:
    """Start the guard; (exit code, or None when it is serving; its stdout + log)."""
    d.start(*d.start_args, expect_ready=False)
    out, deadline, rc = b"", time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        line = d.proc.stdout.readline()       # the daemon prints a line at a time, then "ready"
        if not line:                          # EOF: it exited
            rc = d.proc.wait(10)
            break
        out += line
        if line.strip() == b"sfguard: ready":
            break
    else:
        raise AssertionError(f"the guard neither started nor exited: {out!r}")
    return rc, out.decode(errors="replace") + d.log.read_text(errors="replace")


def test_corrupted_lease_file_stops_the_start_with_a_clear_message(make_fake_guard):
    d = prepared(make_fake_guard)
    lease = d.home / "leases" / "local" / "acct.lease"
    damaged = b'{"holder": {"run": "x", "since'
    lease.write_bytes(damaged)
    rc, text = start_and_collect(d)
    assert rc not in (None, 0), text[-2000:]
    assert "acct.lease is damaged" in text and "Traceback" not in text, text[-2000:]
    assert lease.read_bytes() == damaged       # not reset


def test_truncated_audit_log_is_never_silently_reset(make_fake_guard):
    d = prepared(make_fake_guard)
    log = d.home / "audit.log"
    full = log.read_bytes()
    cut = full[:full.rstrip(b"\n").rfind(b"\n") + 1]    # the last record removed
    log.write_bytes(cut)
    v = audit_verify(d.home)
    assert v.returncode != 0 and "truncated" in (v.stdout + v.stderr), v.stdout + v.stderr
    rc, text = start_and_collect(d)
    assert rc is None, text[-2000:]
    # the guard keeps working, and the damage stays visible: the chain is not restarted
    d.call("POST", "/v1/runs", {"run_id": "r2"})
    assert request_stage(d, "r2", "s1")[0] == 200
    d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})
    assert log.read_bytes().startswith(cut)
    assert audit_verify(d.home).returncode != 0


def test_tampered_sealed_profile_is_refused_and_kept(make_fake_guard):
    d = prepared(make_fake_guard)
    sealed = d.home / "profiles" / "local" / "acct" / "profile.sealed"
    data = bytearray(sealed.read_bytes())
    data[len(data) // 2] ^= 0x01
    sealed.write_bytes(bytes(data))
    rc, text = start_and_collect(d)
    assert rc is None, text[-2000:]
    d.call("POST", "/v1/runs", {"run_id": "r2"})
    st, body = request_stage(d, "r2", "s1")
    assert st == 409 and "failed authentication" in body["error"]["message"], body
    assert sealed.read_bytes() == bytes(data)  # not replaced by a fresh empty profile
    # the run that could not get it ends cleanly and holds nothing
    assert d.call("POST", "/v1/runs/r2/end", {"outcome": "failed"})[0] == 200
    st, body = d.call("GET", "/v1/status")
    assert all(l["holder_run"] is None for l in body["leases"])


def test_half_written_run_record_is_reported_and_left_for_inspection(make_fake_guard):
    d = prepared(make_fake_guard)
    rec = d.home / "runs" / "r9.json"
    half = b'{"run_id": "r9", "daemon": {"pid'
    rec.write_bytes(half)
    rc, text = start_and_collect(d)
    assert rc is None, text[-2000:]
    assert "r9.json is unreadable" in text, text[-2000:]
    assert rec.read_bytes() == half
    d.call("POST", "/v1/runs", {"run_id": "r2"})
    assert request_stage(d, "r2", "s1")[0] == 200
    d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})


@pytest.mark.parametrize("damage", ["audit", "sealed"])
def test_start_reports_a_damaged_audit_log_or_sealed_profile(make_fake_guard, damage):
    d = prepared(make_fake_guard)
    if damage == "audit":
        log = d.home / "audit.log"
        full = log.read_bytes()
        log.write_bytes(full[:full.rstrip(b"\n").rfind(b"\n") + 1])
        expect = "audit"
    else:
        sealed = d.home / "profiles" / "local" / "acct" / "profile.sealed"
        data = bytearray(sealed.read_bytes())
        data[len(data) // 2] ^= 0x01
        sealed.write_bytes(bytes(data))
        expect = "acct"
    d.log.write_text("")
    rc, text = start_and_collect(d)
    start_text = text.split("sfguard: ready")[0] + d.log.read_text()
    assert "ERROR" in start_text and expect in start_text.split("ERROR", 1)[1], start_text[-2000:]
