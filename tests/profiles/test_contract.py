"""Seam 2 contract suite: the same tests against the local implementations and the fakes."""
from __future__ import annotations

import os
import stat

import pytest

from sfguard.supervisor.profiles.sealing import SealError
from sfguard.supervisor.protocols import (
    Granted,
    KeyProvider,
    ProfileError,
    ProfileKey,
    ProfileLease,
    ProfileNameError,
    ProfileNotFound,
    ProfileStore,
    Waiting,
)
from tests.profiles.conftest import SCOPE_A, SCOPE_B

A = ProfileKey(SCOPE_A, "shop")
B = ProfileKey(SCOPE_B, "shop")


def hold(harness, key, run="run-seal"):
    """Lease `key` the way the guard does before it opens a profile: a shared store refuses a
    reseal without the current lease (fencing), the local store and the fakes allow it."""
    assert isinstance(harness.lease.try_acquire(key, run), Granted)


def test_implements_protocols(harness):
    assert isinstance(harness.store, ProfileStore)
    assert isinstance(harness.lease, ProfileLease)
    assert isinstance(harness.keys, KeyProvider)


def test_create_open_save_reopen_round_trip(harness):
    harness.store.create(A)
    hold(harness, A)
    work = harness.store.open(A)
    (work / "Default").mkdir(mode=0o700)
    (work / "Default" / "Cookies").write_bytes(b"cookie-db-bytes")
    (work / "Default" / "Cache").mkdir()
    (work / "Default" / "Cache" / "data_0").write_bytes(b"cached")
    harness.store.close(A)
    assert not work.exists()
    assert harness.store.info(A).last_used is not None
    work = harness.store.open(A)
    assert (work / "Default" / "Cookies").read_bytes() == b"cookie-db-bytes"
    assert not (work / "Default" / "Cache").exists()
    harness.store.close(A, save=False)


@pytest.mark.parametrize("identity", [None, "pipeline-0123456789abcdef"])
def test_a_profile_keeps_the_workflow_identity_it_was_made_for(harness, identity):
    made = harness.store.create(A, identity)
    assert made.identity == identity
    assert harness.store.info(A).identity == identity
    assert [i.identity for i in harness.store.list(SCOPE_A)] == [identity]
    hold(harness, A)
    harness.store.open(A)
    harness.store.close(A)                       # a reseal keeps it
    assert harness.store.info(A).identity == identity


@pytest.mark.parametrize("bad", ["../x", "Pipeline-X", "a/b", ""])
def test_an_identity_that_is_not_a_plain_name_is_refused(harness, bad):
    with pytest.raises(ProfileNameError):
        harness.store.create(A, bad)
    assert not harness.store.exists(A)


def test_scope_a_cannot_open_scope_b_by_name(harness):
    harness.store.create(B)
    with pytest.raises(ProfileNotFound):
        harness.store.open(A)                   # same name, other scope: not B's profile
    assert [i.key for i in harness.store.list(SCOPE_A)] == []
    assert [i.key for i in harness.store.list(SCOPE_B)] == [B]


@pytest.mark.parametrize("name", ["../beta/shop", "..", "beta/shop", "/tmp/x", "shop\0"])
def test_scope_a_cannot_address_b_by_path(harness, name):
    harness.store.create(B)
    with pytest.raises(ProfileNameError):
        harness.store.open(ProfileKey(SCOPE_A, name))


def test_copied_profile_of_other_scope_is_refused(harness):
    """An attacker copies B's sealed profile to where A's would be: A cannot open it."""
    harness.store.create(ProfileKey(SCOPE_A, "other"))      # scope A has a key of its own
    harness.store.create(B)
    hold(harness, B)
    b_work = harness.store.open(B)
    (b_work / "Cookies").write_bytes(b"B's login")
    harness.store.close(B)
    harness.plant_copy(B, A)
    with pytest.raises((SealError, ProfileError)):
        harness.store.open(A)
    assert A not in harness.store.unsealed()


def test_delete_scope_removes_only_that_scope(harness):
    for key in (A, ProfileKey(SCOPE_A, "mail"), B):
        harness.store.create(key)
    removed = harness.store.delete_scope(SCOPE_A)
    assert sorted(k.name for k in removed) == ["mail", "shop"]
    assert harness.store.list(SCOPE_A) == []
    assert [i.key for i in harness.store.list(SCOPE_B)] == [B]
    hold(harness, B)
    work = harness.store.open(B)                 # B still opens with its own key
    harness.store.close(B)
    assert work.name == "shop"


def test_delete_refused_while_open(harness):
    harness.store.create(A)
    hold(harness, A)
    harness.store.open(A)
    with pytest.raises(ProfileError):
        harness.store.delete(A)
    harness.store.close(A)
    harness.lease.release(A, "run-seal")
    harness.store.delete(A)
    assert not harness.store.exists(A)


def test_deleted_scope_key_kills_data(harness):
    harness.store.create(A)
    harness.keys.delete_key(SCOPE_A)
    with pytest.raises(Exception) as err:
        harness.store.open(A)
    assert "key" in str(err.value)
    assert A not in harness.store.unsealed()


def test_lease_fifo_shows_holder_and_position(harness):
    lease = harness.lease
    g = lease.try_acquire(A, "run-1")
    assert isinstance(g, Granted) and not g.reentrant
    again = lease.try_acquire(A, "run-1")       # another stage of the same run: no wait
    assert isinstance(again, Granted) and again.reentrant
    w2 = lease.try_acquire(A, "run-2")
    w3 = lease.try_acquire(A, "run-3")
    assert isinstance(w2, Waiting) and (w2.holder_run, w2.position) == ("run-1", 1)
    assert isinstance(w3, Waiting) and (w3.holder_run, w3.position) == ("run-1", 2)
    assert w2.holder_since == g.since
    assert [q.run for q in lease.queue(A)] == ["run-2", "run-3"]
    assert lease.holder(A).run == "run-1"
    assert isinstance(lease.try_acquire(B, "run-3"), Granted)   # other profile: independent
    assert lease.release(A, "run-1")
    w3b = lease.try_acquire(A, "run-3")          # run-3 asks first but run-2 is ahead
    assert isinstance(w3b, Waiting) and w3b.holder_run is None and w3b.position == 2
    assert isinstance(lease.try_acquire(A, "run-2"), Granted)
    assert lease.release(A, "run-2")
    assert isinstance(lease.try_acquire(A, "run-3"), Granted)


# How each run outcome reaches the lease: succeeded/failed/cancelled/abandoned runs end with
# release_all(run) (or release(key, run)); a guard restart finds the holder process dead.
@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled", "abandoned", "restart"])
def test_lease_released_on_every_outcome(harness, outcome):
    lease = harness.lease
    if outcome == "restart":
        handle, got = harness.other_process_acquires(A, "run-1")
        assert got == "Granted"
    else:
        assert isinstance(lease.try_acquire(A, "run-1"), Granted)
        lease.try_acquire(B, "run-1")
    w = lease.try_acquire(A, "run-2")
    assert isinstance(w, Waiting) and w.holder_run == "run-1"
    if outcome == "restart":
        harness.kill(handle)
        assert (A, "run-1") in lease.sweep_stale()
    elif outcome == "cancelled":
        assert lease.release(A, "run-1")
    else:
        assert set(lease.release_all("run-1")) >= {A}
        assert lease.holder(B) is None
    assert isinstance(lease.try_acquire(A, "run-2"), Granted)
    assert lease.holder(A).run == "run-2"


def test_queue_entries_of_dead_process_dropped(harness):
    lease = harness.lease
    assert isinstance(lease.try_acquire(A, "run-1"), Granted)
    handle, got = harness.other_process_acquires(A, "run-ghost")
    assert got == "Waiting"
    assert [q.run for q in lease.queue(A)] == ["run-ghost"]
    harness.kill(handle)
    lease.sweep_stale()
    assert lease.queue(A) == []
    lease.release(A, "run-1")
    assert isinstance(lease.try_acquire(A, "run-2"), Granted)


@pytest.mark.parametrize("bad", ["", "../x", "a b", "r\n", "x" * 200])
def test_lease_refuses_bad_run_ids(harness, bad):
    with pytest.raises(ValueError):
        harness.lease.try_acquire(A, bad)


def test_local_modes(tmp_path):
    from tests.profiles.conftest import LocalHarness
    h = LocalHarness(tmp_path)
    h.store.create(A)
    work = h.store.open(A)
    (work / "f").write_bytes(b"x")
    h.lease.try_acquire(A, "run-1")
    h.store.close(A)
    for root in (h.home, h.runtime):
        for base, _dirs, files in os.walk(root):
            assert stat.S_IMODE(os.stat(base).st_mode) == 0o700, base
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(base, f)).st_mode) == 0o600, f


def test_verify_checks_a_stored_profile(harness):
    """The guard's start-up check: a stored profile verifies, a missing one is a ProfileError."""
    harness.store.create(A)
    harness.store.verify(A)
    with pytest.raises(ProfileError):
        harness.store.verify(ProfileKey(SCOPE_A, "absent"))
