"""The decision log's file: a regular file is made private (0600); a device given as the path
(a twin of /dev/null here) keeps its mode, so a proxy pointed at one never breaks it for every
other program on the host (it once made /dev/null 0600)."""
from __future__ import annotations

import os
import stat

import pytest

from sfguard.proxy_addons.decision_log import DecisionLog


def test_a_regular_file_is_made_private(tmp_path):
    path = tmp_path / "decisions.log"
    path.write_text("")
    path.chmod(0o644)
    DecisionLog(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_keeps_its_mode(tmp_path):
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    null.chmod(0o666)     # whatever the umask took away
    DecisionLog(str(null))
    st = null.stat()
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
