"""Live edits keep the last good policy; the public suffix check works without publicsuffix2."""
from __future__ import annotations

import ipaddress
import os
import sys

import pytest

from sfguard.policy import PolicyError, PolicyWatcher, parse_policy
from sfguard.policy import patterns as patterns_mod

GOOD = 'version: 1\nallow_always: ["*.example.com"]\n'


def _write(path, text, bump):
    path.write_text(text)
    st = os.stat(path)  # make the change visible even within one mtime tick
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump))


def test_watcher_reloads_valid_edits_and_keeps_the_last_good_policy(tmp_path):
    path = tmp_path / "sites.yaml"
    _write(path, GOOD, 0)
    watcher = PolicyWatcher(path)
    assert watcher.check() is False  # unchanged
    assert watcher.policy.decide("a.example.com", 443).reason == "allowed_by_policy"

    _write(path, GOOD + "alow: 1\n", 1_000_000)
    assert watcher.check() is False
    assert watcher.error is not None and "unknown key 'alow'" in str(watcher.error)
    assert watcher.policy.decide("a.example.com", 443).reason == "allowed_by_policy"  # still in force
    assert watcher.generation == 1

    _write(path, 'version: 1\nallow_always: ["*.example.org"]\n', 2_000_000)
    assert watcher.check() is True
    assert (watcher.error, watcher.generation) == (None, 2)
    assert watcher.policy.decide("a.example.com", 443).reason == "not_allowed"
    assert watcher.policy.decide("a.example.org", 443).reason == "allowed_by_policy"

    path.unlink()
    assert watcher.check() is False and "cannot read" in str(watcher.error)
    assert watcher.policy.decide("a.example.org", 443).reason == "allowed_by_policy"


def test_watcher_refuses_to_start_on_a_bad_file(tmp_path):
    path = tmp_path / "sites.yaml"
    path.write_text("version: 2\n")
    with pytest.raises(PolicyError):
        PolicyWatcher(path)


def test_builtin_public_suffixes_without_publicsuffix2(monkeypatch):
    monkeypatch.setitem(sys.modules, "publicsuffix2", None)  # import fails
    table = patterns_mod._PublicSuffixes()
    assert table.source == "built-in list"
    assert table.section("com") == "icann"
    assert table.section("co.uk") == "icann"
    assert table.section("github.io") == "private"
    assert table.section("example.com") is None


def test_bundled_public_suffix_list_is_used_offline():
    assert patterns_mod.public_suffix_source().endswith("public_suffix_list.dat")


def test_check_address_accepts_ip_objects():
    site = parse_policy(GOOD, "sites.yaml")
    allowed = site.decide("a.example.com", 443)
    assert site.check_address(allowed, ipaddress.ip_address("10.0.0.1")).reason == "private_address"
    assert site.check_address(allowed, ipaddress.ip_address("93.184.216.34")) is allowed
