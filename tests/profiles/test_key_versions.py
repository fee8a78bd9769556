"""Key versions (issue 51): sealed headers and audit records name the key version, every local
provider (key files, keyring, the fake) holds several, a profile sealed before versions existed
opens as version 1, and the audit chain keeps verifying across a rotation and after the old
version is retired, while every way to rewrite it is still found."""
from __future__ import annotations

import base64
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from sfguard.supervisor.profiles import rotation, sealing
from sfguard.supervisor.profiles.audit import LocalAuditSink, canonical, head_mac, record_hash, record_mac
from sfguard.supervisor.profiles.key_versions import KeyStateError
from sfguard.supervisor.profiles.keys import FileKeyProvider, KeyringKeyProvider, KeyVersionMissing
from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.profiles.stores import Stores
from sfguard.supervisor.protocols import ProfileKey
from sfguard.supervisor.testing import FakeKeyProvider
from tests.profiles.test_keys import MemoryKeyring

LEGACY = Path(__file__).parent / "data" / "v1-legacy.sealed"   # sealed before key versions existed
LEGACY_KEY = bytes(range(32))


def providers(tmp_path):
    ring = MemoryKeyring()
    return {"file": (FileKeyProvider(tmp_path / "home"), None),
            "keyring": (KeyringKeyProvider(tmp_path / "home", backend=ring), ring),
            "fake": (FakeKeyProvider(), None)}


@pytest.mark.parametrize("kind", ["file", "keyring", "fake"])
def test_a_provider_holds_several_versions_and_retires_one(tmp_path, kind):
    (tmp_path / "home").mkdir(mode=0o700)
    kp, _ring = providers(tmp_path)[kind]
    one = kp.get_key("local")
    audit_one = kp.get_audit_key()
    assert kp.current_version() == 1 and kp.rotation() is None
    rot = kp.prepare_version(["local"])
    assert (rot.from_version, rot.to_version, rot.switched) == (1, 2, False)
    assert [(v.version, v.state) for v in kp.versions()] == [(1, "current"), (2, "prepared")]
    assert kp.current_key("local") == (1, one)          # prepared is not current yet
    assert kp.prepare_version(["local"]) == rot          # asked again: the same rotation
    kp.set_current(2)
    two = kp.get_key("local")
    assert two != one and kp.current_key("local") == (2, two)
    assert kp.get_key("local", create=False, version=1) == one       # the old one still reads
    assert kp.get_audit_key(version=2) not in (None, audit_one)
    assert [(v.version, v.state) for v in kp.versions()] == [(1, "old"), (2, "current")]
    assert kp.end_rotation(2) is True and kp.rotation() is None and kp.end_rotation(2) is False
    with pytest.raises(KeyStateError):
        kp.retire_version(2, ["local"])                  # never the current one
    kp.retire_version(1, ["local"])
    with pytest.raises(KeyVersionMissing, match="retired"):
        kp.get_key("local", create=False, version=1)
    assert kp.get_key("local") == two
    assert [(v.version, v.state, v.available) for v in kp.versions()] == [(1, "retired", False),
                                                                          (2, "current", True)]
    assert kp.delete_key("local") is True
    with pytest.raises(KeyVersionMissing):
        kp.get_key("local", create=False, version=3)      # never made


def test_the_keyring_names_each_version_apart(tmp_path):
    (tmp_path / "home").mkdir(mode=0o700)
    kp, ring = providers(tmp_path)["keyring"]
    kp.get_key("local")
    kp.prepare_version(["local"])
    users = sorted(u for _s, u in ring.data)
    tag = users[0].split(":")[0]
    assert users == sorted([f"{tag}:local", f"{tag}:v2:local", f"{tag}:v2:#audit-chain"])
    kp.set_current(2)
    kp.retire_version(1, ["local"])
    assert sorted(u for _s, u in ring.data) == [f"{tag}:v2:#audit-chain", f"{tag}:v2:local"]
    state = json.loads((tmp_path / "home" / "keys.json").read_text())
    assert state["current"] == 2 and not any(isinstance(v, str) and len(v) > 40 for v in
                                             json.dumps(state).split('"'))   # no key in the state


def test_file_versions_are_private_folders_and_files(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    kp = FileKeyProvider(home)
    kp.get_key("local")
    kp.prepare_version(["local"])
    folder = home / "keys" / "v2"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == ["audit.hmac", "local.key"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    assert stat.S_IMODE((home / "keys.json").stat().st_mode) == 0o600


def test_a_damaged_key_state_is_named_and_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "keys.json").write_text('{"current": 3, "versions": {"1": {}}}')
    with pytest.raises(KeyVersionMissing, match="keys.json is damaged"):
        FileKeyProvider(home).get_key("local")
    assert (home / "keys.json").read_text() == '{"current": 3, "versions": {"1": {}}}'   # kept


def legacy_home(tmp_path) -> tuple[Stores, ProfileKey]:
    """A home as format 1 left it: a profile sealed in SFGSEAL version 1, its key file."""
    home = tmp_path / "home"
    key = ProfileKey("local", "legacy")
    folder = home / "profiles" / "local" / "legacy"
    folder.mkdir(parents=True, mode=0o700)
    shutil.copy(LEGACY, folder / "profile.sealed")
    (home / "keys").mkdir(mode=0o700)
    (home / "keys" / "local.key").write_bytes(base64.b64encode(LEGACY_KEY) + b"\n")
    os.chmod(home / "keys" / "local.key", 0o600)
    keys = FileKeyProvider(home)
    stores = Stores("local", "local home", keys, LocalProfileStore(home, keys, runtime=tmp_path / "run"),
                    LocalProfileLease(home), LocalAuditSink(home, keys))
    return stores, key


def test_a_profile_sealed_before_key_versions_opens_as_version_1_and_rotates(tmp_path):
    stores, key = legacy_home(tmp_path)
    assert LEGACY.read_bytes()[:8] == b"SFGSEAL\x01"
    assert stores.store.key_version(key) == 1
    work = stores.store.open(key)
    assert (work / "Default" / "Cookies").read_bytes() == b"sid=sealed-before-key-versions"
    stores.store.close(key, save=False)
    report = rotation.rotate(stores)
    assert report["resealed"] == ["legacy"] and report["finished"]
    sealed = stores.store.home / "profiles" / "local" / "legacy" / "profile.sealed"
    assert sealed.read_bytes()[:8] == b"SFGSEAL\x02" and b'"kid":2' in sealed.read_bytes()[:300]
    assert LEGACY_KEY not in sealed.read_bytes()
    work = stores.store.open(key)
    assert (work / "Local State").read_text() == '{"written": "by format v1"}'
    stores.store.close(key, save=False)
    assert rotation.retire(stores, 1)["retired"]
    with pytest.raises(sealing.SealError):     # the old key is gone from the home
        sealing.unseal_to(LEGACY, tmp_path / "x", stores.keys.get_key("local"), "local", "legacy")
    assert stores.audit.verify().ok


@pytest.mark.parametrize("damage", ["flip", "cut", "other-key"])
def test_reseal_refuses_a_bad_file_and_leaves_the_target(tmp_path, damage):
    src = tmp_path / "in.sealed"
    data = LEGACY.read_bytes()
    src.write_bytes({"flip": data[:-40] + bytes([data[-40] ^ 1]) + data[-39:], "cut": data[:-100],
                     "other-key": data}[damage])
    target = tmp_path / "out.sealed"
    target.write_bytes(b"previous")
    old = bytes(32) if damage == "other-key" else LEGACY_KEY
    with pytest.raises(sealing.SealError):
        sealing.reseal(src, target, old, os.urandom(32), 2, "local", "legacy")
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.sealed", "out.sealed"]   # no temp left


# --------------------------------------------------------------------------- the audit chain

@pytest.fixture
def rotated(tmp_path):
    """A local home whose audit chain went through a rotation from version 1 to 2."""
    home = tmp_path / "home"
    keys = FileKeyProvider(home)
    stores = Stores("local", "local home", keys, LocalProfileStore(home, keys, runtime=tmp_path / "run"),
                    LocalProfileLease(home), LocalAuditSink(home, keys))
    for name in ("a", "b"):
        stores.store.create(ProfileKey("local", name))
        stores.audit.record("profile_created", scope="local", profile=name)
    rotation.rotate(stores)
    stores.audit.record("profile_leased", scope="local", profile="a", run="after")
    return stores


def lines(stores) -> list[tuple[Path, list[dict]]]:
    sink = stores.audit
    return [(p, [json.loads(x) for x in p.read_text().splitlines()]) for p in sink._files()]


def test_each_segment_is_keyed_by_one_version_and_the_tie_is_signed_by_both(rotated):
    (old_seg, old), (log, new) = lines(rotated)
    assert old_seg.parent.name == "audit.d" and log.name == "audit.log"
    assert {r.get("kid", 1) for r in old} == {1} and {r["kid"] for r in new} == {2}
    tie = new[0]
    assert tie["event"] == "key_rotated" and tie["fields"] == {"from_version": 1, "to_version": 2}
    assert tie["prev"] == old[-1]["hash"] and "mac_from" in tie
    assert rotated.audit.key_coverage() == {1: {"segments": 1, "records": len(old)},
                                            2: {"segments": 1, "records": len(new)}}
    assert json.loads(rotated.audit.head_path.read_text())["kid"] == 2
    assert str(rotated.audit.verify()).startswith("audit log intact")


def _forge_with(key: bytes, rec: dict) -> dict:
    rec.pop("mac", None)
    rec["hash"] = record_hash(rec)
    rec["mac"] = record_mac(key, rec)
    return rec


def _edit_old(stores, old, new):
    old[1]["fields"]["profile"] = "z"
    return old, new, None


def _edit_old_rehashed(stores, old, new):
    """An attacker with the leaked old key rewrites history before the rotation: the old
    segment verifies under key 1 again, but the tie (keyed by 2) no longer chains to it."""
    key1 = stores.keys.get_audit_key(version=1)
    old[1]["fields"]["profile"] = "z"
    prev = old[0]["hash"]
    for rec in old[1:]:
        rec["prev"] = prev
        prev = _forge_with(key1, rec)["hash"]
    return old, new, None


def _drop_tie(stores, old, new):
    return old, new[1:], None


def _append_with_old_key(stores, old, new):
    key1 = stores.keys.get_audit_key(version=1)
    rec = {"seq": new[-1]["seq"] + 1, "ts": 1.0, "event": "profile_deleted",
           "fields": {"profile": "a", "scope": "local", "by": "cli"}, "prev": new[-1]["hash"]}
    _forge_with(key1, rec)
    head = {"seq": rec["seq"], "hash": rec["hash"], "mac": head_mac(key1, rec["seq"], rec["hash"])}
    return old, [*new, rec], head


def _cut_back_to_before_the_rotation(stores, old, new):
    key1 = stores.keys.get_audit_key(version=1)
    last = old[-1]
    return old, [], {"seq": last["seq"], "hash": last["hash"], "mac": head_mac(key1, last["seq"], last["hash"])}


def _tie_without_old_mac(stores, old, new):
    key2 = stores.keys.get_audit_key(version=2)
    new[0]["mac_from"] = "0" * 64
    _forge_with(key2, new[0])
    prev = new[0]["hash"]
    for rec in new[1:]:
        rec["prev"] = prev
        prev = _forge_with(key2, rec)["hash"]
    last = new[-1]
    return old, new, {"seq": last["seq"], "hash": last["hash"], "kid": 2,
                      "mac": head_mac(key2, last["seq"], last["hash"])}


def _switch_without_tie(stores, old, new):
    key2 = stores.keys.get_audit_key(version=2)
    rec = new[1]
    rec["prev"] = old[-1]["hash"]
    rec["seq"] = old[-1]["seq"] + 1
    _forge_with(key2, rec)
    prev = rec["hash"]
    for i, r in enumerate(new[2:], 2):
        r["prev"], r["seq"] = prev, rec["seq"] + i - 1
        prev = _forge_with(key2, r)["hash"]
    last = new[-1]
    return old, new[1:], {"seq": last["seq"], "hash": last["hash"], "kid": 2,
                          "mac": head_mac(key2, last["seq"], last["hash"])}


TAMPER = {
    "an edited record before the rotation": (_edit_old, "edited"),
    "history rewritten with the leaked old key": (_edit_old_rehashed, "does not chain"),
    "the key_rotated record removed": (_drop_tie, "sequence number"),
    "a record appended with the old key": (_append_with_old_key, "keyed by key version 1 after"),
    "the log cut back to before the rotation": (_cut_back_to_before_the_rotation, "version 2 is current"),
    "the tie without the old key's MAC": (_tie_without_old_mac, "MAC by key version 1"),
    "a version change without a key_rotated record": (_switch_without_tie, "without a key_rotated record"),
}


#: the rewrites that need no old key can also be tried after the old version was retired
WITHOUT_OLD_KEY = ("an edited record before the rotation", "the key_rotated record removed",
                   "a version change without a key_rotated record")


CASES = [(c, False) for c in TAMPER] + [(c, True) for c in WITHOUT_OLD_KEY]


@pytest.mark.parametrize("case,retire_first", CASES,
                         ids=[f"{c}, old key {'retired' if r else 'held'}" for c, r in CASES])
def test_every_rewrite_across_a_rotation_is_found(rotated, case, retire_first):
    tamper, why = TAMPER[case]
    (old_seg, old), (log, new) = lines(rotated)
    if retire_first:
        assert rotation.retire(rotated, 1)["retired"]
        assert rotated.audit.verify().ok                  # retired: the chain still verifies
        (old_seg, old), (log, new) = lines(rotated)
    old, new, head = tamper(rotated, old, new)
    old_seg.write_bytes(b"".join(canonical(r) + b"\n" for r in old))
    log.write_bytes(b"".join(canonical(r) + b"\n" for r in new))
    if head is not None:
        rotated.audit.head_path.write_bytes(canonical(head))
    result = rotated.audit.verify()
    assert not result.ok and why in str(result), str(result)


def test_the_current_key_deleted_by_hand_is_found(rotated):
    """The retired version's records are covered by the tie; without the current key nothing
    covers them (and the head cannot be checked)."""
    rotated.keys.retire_version(1, ["local"])
    assert LocalAuditSink(rotated.audit.home, rotated.keys, read_only=True).verify().ok
    rotated.keys._drop_material(2, ["local"])     # the current version's keys deleted by hand
    result = LocalAuditSink(rotated.audit.home, rotated.keys, read_only=True).verify()
    assert not result.ok and "version 2" in str(result), str(result)


def test_an_archive_anchor_keyed_by_a_retired_version_is_keyed_again(tmp_path):
    """audit archive under version 1, a rotation, then retiring version 1: the anchor is keyed
    again under version 2 first, so the kept chain still verifies from where it starts."""
    home = tmp_path / "home"
    keys = FileKeyProvider(home)
    sink = LocalAuditSink(home, keys, segment_bytes=600)
    stores = Stores("local", "local home", keys, LocalProfileStore(home, keys, runtime=tmp_path / "run"),
                    LocalProfileLease(home), sink)
    stores.store.create(ProfileKey("local", "shop"))
    for i in range(8):
        sink.record("profile_leased", scope="local", profile="shop", run=f"run-{i}")
    segments = sink.segments()
    assert len(segments) >= 3
    sink.archive(int(segments[2].name[:12]), tmp_path / "cold")
    assert "kid" not in json.loads((home / "audit.anchor").read_text())
    rotation.rotate(stores)
    assert rotation.retire(stores, 1)["retired"]
    assert json.loads((home / "audit.anchor").read_text())["kid"] == 2
    result = LocalAuditSink(home, keys, read_only=True).verify()
    assert result.ok, str(result)
    (home / "audit.anchor").write_text((home / "audit.anchor").read_text().replace('"kid":2', '"kid":1'))
    assert not LocalAuditSink(home, keys, read_only=True).verify().ok
