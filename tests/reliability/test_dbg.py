import json, signal, time, subprocess, sys, os
import pytest
from tests.reliability.conftest import request_stage, ROOT
from tests.reliability.test_fault_daemon_kill import seed_profile

CASES = {
 "lease": lambda h: (h/"leases"/"local"/"acct.lease").write_text('{"holder": {"run": "x", "since'),
 "audit": lambda h: (h/"audit.log").write_bytes((h/"audit.log").read_bytes()[:-40]),
 "sealed": lambda h: _flip(h/"profiles"/"local"/"acct"/"profile.sealed"),
 "runrec": lambda h: (h/"runs"/"r9.json").write_text('{"run_id": "r9", "daemon": {"pid'),
}
def _flip(p):
    b = bytearray(p.read_bytes()); b[len(b)//2] ^= 1; p.write_bytes(bytes(b))

@pytest.mark.parametrize("case", list(CASES))
def test_dbg(make_fake_guard, case):
    d = make_fake_guard()
    seed_profile(d)
    d.call("POST", "/v1/runs", {"run_id": "r2"})
    request_stage(d, "r2", "s1")
    d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})
    d.stop()
    CASES[case](d.home)
    d.start(*d.start_args, expect_ready=False)
    try:
        out, _ = d.proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        out = b"(running)"
    print("\n=====", case, d.proc.returncode, out.decode()[-600:])
    print("LOG", open(d.log).read()[-1500:])
    if d.proc.returncode is None:
        print(d.call("GET", "/v1/status")[1])
        st, body = d.call("POST", "/v1/runs", {"run_id": "r3"})
        print("STAGE", request_stage(d, "r3", "s1"))
