"""Teardown built in a test with fakes for just what it uses (supervisor/testing): the in-memory
browser host and profile seams, the real run records, stage sessions, approvals and the
deferred work. What a run's end must do whatever fails on the way: every step runs, each
failure is named, a login is never lost, and a lease is released only once its profile is
sealed."""
from __future__ import annotations

import errno
import time

import pytest

from sfguard.supervisor.browsers.host import AnchorError, AnchorSpec
from sfguard.supervisor.daemon.crash import RunRecords
from sfguard.supervisor.daemon.deferred import Deferred
from sfguard.supervisor.daemon.runs import Browser, Run, RunOutcome, RunState
from sfguard.supervisor.daemon.stage_attach import STAGE_ENV_KEYS
from sfguard.supervisor.daemon.stage_sessions import StageSessions
from sfguard.supervisor.daemon.teardown import Teardown
from sfguard.supervisor.gate.cdp_gate import CdpGate
from sfguard.supervisor.profiles import store_ops
from sfguard.supervisor.profiles.store_ops import StoreCalls
from sfguard.supervisor.profiles.stores import Stores
from sfguard.supervisor.protocols import LOCAL_SCOPE, Granted, ProfileKey
from sfguard.supervisor.stage.stage_bridge import BridgeHost
from sfguard.supervisor.testing import (
    FakeAuditSink,
    FakeBrowserHost,
    FakeKeyProvider,
    FakeProfileLease,
    FakeProfileStore,
)
from sfguard.supervisor.writes.approvals import Approvals

ACCT = ProfileKey(LOCAL_SCOPE, "acct")


class FullDiskStore(FakeProfileStore):
    """A store whose disk fills up: saving fails with ENOSPC while `full` is set."""
    full = False

    def save(self, key):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().save(key)


class Rig:
    def __init__(self, tmp_path, host: FakeBrowserHost):
        keys = FakeKeyProvider()
        self.store = FullDiskStore(scopes=(LOCAL_SCOPE,), keys=keys)
        self.stores = Stores("fake", "in-memory", keys, self.store, FakeProfileLease(), FakeAuditSink())
        self.calls = StoreCalls(1)
        self.host = host
        self.runs: dict[str, Run] = {}
        self.ended: list[str] = []
        sessions = StageSessions(CdpGate(), host, tmp_path / "ab", tmp_path / "cfg.json", STAGE_ENV_KEYS)
        self.deferred = Deferred(self.stores, self.calls)
        self.teardown = Teardown(
            runs=self.runs, stages=None, supply=None,   # no stage here: ending stages is not what this tests
            records=RunRecords(tmp_path / "runs", LOCAL_SCOPE, sessions), host=host,
            sessions=sessions, gate=CdpGate(), bridges=BridgeHost(tmp_path / "rt"),
            approvals=Approvals(), stores=self.stores, calls=self.calls, deferred=self.deferred,
            run_ended=lambda run: self.ended.append(run.run_id), flush_refusals=lambda: None)
        (tmp_path / "runs").mkdir(mode=0o700)

    async def run_with_login(self, tmp_path, run_id: str = "r1") -> Run:
        """A run holding profile `acct`, its browser started, and a login written into the
        profile since (what the run's end must seal)."""
        run = Run(run_id, None, time.time())
        self.runs[run_id] = run
        self.store.create(ACCT)
        assert isinstance(store_ops.grant(self.stores, ACCT, run_id), Granted)
        profile_dir = self.store.open(ACCT)
        (profile_dir / "Cookies").write_bytes(b"session=logged-in")
        anchor = await self.host.launch_anchor(AnchorSpec(
            session="sfa-1", socket_dir=tmp_path / "ab", config_path=tmp_path / "cfg.json",
            browser_path="/nonexistent/chromium", profile_dir=profile_dir, allow_direct=True))
        run.browsers["acct"] = Browser("acct", ACCT, headed=False, client="b1", anchor=anchor)
        return run

    def sealed_login(self) -> bytes | None:
        path = self.store.open(ACCT)
        try:
            cookie = path / "Cookies"
            return cookie.read_bytes() if cookie.exists() else None
        finally:
            self.store.close(ACCT, save=False)


async def test_a_run_end_closes_the_browser_seals_the_login_and_releases_the_lease(tmp_path):
    rig = Rig(tmp_path, FakeBrowserHost())
    run = await rig.run_with_login(tmp_path)
    await rig.teardown.end_run(run, RunOutcome.SUCCEEDED)
    assert (run.state, run.outcome, run.problems) == (RunState.ENDED, RunOutcome.SUCCEEDED, [])
    assert rig.host.closed == ["sfa-1"] and run.browsers == {}
    assert rig.sealed_login() == b"session=logged-in"
    assert rig.stores.lease.holder(ACCT) is None and rig.ended == ["r1"]
    # a second end of the same run does nothing again
    await rig.teardown.end_run(run, RunOutcome.FAILED)
    assert run.outcome == RunOutcome.SUCCEEDED and rig.host.closed == ["sfa-1"]


async def test_a_browser_that_will_not_close_is_named_and_its_login_is_still_sealed(tmp_path):
    rig = Rig(tmp_path, FakeBrowserHost(fail_close=AnchorError("the browser did not answer Browser.close")))
    run = await rig.run_with_login(tmp_path)
    await rig.teardown.end_run(run, RunOutcome.FAILED)
    assert run.problems == ["closing the browser of acct: the browser did not answer Browser.close"]
    assert run.state == RunState.ENDED and run.browsers == {}
    assert rig.sealed_login() == b"session=logged-in"       # the later steps ran all the same
    assert rig.stores.lease.holder(ACCT) is None


async def test_a_full_disk_at_the_seal_keeps_the_unsealed_login_and_the_lease(tmp_path):
    rig = Rig(tmp_path, FakeBrowserHost())
    run = await rig.run_with_login(tmp_path)
    rig.store.full = True
    await rig.teardown.end_run(run, RunOutcome.SUCCEEDED)
    assert len(run.problems) == 1 and "no space left" in run.problems[0], run.problems
    assert run.state == RunState.ENDED
    # nothing was lost and nobody else can take the profile before it is sealed
    holder = rig.stores.lease.holder(ACCT)
    assert holder is not None and holder.run == "r1"
    assert rig.deferred.holds("r1") and rig.deferred.releases == {"r1": "succeeded"}
    assert any("reseal waits for disk space" in line for line in rig.deferred.pending())
    assert ACCT in rig.store.unsealed()


@pytest.mark.parametrize("fail_close", [None, AnchorError("gone")])
async def test_a_crashed_browser_at_the_end_still_ends_the_run(tmp_path, fail_close):
    rig = Rig(tmp_path, FakeBrowserHost(fail_close=fail_close))
    run = await rig.run_with_login(tmp_path)
    rig.host.kill(run.browsers["acct"].anchor)
    assert not rig.host.alive(run.browsers["acct"].anchor)
    await rig.teardown.end_run(run, RunOutcome.CANCELLED)
    assert run.state == RunState.ENDED and rig.stores.lease.holder(ACCT) is None
    assert rig.sealed_login() == b"session=logged-in"
