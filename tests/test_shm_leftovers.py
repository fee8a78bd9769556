"""The leftover check of tests/conftest.py finds a bridge folder of a home inside the test's own
folder, and nothing of homes elsewhere (other test sessions on this machine)."""
from __future__ import annotations

import shutil

import pytest

from sfguard.supervisor.home import runtime_path
from sfguard.supervisor.stage.stage_bridge import bridge_root_for
from tests.shm_leftovers import bases, left_by


@pytest.mark.parametrize("where", ["home", "h", "a/b/home"])
def test_a_bridge_folder_of_a_home_in_tmp_path_is_found_and_only_it(tmp_path, where):
    home = tmp_path / where
    home.mkdir(parents=True)
    root = bridge_root_for(runtime_path(home))
    assert root.parent in bases()
    other = tmp_path.parent / (tmp_path.name + "-elsewhere") / "home"    # not under tmp_path
    other_root = bridge_root_for(runtime_path(other))
    root.mkdir(mode=0o700)
    other_root.mkdir(mode=0o700)
    try:
        assert left_by(tmp_path) == [root]
        assert left_by(tmp_path, ("sfg",)) == []
    finally:
        shutil.rmtree(root)
        other_root.rmdir()
    assert left_by(tmp_path) == []
