"""A guard that is refused before it starts, and `sfguard sweep` on a home with no guard, leave no
runtime folder (`/dev/shm/sfg-...`) and no bridge folder behind (issue 11): the runtime folder is
named when the guard is built and made only when it starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sfguard.supervisor.home import ensure_home, runtime_path
from tests.daemon.conftest import ROOT
from tests.shm_leftovers import left_by

CASES = [
    # (name, argv after `sfguard`, expected exit code, a phrase of the error)
    ("token file without --tcp", ["start", "--token-file", "{tmp}/token"], 2, "--token-file needs --tcp"),
    ("unknown api group", ["start", "--api-group", "sfguard-no-such-group"], 2, "--api-group"),
    ("bad console address", ["start", "--console", "not an address"], 2, ""),
    ("sweep with no guard", ["sweep", "--json"], 0, ""),
]


@pytest.mark.parametrize("name,argv,code,phrase", CASES, ids=[c[0] for c in CASES])
def test_a_guard_refused_before_start_or_a_sweep_leaves_no_runtime_folder(tmp_path, name, argv, code, phrase):
    home = ensure_home(tmp_path / "home")      # an existing home (sweep needs one)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFGUARD_")}
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args[:1], "--home", str(home), *args[1:]],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert phrase in r.stderr
    assert not runtime_path(home).exists()
    assert left_by(tmp_path, ("sfb", "sfg")) == []
