"""`sfguard COMMAND` imports only that command's module: a stage's `sfguard stage-exec` or a
reviewer's `sfguard policy explain` must not pay for mitmproxy, aiohttp or psycopg start-up."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("mitmproxy", "aiohttp", "psycopg")
PROBE = """
import json, sys
from sfguard.cli.main import build_parser
try:
    build_parser(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


@pytest.mark.parametrize("argv", [["policy"], ["stage-exec"], ["status"], ["validate"], ["audit"],
                                  ["doctor"], ["sweep"], ["profiles"], ["keys"], ["--version"]])
def test_a_command_loads_only_its_own_module(argv):
    r = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], argv


def test_the_proxy_command_does_load_mitmproxy():
    """The probe can see a heavy import (so the cases above can fail)."""
    r = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), "proxy"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "mitmproxy" in json.loads(r.stdout.strip().splitlines()[-1])
