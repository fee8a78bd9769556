"""The folders of one browser launch: its profile, its HOME, its downloads, its extension copy.

    dirs = LaunchDirs.prepare(profile_dir, session, work, socket_dir, user, ca)   # before spawn
    ... the browser runs ...
    dirs.drop()                     # at close: a throw-away profile, the HOME, the extension

With a browser user (a root guard, supervisor/browsers/browser_pool.py) everything the browser
writes is that user's alone, 0700: the profile (handed over), a throw-away profile, a HOME of its
own (caches, the --ca-file NSS store, the X authority file, `downloads/`); its copy of the
guard's extension is root's, readable by that user's group only. Without one (an ordinary-user
guard) the browser gets a HOME only when it needs one for --ca-file, and its downloads go to the
run's shared `artifacts` folder as before.
"""
from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

from sfguard.supervisor.browsers import browser_user as bu
from sfguard.supervisor.browsers import chromium, trust
from sfguard.supervisor.home import private_dir
from sfguard.supervisor.writes import websockets


@dataclass
class LaunchDirs:
    profile_dir: Path
    temp_profile: bool
    home_dir: Path | None = None       # its own HOME (browser user, --ca-file), removed at close
    ext_dir: Path | None = None        # the WebSocket write gate's extension (writes/websockets.py)
    downloads: Path | None = None      # a browser user's downloads (in its HOME)
    #: what the profile carried that would have run before the guard (chromium.set_guard_prefs)
    carried: tuple[str, ...] = ()

    @classmethod
    async def prepare(cls, profile_dir: Path | None, session: str, work: Path, socket_dir: Path,
                      user: bu.BrowserUser | None, ca: trust.CaBundle, extension: bool = True) -> LaunchDirs:
        """Make the launch's folders under `work` (the run's folder, or beside the socket
        folder). HomeError, OSError or TrustError when one cannot be made; what was made is
        removed again. `extension` False: no copy of the guard's extension (the benchmark's
        plain-browser baseline only; host.py refuses it for a guarded browser)."""
        temp = profile_dir is None
        if temp or user is not None or ca:
            work = private_dir(work)
        if user is not None:
            bu.open_path(work)   # the browser user crosses to its HOME and temp profile
        owner = (user.uid, user.gid) if user is not None else None
        dirs = cls(bu.owned_dir(work, f"tp-{session[:20]}-", user), True) if profile_dir is None \
            else cls(Path(profile_dir), False)
        made = False
        try:
            if temp:
                dirs.carried = tuple(chromium.set_guard_prefs(dirs.profile_dir, owner))
            elif user is not None:
                bu.open_path(dirs.profile_dir.parent)
                dirs.carried = tuple(chromium.set_guard_prefs(dirs.profile_dir))   # before the hand-over
                bu.hand_over(dirs.profile_dir, user)
            else:
                private_dir(dirs.profile_dir)
                dirs.carried = tuple(chromium.set_guard_prefs(dirs.profile_dir))
            # a HOME of its own: the browser user's, or one holding the --ca-file authorities
            if user is not None or ca:
                dirs.home_dir = bu.owned_dir(work, bu.HOME_PREFIX, user)
            if user is not None and dirs.home_dir is not None:
                dirs.downloads = bu.owned_subdir(dirs.home_dir / bu.DOWNLOADS, user)
            if ca and dirs.home_dir is not None:
                await asyncio.to_thread(trust.install, ca, dirs.home_dir, *(owner or ()))
            # the guard's own files, readable by the browser user's group (its own), beside the
            # HOME or in the socket folder
            private = temp or user is not None or bool(ca)
            if extension:
                dirs.ext_dir = websockets.extension_dir(work if private else socket_dir,
                                                        user.gid if user is not None else None)
            made = True
        finally:
            if not made:
                dirs.drop()
        return dirs

    def drop(self) -> None:
        """Remove what the launch made: a throw-away profile, the HOME (downloads with it), the
        extension copy. A leased profile's folder stays (the store reseals and removes it)."""
        if self.temp_profile:
            shutil.rmtree(self.profile_dir, ignore_errors=True)
        for folder in (self.home_dir, self.ext_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def owned(self) -> tuple[Path, ...]:
        """The folders the browser's user may own (checked before the user is given back)."""
        return tuple(p for p in (self.profile_dir, self.home_dir) if p is not None)
