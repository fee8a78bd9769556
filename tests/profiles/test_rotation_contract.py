"""The key rotation contract (issue 51), the same for every store: the local home, the
in-memory fakes and PostgreSQL. A rotation reseals every profile at rest, a leased one when its
run releases it, the audit chain verifies across it, a rotation cut short is resumed (never
repeated), and an old version is retired only when nothing uses it."""
from __future__ import annotations

import pytest

from sfguard.supervisor.profiles import rotation
from sfguard.supervisor.profiles.key_versions import KeyStateError
from sfguard.supervisor.protocols import Granted, ProfileError, ProfileKey
from tests.profiles.conftest import SCOPE_A, SCOPE_B

A = ProfileKey(SCOPE_A, "shop")
B = ProfileKey(SCOPE_B, "mail")


def with_login(harness, key, text: str) -> None:
    """A profile holding a login (a file in it), sealed, no lease left, and its audit record."""
    harness.store.create(key)
    harness.audit.record("profile_created", scope=key.scope, profile=key.name)
    assert isinstance(harness.lease.try_acquire(key, "seed"), Granted)
    work = harness.store.open(key)
    (work / "Cookies").write_text(text)
    harness.store.close(key)
    harness.lease.release(key, "seed")


def login_of(harness, key, run="reader") -> str:
    assert isinstance(harness.lease.try_acquire(key, run), Granted)
    try:
        return (harness.store.open(key) / "Cookies").read_text()
    finally:
        harness.store.close(key, save=False)
        harness.lease.release(key, run)


def events(harness) -> list[str]:
    return [r["event"] for r in harness.audit.records()]


def test_a_rotation_reseals_every_profile_at_rest_and_each_opens(harness):
    stores = harness.stores()
    with_login(harness, A, "login-a")
    with_login(harness, B, "login-b")
    harness.add_key_version()
    report = rotation.rotate(stores)
    assert (report["from_version"], report["to_version"], report["finished"]) == (1, 2, True)
    assert sorted(report["resealed"]) == ["mail", "shop"] and report["pending"] == []
    assert harness.store.key_version(A) == harness.store.key_version(B) == 2
    assert login_of(harness, A) == "login-a" and login_of(harness, B) == "login-b"
    status = rotation.key_status(stores)
    assert status["current"] == 2 and status["rotation"] is None
    assert [(v["version"], v["state"], v["profiles"]) for v in status["versions"]] == [(1, "old", 0),
                                                                                       (2, "current", 2)]
    assert harness.audit.verify().ok
    got = events(harness)
    assert got.index("key_rotation_started") < got.index("key_rotated") < got.index("key_rotation_finished")
    assert got.count("profile_rekeyed") == 2


def test_a_leased_profile_is_resealed_when_its_run_releases_it(harness):
    stores = harness.stores()
    with_login(harness, A, "login-a")
    with_login(harness, B, "login-b")
    assert isinstance(harness.lease.try_acquire(A, "r1"), Granted)
    work = harness.store.open(A)
    harness.add_key_version()
    report = rotation.rotate(stores)
    assert report["resealed"] == ["mail"] and not report["finished"]
    assert [(p["profile"], p["leased_by"]) for p in report["pending"]] == [("shop", "r1")]
    assert harness.store.key_version(A) == 1                 # its run still has it
    assert rotation.key_status(stores)["rotation"]["remaining"][0]["profile"] == "shop"
    (work / "Cookies").write_text("login-a, renewed by r1")
    rotation.close_profile(stores, A, "r1")
    harness.lease.release(A, "r1")
    assert harness.store.key_version(A) == 2
    assert login_of(harness, A) == "login-a, renewed by r1"
    assert stores.keys.rotation() is None                    # nothing left on version 1: finished
    rekeyed = [r["fields"] for r in harness.audit.records(profile="shop") if r["event"] == "profile_rekeyed"]
    assert rekeyed == [{"profile": "shop", "scope": SCOPE_A, "run": "r1", "from_version": 1, "to_version": 2}]
    assert harness.audit.verify().ok


def test_retire_refuses_while_a_profile_uses_the_version_and_then_drops_it(harness):
    stores = harness.stores()
    with_login(harness, A, "login-a")
    old_copy = harness.snapshot(A)                  # a copy of the sealed profile taken earlier
    assert isinstance(harness.lease.try_acquire(A, "r1"), Granted)
    harness.store.open(A)
    harness.add_key_version()
    rotation.rotate(stores)
    refused = rotation.retire(stores, 1)
    assert refused["retired"] is False
    assert [(u["profile"], u["scope"], u["leased_by"]) for u in refused["users"]] == [("shop", SCOPE_A, "r1")]
    with pytest.raises(KeyStateError, match="current"):
        rotation.retire(stores, 2)
    rotation.close_profile(stores, A, "r1")
    harness.lease.release(A, "r1")
    assert rotation.retire(stores, 1)["retired"] is True
    assert login_of(harness, A) == "login-a"
    assert [v.state for v in stores.keys.versions()] == ["retired", "current"]
    assert harness.audit.verify().ok and "key_retired" in events(harness)
    harness.restore(A, old_copy)                     # the old copy and every key the store has
    assert isinstance(harness.lease.try_acquire(A, "thief"), Granted)
    with pytest.raises(ProfileError):
        harness.store.open(A)
    assert A not in harness.store.unsealed()
    with pytest.raises(KeyStateError, match="not a live version"):
        rotation.retire(stores, 1)


@pytest.mark.parametrize("cut", ["prepared", "switched", "half resealed"])
def test_a_rotation_cut_short_is_resumed_not_repeated(harness, cut):
    """What a crash between the steps leaves: `rotate` again finishes the same rotation."""
    stores = harness.stores()
    with_login(harness, A, "login-a")
    with_login(harness, B, "login-b")
    harness.add_key_version()
    rot = stores.keys.prepare_version(stores.store.scopes())
    if cut in ("switched", "half resealed"):
        stores.audit.switch_key(rot.to_version)
    if cut == "half resealed":
        assert isinstance(harness.lease.try_acquire(A, "keys-rotation-v2"), Granted)
        stores.store.rekey(A)
        harness.lease.release(A, "keys-rotation-v2")
    for key, text in ((A, "login-a"), (B, "login-b")):
        assert login_of(harness, key) == text           # readable under one key or the other
    assert harness.audit.verify().ok
    report = rotation.rotate(stores)
    assert report["resumed"] and report["to_version"] == 2 and report["finished"]
    assert [v.version for v in stores.keys.versions()] == [1, 2]      # no third version
    assert harness.store.key_version(A) == harness.store.key_version(B) == 2
    assert login_of(harness, A) == "login-a" and login_of(harness, B) == "login-b"
    assert harness.audit.verify().ok
    assert events(harness).count("key_rotated") == 1
