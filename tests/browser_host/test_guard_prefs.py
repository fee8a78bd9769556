"""The guard's preferences in every profile before its browser starts (chromium.set_guard_prefs):
the password manager and preloading off, other preferences kept, written atomically, no symlink followed."""
from __future__ import annotations

import json
import os

import pytest

from sfguard.supervisor.browsers.chromium import set_guard_prefs


def prefs(profile) -> dict:
    return json.loads((profile / "Default" / "Preferences").read_text())


def test_a_new_profile_gets_the_password_manager_and_preloading_off(tmp_path):
    set_guard_prefs(tmp_path)
    assert prefs(tmp_path) == {"credentials_enable_service": False, "profile": {"password_manager_enabled": False},
                               "net": {"network_prediction_options": 2}}
    assert oct((tmp_path / "Default" / "Preferences").stat().st_mode & 0o777) == "0o600"


def test_existing_preferences_are_kept(tmp_path):
    (tmp_path / "Default").mkdir()
    (tmp_path / "Default" / "Preferences").write_text(json.dumps(
        {"credentials_enable_service": True, "profile": {"name": "Person", "password_manager_enabled": True},
         "intl": {"accept_languages": "de"}, "net": {"network_prediction_options": 0, "other": 1}}))
    set_guard_prefs(tmp_path)
    got = prefs(tmp_path)
    assert got["net"] == {"network_prediction_options": 2, "other": 1}     # preloading turned off again
    assert got["credentials_enable_service"] is False and got["profile"] == {"name": "Person",
                                                                           "password_manager_enabled": False}
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
