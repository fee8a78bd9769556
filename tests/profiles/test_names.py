"""Profile names and pipeline identities, table-driven."""
from __future__ import annotations

import os

import pytest

from sfguard.supervisor.profiles.local_store import normalise_pipeline_path, pipeline_profile_name
from sfguard.supervisor.protocols import ProfileKey, ProfileNameError, validate_name

VALID = ["a", "0", "shop", "my-shop_2", "a" * 64, "pipeline-0123456789abcdef", "9lives", "x-", "x_"]
INVALID = [
    ("", "empty"), ("..", "dot-dot"), (".", "dot"), ("../etc", "parent path"), ("a/b", "slash"),
    ("/abs", "absolute"), ("/", "root"), ("a\0b", "NUL"), ("Shop", "uppercase"),
    ("shop\n", "trailing newline"), (" shop", "leading space"), ("-shop", "leading dash"),
    ("_shop", "leading underscore"), ("a" * 65, "65 chars"), ("shоp", "Cyrillic o"),
    ("аbc", "Cyrillic a"), ("ｓｈｏｐ", "fullwidth"), ("shop.com", "dot inside"),
    ("a\\b", "backslash"), ("é", "accented"), ("a:b", "colon"), ("١٢٣", "Arabic digits"),
]


@pytest.mark.parametrize("name", VALID)
def test_valid_names(name):
    assert validate_name(name) == name
    assert ProfileKey("local", name).name == name


@pytest.mark.parametrize("name,why", INVALID, ids=[w for _, w in INVALID])
def test_invalid_names_refused_with_clear_error(name, why):
    with pytest.raises(ProfileNameError) as err:
        ProfileKey("local", name)
    msg = str(err.value)
    assert "invalid profile name" in msg and "never a path" in msg
    assert "\0" not in msg and "\n" not in msg


@pytest.mark.parametrize("scope", ["", "../x", "A", "a/b"])
def test_invalid_scopes_refused(scope):
    with pytest.raises(ProfileNameError, match="invalid scope"):
        ProfileKey(scope, "shop")


def test_non_string_refused():
    with pytest.raises(ProfileNameError, match="must be a string"):
        validate_name(5)


def test_pipeline_identity_is_stable_and_normalised(tmp_path, monkeypatch):
    p = tmp_path / "flows" / "daily.yaml"
    p.parent.mkdir()
    p.write_text("x")
    link = tmp_path / "link.yaml"
    link.symlink_to(p)
    monkeypatch.chdir(tmp_path)
    forms = [p, str(p), "flows/daily.yaml", "./flows/../flows/daily.yaml", link,
             str(tmp_path) + "//flows/./daily.yaml"]
    names = {pipeline_profile_name(f) for f in forms}
    assert len(names) == 1
    name = names.pop()
    import hashlib
    expected = hashlib.sha256(b"workflow\0" + os.fsencode(os.path.realpath(p))).hexdigest()[:16]
    assert name == f"pipeline-{expected}"
    assert normalise_pipeline_path("flows/daily.yaml") == os.path.realpath(p)
    validate_name(name)


def test_two_pipelines_never_share(tmp_path):
    names = {pipeline_profile_name(tmp_path / f"p{i}.yaml") for i in range(200)}
    assert len(names) == 200
