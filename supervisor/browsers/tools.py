"""Finding the external tools: agent-browser and a Chromium-family browser.

agent-browser: $SFGUARD_AGENT_BROWSER, else the project's pinned install
(node_modules/agent-browser, its native binary), else `agent-browser` on PATH.
Browser: $SFGUARD_BROWSER, else chromium, chromium-browser, google-chrome or chrome on PATH.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The checkout (supervisor/browsers/tools.py -> the repository); an installed wheel has no
# node_modules beside it and finds agent-browser on PATH instead.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
AGENT_BROWSER_VERSION = "0.41.2"


@dataclass(frozen=True)
class Tool:
    name: str
    path: str | None
    version: str | None
    source: str  # where it was found, or why not
    hint: str = ""

    @property
    def found(self) -> bool:
        return self.path is not None

    def describe(self) -> str:
        """Its version and path, or MISSING with where it was looked for and what to do."""
        return f"{self.version} at {self.path}" if self.found else f"MISSING ({self.source}; {self.hint})"


def _native_binary_name() -> str:
    machine = platform.machine().lower()
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)
    return f"agent-browser-linux-{arch}"


def _version(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20,
                             env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                  "HOME": os.environ.get("HOME", "/")})
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0].strip() if out.returncode == 0 and text else None


def find_agent_browser() -> Tool:
    hint = "run ./dev setup (installs agent-browser 0.41.2 from package-lock.json into node_modules)"
    env_path = os.environ.get("SFGUARD_AGENT_BROWSER")
    candidates: list[tuple[str, str]] = []
    if env_path:
        candidates.append((env_path, "SFGUARD_AGENT_BROWSER"))
    else:
        local = PROJECT_ROOT / "node_modules" / "agent-browser" / "bin" / _native_binary_name()
        candidates.append((str(local), "project install"))
        on_path = shutil.which("agent-browser")
        if on_path:
            candidates.append((on_path, "PATH"))
    for path, source in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            version = _version([path, "--version"])
            return Tool("agent-browser", str(Path(path).absolute()), version, source, hint)
    where = env_path or "node_modules or PATH"
    return Tool("agent-browser", None, None, f"not found in {where}", hint)


def find_browser() -> Tool:
    hint = "install Chromium (Debian: apt-get install chromium) or set SFGUARD_BROWSER"
    env_path = os.environ.get("SFGUARD_BROWSER")
    names = (env_path,) if env_path else BROWSER_NAMES
    for name in names:
        path = shutil.which(name) if name else None
        if path:
            version = _version([path, "--version"])
            return Tool("browser", path, version, "SFGUARD_BROWSER" if env_path else "PATH", hint)
    return Tool("browser", None, None, f"not found ({env_path or ', '.join(BROWSER_NAMES)})", hint)


def display_available() -> str | None:
    """The display variable that is set (DISPLAY or WAYLAND_DISPLAY), or None."""
    for var in ("DISPLAY", "WAYLAND_DISPLAY"):
        if os.environ.get(var):
            return var
    return None


def in_container() -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        cg = Path("/proc/1/cgroup").read_text()
    except OSError:
        return False
    return any(k in cg for k in ("docker", "kubepods", "containerd", "lxc"))
