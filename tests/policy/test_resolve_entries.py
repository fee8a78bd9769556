"""`--resolve HOST=IP[,IP...]`: one parser (policy.parse_resolve) for `sfguard start`,
`sfguard proxy` and the run proxies, and the same refusals from each command."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sfguard import policy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("items, want", [
    (["a.test=127.0.0.1"], {"a.test": ["127.0.0.1"]}),
    (["A.Test.=127.0.0.1,::1"], {"a.test": ["127.0.0.1", "::1"]}),
    (["a.test=[::1]", "a.test=10.0.0.1"], {"a.test": ["::1", "10.0.0.1"]}),
    (["bücher.de=192.0.2.1"], {"xn--bcher-kva.de": ["192.0.2.1"]}),
])
def test_entries_are_normalised(items, want):
    assert policy.parse_resolve(items) == want


@pytest.mark.parametrize("item, fault", [
    ("a.test", "expected HOST=IP"),
    ("=127.0.0.1", "expected HOST=IP"),
    ("a.test=", "expected HOST=IP"),
    ("a.test=localhost", "is not an IP address"),
    ("a.test=127.0.0.1,0x7f.1", "is not an IP address"),
    ("a b.test=127.0.0.1", "'a b.test=127.0.0.1'"),
])
def test_bad_entries_are_refused_by_every_command(tmp_path, item, fault):
    with pytest.raises(ValueError, match=fault.replace("(", r"\(")):
        policy.parse_resolve([item])
    for argv in (["start", "--home", str(tmp_path / "home")], ["proxy", "--allow", "a.test"]):
        r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *argv, "--resolve", item], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (argv, r.stderr)
        assert "--resolve" in r.stderr and fault in r.stderr, (argv, r.stderr)
    assert not (tmp_path / "home" / "guard.pid").exists()
