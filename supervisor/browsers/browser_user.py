"""Layer 2 of stage containment: the folders of a browser that runs as a user of its own.

A root guard starts every browser as one of its browser users (supervisor/browsers/
browser_pool.py: one user per running browser) with Chromium's own sandbox on: no
`--no-sandbox`. What such a user may touch:

    <runtime>/                         root 0710 + ACL    cross only, for each browser user's uid
    <runtime>/profiles/, .../<scope>/  root 0710 + ACL    cross only
    <runtime>/profiles/<scope>/<name>/ <its user> 0700    the unsealed profile, handed over
    <runtime>/r-<id>/                  root 0710 + ACL    the run's folder, cross only
    <runtime>/r-<id>/tp-...            <its user> 0700    a throw-away profile
    <runtime>/r-<id>/bh-...            <its user> 0700    its HOME: caches, NSS store, X authority,
                                                          downloads (bh-.../downloads)
    <runtime>/r-<id>/wsx-...           root:<its group> 0750   its copy of the guard's extension

Everything else of the guard stays root's, 0700/0600: the home (keys, leases, audit, run
records, the control socket), the agent-browser socket folder, the pinned config, the bridges.
Root unseals a profile, then hands it over (`hand_over`: ownership changed bottom-up, through
folder descriptors, never following a link); at run end root reseals it, reading through
folder descriptors without following links (supervisor/profiles/sealing.py), and removes it;
a folder that must outlive its browser's user is taken back by root (`take_back`).

When the guard runs as an ordinary user there is no separate user: the browsers run as that
user, as before. `resolve` (one user) is for a browser that is not the guard's (the console's
scripted viewer, supervisor/console/viewer.py).
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from sfguard.errors import SfguardError
from sfguard.supervisor.home import HomeError, grant_traverse, open_for_traverse, private_dir, traverse_root
from sfguard.supervisor.stage import sandbox

#: the user of a browser that is not the guard's (the console's scripted viewer)
DEFAULT_BROWSER_USER = "sfguard-browser"
#: Per-launch folders under the run folder (the prefixes name them for the sweep and for tests).
HOME_PREFIX = "bh-"
#: a browser's downloads, in its HOME (the stages' artifacts folder of that browser)
DOWNLOADS = "downloads"
BrowserUser = sandbox.StageUser   # (name, uid, gid): the same small record as the stage user


class BrowserUserError(SfguardError):
    """The browser user cannot be used; the guard refuses to start rather than run browsers
    as root without their sandbox."""


def resolve(name: str | None = None, *, stage_user: BrowserUser | None = None,
            create: bool = True) -> BrowserUser | None:
    """One unprivileged user for a browser that is not the guard's: None when this process is
    not root. Created when missing (`create`). Never root, never the stage user."""
    if os.geteuid() != 0:
        return None
    name = name or DEFAULT_BROWSER_USER
    try:
        user = (sandbox.ensure_system_user(name, "browser") if create
                else sandbox.lookup_user(name))
    except sandbox.SandboxError as exc:
        raise BrowserUserError(str(exc)) from None
    if user is None:
        return None
    if user.uid == 0 or user.gid == 0:
        raise BrowserUserError(f"browser user {name!r} has uid or gid 0; it must be unprivileged")
    if stage_user is not None and (user.uid == stage_user.uid or user.gid == stage_user.gid):
        raise BrowserUserError(f"browser user {name!r} shares its uid or group with the stage "
                               f"user {stage_user.name!r}: a stage could reach the browser's profile")
    return user


def check_reachable(runtime: Path, user: BrowserUser) -> None:
    """Every folder above the runtime folder must let the browser user cross (x for others,
    or its own/group's x); else its browsers could not reach their profiles. Fail closed."""
    for parent in list(Path(runtime).parents)[::-1]:
        st = os.stat(parent)
        if st.st_uid == user.uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == user.gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise BrowserUserError(f"the browser user {user.name!r} cannot cross {parent} to reach "
                                   f"the runtime folder {runtime}")


def prepare(runtime: Path, users: list[BrowserUser]) -> None:
    """At guard start: the runtime folder may be crossed (not listed) by exactly the browser
    users' uids (an ACL), and is. Every folder above it must let each of them cross."""
    for user in users:
        check_reachable(runtime, user)
    grant_traverse(runtime, [u.uid for u in users])
    open_for_traverse(private_dir(runtime))


def open_path(folder: Path) -> None:
    """Make every folder from the granted runtime folder down to `folder` (inclusive, all
    root's) crossable by the browser users. HomeError when no grant covers `folder`."""
    folder = Path(folder)
    found = traverse_root(folder)
    if found is None:
        raise HomeError(f"{folder} is outside the runtime folder")
    root = found[0]
    parts = folder.relative_to(root).parts
    for i in range(len(parts) + 1):
        open_for_traverse(root.joinpath(*parts[:i]))


def hand_over(folder: Path, user: BrowserUser) -> None:
    """Give `folder` and everything in it to the browser user (bottom-up, through folder
    descriptors, links never followed), and make `folder` itself 0700. Root only.

    Bottom-up: the folder stays root's until everything in it is handed over, so nothing can
    be swapped under the walk; on a folder the user already owns (a relaunch) no link is
    followed either. A folder of another user (another browser's) is refused."""
    folder = Path(folder)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise HomeError(f"{folder} is not a plain folder")
    if st.st_uid not in (os.getuid(), user.uid):
        raise HomeError(f"{folder} belongs to another user (uid {st.st_uid})")
    _chown_tree(folder, user.uid, user.gid)
    os.chmod(folder, 0o700)   # its parent is root's: the name cannot be swapped meanwhile


def take_back(folder: Path) -> None:
    """Give `folder` and everything in it back to this process's user (root), bottom-up and
    without following links, and make `folder` 0700: what a browser user owned (a working
    copy whose reseal was put off) outlives its browser, never its user's hold on it."""
    folder = Path(folder)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        os.unlink(folder)     # a link or file a browser left where a folder was: not kept
        return
    _chown_tree(folder, os.getuid(), os.getgid())
    os.chmod(folder, 0o700)


def _chown_tree(folder: Path, uid: int, gid: int) -> None:
    for _root, dirs, files, dfd in os.fwalk(folder, topdown=False, follow_symlinks=False):
        for name in dirs + files:
            try:
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
    os.chown(folder, uid, gid, follow_symlinks=False)


def owned_dir(parent: Path, prefix: str, user: BrowserUser | None) -> Path:
    """A fresh 0700 folder under `parent` for the browser (a throw-away profile, its HOME),
    given to the browser user when there is one."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    if user is not None:
        os.chown(path, user.uid, user.gid)
    os.chmod(path, 0o700)
    return path


def owned_subdir(path: Path, user: BrowserUser | None) -> Path:
    """`path` (a fixed name, e.g. the run's artifacts folder) created 0700 for the browser
    user when missing; an existing one must be a plain folder of root or that user."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise HomeError(f"{path} is not a plain folder") from None
        if st.st_uid not in (os.getuid(), user.uid if user is not None else os.getuid()):
            raise HomeError(f"{path} belongs to another user (uid {st.st_uid})") from None
    if user is not None:
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
    return path


def describe(pool: object | None) -> str:
    """One line for `sfguard start` and `doctor`: who the browsers run as."""
    if pool is None:
        return ("as this user (the guard is not root; a root guard runs each browser as an "
                "unprivileged user of its own with Chromium's sandbox on)")
    return str(pool.describe())    # type: ignore[attr-defined]
