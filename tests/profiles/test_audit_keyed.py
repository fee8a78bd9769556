"""The keyed audit chain (issue 14): a rewrite without the key is detected, a deleted or
emptied log is detected when the home shows records existed, and logs made before the key
still verify with the plain hash chain."""
from __future__ import annotations

import json
import time

import pytest

from sfguard.supervisor.profiles.audit import GENESIS, LocalAuditSink, canonical, record_hash
from sfguard.supervisor.profiles.keys import FileKeyProvider
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.protocols import ProfileKey
from tests.profiles.conftest import sfguard


def fill(sink, n=5):
    for i in range(n):
        sink.record("profile_leased", scope="local", profile="shop", run=f"run-{i}")


def rewrite_without_key(sink, edit, keep_mac: bool = False):
    """What an attacker without the key can do: edit records, recompute every hash and link,
    write a matching head. `keep_mac`: leave the old MAC fields in place."""
    recs = [json.loads(x) for x in sink.log_path.read_text().splitlines()]
    recs = edit(recs)
    prev = GENESIS
    for i, rec in enumerate(recs, 1):
        rec["seq"], rec["prev"] = i, prev
        if not keep_mac:
            rec.pop("mac", None)
        rec["hash"] = record_hash(rec)
        prev = rec["hash"]
    sink.log_path.write_bytes(b"".join(canonical(r) + b"\n" for r in recs))
    sink.head_path.write_bytes(canonical({"seq": len(recs), "hash": prev}))


def _change_run(recs):
    recs[1]["fields"]["run"] = "run-evil"
    return recs


def _drop_one(recs):
    del recs[2]
    return recs


def _drop_tail(recs):
    return recs[:2]


REWRITES = {"edit": _change_run, "delete": _drop_one, "truncate": _drop_tail}


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture
def sink(home):
    s = LocalAuditSink(home, FileKeyProvider(home))
    fill(s)
    return s


def test_records_and_head_carry_macs_and_verify(sink):
    recs = [json.loads(x) for x in sink.log_path.read_text().splitlines()]
    assert all(len(r["mac"]) == 64 for r in recs)
    assert "mac" in json.loads(sink.head_path.read_text())
    key_file = sink.home / "keys" / "audit.hmac"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert sink.verify().ok


@pytest.mark.parametrize("how", sorted(REWRITES))
@pytest.mark.parametrize("keep_mac", [False, True], ids=["macs-dropped", "macs-kept"])
def test_full_rewrite_without_the_key_is_detected(sink, how, keep_mac):
    rewrite_without_key(sink, REWRITES[how], keep_mac)
    r = LocalAuditSink(sink.home, FileKeyProvider(sink.home)).verify()
    assert not r.ok, str(r)
    assert "audit key" in r.reason
    proc = sfguard("audit", "verify", home=sink.home)
    assert proc.returncode == 1 and "audit key" in proc.stderr


def test_rewrite_with_another_key_is_detected(sink, tmp_path):
    other = LocalAuditSink(tmp_path / "other", FileKeyProvider(tmp_path / "other"))
    fill(other)
    sink.log_path.write_bytes(other.log_path.read_bytes())
    sink.head_path.write_bytes(other.head_path.read_bytes())
    r = sink.verify()
    assert not r.ok and "MAC" in r.reason


# (what is removed, evidence in the home) -> verify must fail
@pytest.mark.parametrize("remove", ["both-deleted", "log-emptied-head-deleted"])
@pytest.mark.parametrize("evidence", ["sealed-profile", "audit-key"])
def test_missing_or_emptied_log_is_detected(home, remove, evidence):
    keys = FileKeyProvider(home)
    if evidence == "sealed-profile":
        LocalProfileStore(home, keys, runtime=home / "rt").create(ProfileKey("local", "shop"))
    else:
        fill(LocalAuditSink(home, keys))
    sink = LocalAuditSink(home, keys)
    if remove == "both-deleted":
        sink.log_path.unlink(missing_ok=True)
    else:
        sink.log_path.write_bytes(b"")
    sink.head_path.unlink(missing_ok=True)
    r = LocalAuditSink(home, FileKeyProvider(home)).verify()
    assert not r.ok and "missing or empty" in r.reason, str(r)
    proc = sfguard("audit", "verify", home=home)
    assert proc.returncode == 1 and "missing or empty" in proc.stderr
    assert "intact" not in proc.stdout


def test_fresh_home_is_intact_with_zero_records(home):
    r = LocalAuditSink(home, FileKeyProvider(home)).verify()
    assert r.ok and r.records == 0
    proc = sfguard("audit", "verify", home=home)
    assert proc.returncode == 0 and "0 record(s)" in proc.stdout


def _legacy_log(home, n=3):
    """A log as written before the key existed: plain hash chain, head without a MAC."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    prev, lines = GENESIS, []
    for i in range(1, n + 1):
        rec = {"seq": i, "ts": time.time() - 60 + i, "event": "profile_leased",
               "fields": {"profile": "shop", "run": f"run-{i}", "scope": "local"}, "prev": prev}
        rec["hash"] = prev = record_hash(rec)
        lines.append(canonical(rec) + b"\n")
    (home / "audit.log").write_bytes(b"".join(lines))
    (home / "audit.head").write_bytes(canonical({"seq": n, "hash": prev}))


def test_legacy_log_still_verifies_and_continues_keyed(home):
    _legacy_log(home)
    sink = LocalAuditSink(home, FileKeyProvider(home))
    r = sink.verify()
    assert r.ok and r.records == 3
    sink.record("profile_released", scope="local", profile="shop", run="run-3")
    r = LocalAuditSink(home, FileKeyProvider(home)).verify()
    assert r.ok and r.records == 4, str(r)
    recs = [json.loads(x) for x in sink.log_path.read_text().splitlines()]
    assert ["mac" in x for x in recs] == [False, False, False, True]


def test_legacy_log_edit_is_still_detected(home):
    _legacy_log(home)
    path = home / "audit.log"
    path.write_text(path.read_text().replace("run-2", "run-X"))
    assert not LocalAuditSink(home, FileKeyProvider(home)).verify().ok


def test_downgrade_to_an_unkeyed_log_is_detected(sink):
    # Rewriting a keyed log into the old unkeyed format: the key shows keyed records existed.
    rewrite_without_key(sink, lambda recs: recs)
    r = sink.verify()
    assert not r.ok and "no record is keyed" in r.reason


def test_deleted_audit_key_is_detected(sink):
    (sink.home / "keys" / "audit.hmac").unlink()
    r = LocalAuditSink(sink.home, FileKeyProvider(sink.home)).verify()
    assert not r.ok and "audit key is missing" in r.reason
