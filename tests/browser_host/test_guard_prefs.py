"""The guard's preferences in every profile before its browser starts (chromium.set_guard_prefs):
the password manager and preloading off, no page of the browser's own choosing at start (no
session restore, no start-up pages, a clean last exit, developer mode off), a saved session
removed, what the profile carried said; other preferences kept, written atomically, no symlink
followed."""
from __future__ import annotations

import json
import os

import pytest

from sfguard.supervisor.browsers.chromium import set_guard_prefs


def prefs(profile) -> dict:
    return json.loads((profile / "Default" / "Preferences").read_text())


GUARDED = {"credentials_enable_service": False,
           "profile": {"password_manager_enabled": False, "exit_type": "Normal", "exited_cleanly": True},
           "net": {"network_prediction_options": 2}, "session": {"restore_on_startup": 5, "startup_urls": []},
           "extensions": {"ui": {"developer_mode": False}}}


def test_a_new_profile_gets_the_guards_preferences(tmp_path):
    assert set_guard_prefs(tmp_path) == []
    assert prefs(tmp_path) == GUARDED
    assert oct((tmp_path / "Default" / "Preferences").stat().st_mode & 0o777) == "0o600"
    assert set_guard_prefs(tmp_path) == []          # the second time: nothing to change


def test_what_would_run_before_the_guard_is_removed_and_said(tmp_path):
    d = tmp_path / "Default"
    (d / "Sessions").mkdir(parents=True)
    (d / "Sessions" / "Session_1").write_bytes(b"SNSS")
    (d / "Current Session").write_bytes(b"SNSS")
    (d / "Preferences").write_text(json.dumps({
        "session": {"restore_on_startup": 1, "startup_urls": ["http://a.test/", "http://b.test/"]},
        "profile": {"exit_type": "Crashed", "exited_cleanly": False, "name": "P"},
        "extensions": {"settings": {"abcdefghijklmnopabcdefghijklmnop": {"location": 4, "path": "/x"},
                                    "mhjfbmdgcfjbbpaeojofohoefgiehjai": {"location": 5}},
                       "ui": {"developer_mode": True}}}))
    carried = set_guard_prefs(tmp_path)
    assert carried == ["saved session (Current Session)", "saved session (Sessions)",
                       "session.restore_on_startup=1", "session.startup_urls (2)",
                       "profile.exit_type (a crash: pages to restore)", "extensions (1, never loaded)",
                       "extensions.ui.developer_mode"]
    got = prefs(tmp_path)
    assert got["session"] == {"restore_on_startup": 5, "startup_urls": []}
    assert got["profile"] == {"exit_type": "Normal", "exited_cleanly": True, "name": "P",
                              "password_manager_enabled": False}
    assert got["extensions"]["ui"] == {"developer_mode": False}
    assert sorted(p.name for p in d.iterdir()) == ["Preferences"]


def test_existing_preferences_are_kept(tmp_path):
    (tmp_path / "Default").mkdir()
    (tmp_path / "Default" / "Preferences").write_text(json.dumps(
        {"credentials_enable_service": True, "profile": {"name": "Person", "password_manager_enabled": True},
         "intl": {"accept_languages": "de"}, "net": {"network_prediction_options": 0, "other": 1}}))
    set_guard_prefs(tmp_path)
    got = prefs(tmp_path)
    assert got["net"] == {"network_prediction_options": 2, "other": 1}     # preloading turned off again
    assert got["credentials_enable_service"] is False and got["profile"] == {
        "name": "Person", "password_manager_enabled": False, "exit_type": "Normal", "exited_cleanly": True}
    assert got["intl"] == {"accept_languages": "de"}
    assert [p.name for p in (tmp_path / "Default").iterdir()] == ["Preferences"]   # no temp left


@pytest.mark.parametrize("planted", ["Default", "Preferences"])
def test_a_planted_symlink_is_not_followed(tmp_path, planted):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "Preferences").write_text("{}")
    profile = tmp_path / "profile"
    profile.mkdir()
    if planted == "Default":
        (profile / "Default").symlink_to(outside)
    else:
        (profile / "Default").mkdir()
        (profile / "Default" / "Preferences").symlink_to(outside / "Preferences")
    with pytest.raises(OSError):
        set_guard_prefs(profile)
    assert (outside / "Preferences").read_text() == "{}"
    assert sorted(os.listdir(outside)) == ["Preferences"]
