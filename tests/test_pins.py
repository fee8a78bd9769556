"""The proxy reaches into mitmproxy's and h11's private names (docs/proxy.md), so the package
declares exactly the versions the suite runs on: pyproject's pins equal requirements.lock's
and what is installed."""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mitmproxy_and_h11_are_pinned_to_the_tested_versions():
    pyproject = (ROOT / "pyproject.toml").read_text()
    lock = (ROOT / "requirements.lock").read_text()
    for name in ("mitmproxy", "h11"):
        pinned = re.search(rf'^\s*"{name}==([0-9.]+)"', pyproject, re.M)
        assert pinned, f"pyproject.toml must pin {name} exactly"
        locked = re.search(rf"^{name}==([0-9.]+)$", lock, re.M)
        assert locked and locked.group(1) == pinned.group(1), name
        assert importlib.metadata.version(name) == pinned.group(1), name
