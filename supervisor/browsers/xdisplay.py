"""A visible browser window on an X display: the window's title, and a root guard's grant.

A guard running as an ordinary desktop user starts its headed browsers as that user: they
inherit DISPLAY and XAUTHORITY and open the window like any program of the session.

A guard running as root starts its browsers as the browser user (browser_user.py), who has
no right to the display. The guard then hands that one browser the X authority of that one
display, and nothing else:

    <browser HOME>/Xauthority    <browser user> 0600   the cookie of DISPLAY only (xauth extract)

XAUTHORITY points at it; the browser's HOME is removed when the browser ends, and the file
with it (`revoke` removes it first, explicitly). Never `xhost +`, never the guard user's own
X authority file (it may hold cookies of other displays). An MIT-MAGIC-COOKIE-1 cookie cannot
be withdrawn from the X server without ending the session: while the display lives, a copy
taken by the browser user while it ran would still open it (docs/threat-model.md).

Before the browser starts, `probe` opens the display as the browser's user with the
browser's environment (`xdpyinfo`), so that a display it cannot open is refused with a clear
message instead of a browser that exits during start.
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from sfguard.errors import SfguardError
from sfguard.supervisor.browsers.browser_user import BrowserUser

#: The grant file's name inside the browser's own HOME.
GRANT_NAME = "Xauthority"
PROBE_TIMEOUT = 10.0
_DISPLAY = re.compile(r"^(?:unix)?:\d{1,5}(?:\.\d{1,3})?$")
_TITLE_BAD = re.compile(r"[\x00-\x1f\x7f]")


class DisplayError(SfguardError):
    """The display cannot be used by the browser (no grant possible, or it cannot open it).
    The message names the display and what to do; never a cookie."""


def window_title(profile: str | None, site: str | None = None) -> str:
    """The title of a visible browser window: who shows it, which profile, which site."""
    parts = ["sfguard"]
    if site:
        parts.append(f"log in to {site}")
    parts.append(f"profile {profile}" if profile else "throw-away browser")
    return _TITLE_BAD.sub(" ", " - ".join(parts))[:200]


def local_display(env: dict[str, str] | None = None) -> str | None:
    """DISPLAY when it names a display of this machine (`:N`, `:N.S`, `unix:N`); None when it
    is unset. A remote display (`host:N`, X over TCP) is refused with DisplayError: its cookie
    would travel and the window would not be on this machine."""
    src = os.environ if env is None else env
    display = src.get("DISPLAY")
    if not display:
        return None
    if not _DISPLAY.match(display):
        raise DisplayError(f"DISPLAY={display!r} is not a display of this machine (:N); a root "
                           "guard grants its browsers only a local display")
    return display


def grant(display: str, user: BrowserUser, home: Path, source: str | None = None) -> Path:
    """Write the cookie of `display` alone, taken from the guard's X authority (`source`,
    default $XAUTHORITY or ~/.Xauthority), into `home`/Xauthority, 0600 and owned by `user`.
    DisplayError when xauth is missing or holds no cookie for the display."""
    xauth = shutil.which("xauth")
    if xauth is None:
        raise DisplayError("xauth is not installed: a root guard needs it to give its browser "
                           f"access to {display} (Debian: apt-get install xauth)")
    src = source or os.environ.get("XAUTHORITY") or os.path.expanduser("~/.Xauthority")
    try:
        cookie = subprocess.run([xauth, "-q", "-f", src, "nextract", "-", display],
                                capture_output=True, timeout=PROBE_TIMEOUT, check=False,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.TimeoutExpired):
        raise DisplayError(f"xauth could not read the guard's X authority for {display}") from None
    if cookie.returncode != 0 or not cookie.stdout.strip():
        raise DisplayError(f"the guard's X authority holds no cookie for {display}: the guard "
                           "itself cannot open it (set XAUTHORITY to the session's file)")
    path = Path(home) / GRANT_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    granted = False
    try:
        merged = subprocess.run([xauth, "-q", "-f", str(path), "nmerge", "-"], input=cookie.stdout,
                                capture_output=True, timeout=PROBE_TIMEOUT, check=False,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        if merged.returncode != 0:
            raise DisplayError(f"xauth could not write the browser's grant for {display}")
        # xauth writes a new file and renames it over: set owner and mode on what is there now
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
        os.chmod(path, 0o600, follow_symlinks=False)
        granted = True
    finally:
        if not granted:
            revoke(path)
    return path


def revoke(path: Path | None) -> None:
    """Remove a grant file (the browser ended)."""
    if path is None:
        return
    for p in (Path(path), Path(f"{path}-c"), Path(f"{path}-l")):   # xauth's lock files
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def probe(env: dict[str, str], user: BrowserUser | None) -> None:
    """Open env's DISPLAY as `user` (None: this process's user) with env's XAUTHORITY, as the
    browser would. DisplayError when it is refused; nothing when xdpyinfo is not installed
    (the browser's own start then fails instead)."""
    tool = shutil.which("xdpyinfo")
    display = env.get("DISPLAY")
    if tool is None or not display:
        return
    keep = {k: env[k] for k in ("PATH", "HOME", "DISPLAY", "XAUTHORITY") if env.get(k)}
    keep.setdefault("PATH", "/usr/bin:/bin")
    if user is not None and "XAUTHORITY" not in keep:   # the grant or nothing, never a default file
        keep["XAUTHORITY"] = os.devnull
    try:
        res = subprocess.run([tool, "-display", display], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=keep,
                             cwd="/", timeout=PROBE_TIMEOUT, check=False,
                             user=user.uid if user else None, group=user.gid if user else None,
                             extra_groups=[] if user is not None else None)
    except subprocess.TimeoutExpired:
        raise DisplayError(f"the display {display} did not answer within {PROBE_TIMEOUT:g} s") from None
    except OSError as exc:
        raise DisplayError(f"could not test the display {display}: {exc.strerror}") from None
    if res.returncode != 0:
        who = f"the browser user {user.name}" if user is not None else "this user"
        raise DisplayError(f"{who} cannot open the display {display} (refused or not running): "
                           "a headed browser cannot show its window there. Run the stage "
                           "headless, use the console's live view, or start the guard in the "
                           "desktop session that owns the display")


async def prepare(env: dict[str, str], headed: bool, user: Any, home_dir: Path | None) -> Path | None:
    """Before a browser starts: for a headed one with a DISPLAY, grant a root guard's browser
    user that display (its own X authority file, pointed at by XAUTHORITY in `env`) and probe
    it as that user. The grant file, or None. DisplayError (the grant revoked) when it cannot
    be opened."""
    if not headed or not env.get("DISPLAY"):
        return None
    xauth_file: Path | None = None
    usable = False
    try:
        if user is not None:
            display = local_display(env)
            if display is None or home_dir is None:
                raise DisplayError(f"the display {env.get('DISPLAY')!r} is not a local one")
            xauth_file = await asyncio.to_thread(grant, display, user, home_dir)
            env["XAUTHORITY"] = str(xauth_file)
        await asyncio.to_thread(probe, env, user)
        usable = True
    finally:
        if not usable:
            revoke(xauth_file)
    return xauth_file
