"""The browser users: one unprivileged OS user for each running browser (layer 2, issue 50).

A root guard runs every browser it starts (anchors and throw-away browsers) as a user of its
pool, PREFIX1 ... PREFIXN (default sfguard-browser1 ... sfguard-browser16; `sfguard start
--browser-users PREFIX --browser-pool-size N`): each with a group of its own and no other group,
never root, never the stage user's uid or group; created when missing (at start, or by `sfguard
service ensure-users`). A browser's folders (profile, HOME with its NSS store, X authority file
and downloads) are its user's, 0700; its copy of the guard's extension is root's, readable by
its group only. So no other browser's uid can list, read or signal them: the kernel keeps runs
apart, not Chromium's sandbox alone.

    pool = setup(runtime, host, PoolConfig(), stage_user_name)   # at start, before the sweep
    user = pool.take("run r1")          # None: every user is in use (the stage waits)
    ... the browser runs as user ...
    pool.give_back(user, leftovers)     # its processes ended, its files gone or taken back

A user goes back only when no process of its uid is left (any found is ended) and the folders
it may still own (`leftovers`: a working copy whose reseal was put off) are root's again.

Several guards on one host may share a pool: each user has a lock file in `lock_dir()` (root's,
memory-backed), flock'ed by the guard whose browser runs as it. Its text names that guard's
runtime folder until the user is given back clean, so a user a crashed guard left is taken
again only by that guard's sweep (`claim_left`), or by anyone once that runtime folder is
gone; never while that guard's files may still be there.
"""
from __future__ import annotations

import fcntl
import grp
import json
import logging
import os
import pwd
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sfguard.supervisor.browsers.browser_user import BrowserUser, BrowserUserError, prepare, take_back
from sfguard.supervisor.home import ACL_XATTR, HomeError, private_dir, traverse_acl
from sfguard.supervisor.procs import terminate_recorded, uid_processes
from sfguard.supervisor.stage import sandbox

log = logging.getLogger("sfguard.guard")

DEFAULT_PREFIX = "sfguard-browser"
DEFAULT_SIZE = 16
MAX_SIZE = 256
#: a user name prefix: the pool's names (prefix + number) stay within 32 characters
_PREFIX = re.compile(r"[a-z_][a-z0-9_-]{0,27}")
#: folders shared by every user where a browser could leave a file (measured: Chromium 156 with
#: HOME and TMPDIR in its own folder leaves none; looked at anyway before a uid is reused)
SHARED_TEMP = ("/tmp", "/var/tmp", "/dev/shm")


class PoolError(BrowserUserError):
    """The pool cannot be used (a user missing, shared, privileged); the guard does not start."""


@dataclass(frozen=True)
class PoolConfig:
    """The pool's users: `prefix` followed by 1 ... `size`."""
    prefix: str = DEFAULT_PREFIX
    size: int = DEFAULT_SIZE

    def check(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise PoolError(f"browser user prefix {self.prefix!r}: lower-case letters, digits, _ "
                            "and -, starting with a letter or _, at most 28 characters")
        if not 1 <= self.size <= MAX_SIZE:
            raise PoolError(f"browser pool size {self.size}: from 1 to {MAX_SIZE}")

    def names(self) -> list[str]:
        self.check()
        return [f"{self.prefix}{i}" for i in range(1, self.size + 1)]


def lock_dir() -> Path:
    """Where the pool's lock files are: one folder per guard user on the host, memory-backed."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return Path(base) / f"sfg-{os.getuid()}-browser-users"


def _check(user: BrowserUser, stage: BrowserUser | None, primary: dict[int, list[str]]) -> None:
    """Unprivileged, not the stage user's, its group its own and no other group."""
    if user.uid == 0 or user.gid == 0:
        raise PoolError(f"browser user {user.name!r} has uid or gid 0; it must be unprivileged")
    if stage is not None and (user.uid == stage.uid or user.gid == stage.gid):
        raise PoolError(f"browser user {user.name!r} shares its uid or group with the stage user "
                        f"{stage.name!r}: a stage could reach the browser's profile")
    if os.getgrouplist(user.name, user.gid) != [user.gid]:
        raise PoolError(f"browser user {user.name!r} is in other groups besides its own: remove "
                        "them (another group could share its files)")
    try:
        members = grp.getgrgid(user.gid).gr_mem
    except KeyError:
        members = []
    others = [n for n in [*members, *primary.get(user.gid, [])] if n != user.name]
    if others:
        raise PoolError(f"the group of browser user {user.name!r} also has {', '.join(sorted(others))}: "
                        "each browser user needs a group of its own")


def ensure_users(config: PoolConfig, stage: BrowserUser | None = None, *,
                 create: bool = True) -> list[BrowserUser]:
    """The pool's users, each created when missing (`create`, root only) and checked."""
    users = []
    for name in config.names():
        try:
            user = sandbox.ensure_system_user(name, "browser") if create else sandbox.lookup_user(name)
        except sandbox.SandboxError as exc:
            raise PoolError(str(exc)) from None
        if user is None:
            raise PoolError(f"browser user {name!r} does not exist (sfguard service ensure-users "
                            "or a root `sfguard start` creates it)")
        users.append(user)
    if len({u.uid for u in users}) < len(users) or len({u.gid for u in users}) < len(users):
        raise PoolError(f"the browser users {config.prefix}1..{config.size} do not each have a uid "
                        "and a group of their own")
    primary: dict[int, list[str]] = {}
    for pw in pwd.getpwall():
        primary.setdefault(pw.pw_gid, []).append(pw.pw_name)
    for user in users:
        _check(user, stage, primary)
    return users


def existing_uids(config: PoolConfig | None = None) -> tuple[int, ...]:
    """The uids of the pool's users that exist (no checks, nothing created): for scans."""
    found = (sandbox.lookup_user(n) for n in (config or PoolConfig()).names())
    return tuple(u.uid for u in found if u is not None)


def describe_users(users: list[BrowserUser]) -> str:
    """One line for `sfguard start` and `doctor`."""
    first, last = users[0], users[-1]
    return (f"each as a user of its own ({len(users)}: {first.name} uid {first.uid} .. {last.name} "
            f"uid {last.uid}), Chromium's sandbox on")


def held_count(users: list[BrowserUser]) -> int:
    """How many of `users` a guard holds now (or a dead guard left): their lock files name one."""
    n = 0
    for user in users:
        try:
            n += (lock_dir() / f"{user.name}.lock").stat().st_size > 0
        except OSError:
            continue
    return n


def acl_problem() -> str | None:
    """Why a root guard's runtime folder could not be opened to the browser users here (its
    file system takes no POSIX ACL), or None."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    folder = tempfile.mkdtemp(prefix="sfg-acl-", dir=base)
    try:
        os.setxattr(folder, ACL_XATTR, traverse_acl([65534]))
    except OSError as exc:
        return (f"{base} takes no POSIX ACL ({exc.strerror}): the guard's runtime folder there cannot "
                "let each browser user cross it, so a root sfguard start refuses")
    finally:
        os.rmdir(folder)
    return None


def _remove_strays(uid: int) -> list[str]:
    """Files and folders of `uid` directly in the shared temp folders: removed (no link
    followed). Only a browser (or something it started) can have made them."""
    removed = []
    for base in SHARED_TEMP:
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_uid != uid:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
            except OSError as exc:
                log.warning("could not remove %s of a browser user: %s", entry.path, exc.strerror)
    return removed


class BrowserPool:
    """The users this guard's browsers run as, one per running browser. Thread-safe: `take`
    and `give_back` block (locks, process scans) and are called off the event loop."""

    def __init__(self, users: list[BrowserUser], runtime: Path, locks: Path | None = None):
        self.users, self.runtime = list(users), os.path.normpath(os.fspath(runtime))
        self.locks = private_dir(locks or lock_dir())
        self._held: dict[int, int] = {}        # uid -> its lock file's fd
        self._stuck: dict[int, tuple[Path, ...]] = {}   # given back, but a process would not end
        self._next = 0
        self._mutex = threading.Lock()

    @property
    def uids(self) -> tuple[int, ...]:
        return tuple(u.uid for u in self.users)

    def in_use(self) -> int:
        with self._mutex:
            return len(self._held)

    def describe(self) -> str:
        return describe_users(self.users)

    def full_reason(self) -> str:
        return (f"all {len(self.users)} browser users of this guard are in use (one per running "
                "browser); the stage starts when a browser ends (sfguard start --browser-pool-size)")

    # -- lock files ------------------------------------------------------------------------
    def _lock(self, user: BrowserUser) -> int | None:
        fd = os.open(self.locks / f"{user.name}.lock",
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None      # a live guard's browser runs as it
        return fd

    @staticmethod
    def _marker(fd: int) -> dict:
        raw = os.pread(fd, 4096, 0)
        try:
            data = json.loads(raw) if raw.strip() else {}
        except ValueError:
            data = {"runtime": "?"}     # unreadable: somebody held it; treat as not ours
        return data if isinstance(data, dict) else {"runtime": "?"}

    def _may_clean(self, marker: dict) -> bool:
        """A user whose marker names no holder, this guard's runtime folder, or one gone."""
        where = marker.get("runtime")
        return not marker or where == self.runtime or (isinstance(where, str) and where.startswith("/")
                                                       and not os.path.exists(where))

    @staticmethod
    def _write(fd: int, marker: dict | None) -> None:
        os.ftruncate(fd, 0)
        if marker:
            os.pwrite(fd, json.dumps(marker).encode(), 0)

    @staticmethod
    def _end_processes(user: BrowserUser) -> bool:
        """End every process of the user; True when none is left."""
        left = uid_processes([user.uid])
        if left:
            log.warning("browser user %s: %d process(es) left; ending them", user.name, len(left))
            terminate_recorded(left, 5.0)
            left = uid_processes([user.uid])
        return not left

    # -- take and give back ------------------------------------------------------------------
    def take(self, what: str) -> BrowserUser | None:
        """A free user for a new browser, marked as this guard's (`what`: the run, for a person
        reading the lock file); None when every user is in use. No process scan for a user
        given back clean (`give_back` checked then): a first stage does not pay for one."""
        with self._mutex:
            n = len(self.users)
            for i in range(n):
                user = self.users[(self._next + i) % n]
                if user.uid in self._held:
                    continue
                fd = self._lock(user)
                if fd is None:
                    continue
                # A user given back clean had no process left then, and only root can start one
                # as it since; one a holder left marked (it died) is cleaned now, if it may be.
                marker = self._marker(fd)
                if marker and (not self._may_clean(marker) or not self._end_processes(user)):
                    os.close(fd)     # a dead guard's files may be there, or a process will not end
                    continue
                if marker:
                    _remove_strays(user.uid)
                self._write(fd, {"runtime": self.runtime, "pid": os.getpid(), "what": what[:80]})
                self._held[user.uid] = fd
                self._next = (self._next + i + 1) % n
                return user
            return None

    def give_back(self, user: BrowserUser, leftovers: Iterable[Path] = ()) -> bool:
        """Return the user: every process of its uid ended, each of `leftovers` that still exists
        (a folder it owned) taken back by root, stray files in the shared temp folders removed,
        its lock file cleared. False (kept, `retry_stuck` tries again) while a process is left."""
        with self._mutex:
            fd = self._held.get(user.uid)
            if fd is None:
                return True
            keep = tuple(Path(p) for p in leftovers)
            try:
                if not self._end_processes(user):
                    raise OSError("a process of it did not end")
                for path in keep:
                    if os.path.lexists(path):
                        take_back(path)
            except OSError as exc:
                self._stuck[user.uid] = keep
                log.error("browser user %s is kept out of the pool for now: %s", user.name, exc)
                return False
            _remove_strays(user.uid)
            self._write(fd, None)
            os.close(fd)
            del self._held[user.uid]
            self._stuck.pop(user.uid, None)
            return True

    def stuck(self) -> int:
        """How many users a process that would not end (or a folder) keeps out of the pool."""
        return len(self._stuck)

    def retry_stuck(self) -> list[str]:
        """Give back the users a stuck process kept (the watchdog calls it); their names."""
        with self._mutex:
            stuck = [(u, self._stuck[u.uid]) for u in self.users if u.uid in self._stuck]
        return [u.name for u, keep in stuck if self.give_back(u, keep)]

    def claim_left(self, recorded: Iterable[int] = ()) -> list[BrowserUser]:
        """At start (the sweep): the users a dead guard of this runtime folder left (its run
        records name them, or their marks name this runtime folder or one that is gone),
        locked as this guard's, their processes ended. The sweep gives them back once their
        files are resealed or gone. A user another live guard holds is never touched."""
        named = set(recorded)
        claimed = []
        with self._mutex:
            for user in self.users:
                if user.uid in self._held:
                    continue
                fd = self._lock(user)
                if fd is None:
                    continue
                marker = self._marker(fd)
                if not (marker and self._may_clean(marker)) and not (user.uid in named and not marker):
                    os.close(fd)
                    continue
                self._end_processes(user)
                self._held[user.uid] = fd
                claimed.append(user)
        return claimed

    def close(self) -> None:
        """At stop: let go of every lock. A user not given back keeps its marker (its browser's
        files may be left): only this guard's next sweep takes it again."""
        with self._mutex:
            for fd in self._held.values():
                os.close(fd)
            self._held.clear()


def setup(runtime: Path, host: object, config: PoolConfig, stage_user_name: str) -> BrowserPool | None:
    """At guard start (before the sweep): under root, the pool's users (created when missing,
    checked), the runtime folder opened for them to cross, and `host` (a BrowserHost) told to
    run every browser as one of them. None when the guard is not root. PoolError when the pool
    cannot be used: the guard does not start."""
    if os.geteuid() != 0:
        return None
    users = ensure_users(config, sandbox.lookup_user(stage_user_name))
    try:
        prepare(runtime, users)
        pool = BrowserPool(users, runtime)
    except (HomeError, OSError) as exc:
        raise PoolError(f"the runtime folder cannot be opened to the browser users: {exc}") from None
    host.use_pool(pool)      # type: ignore[attr-defined]
    return pool


def close(pool: BrowserPool | None) -> None:
    """At guard stop (BrowserPool.close), when there is a pool."""
    if pool is not None:
        pool.close()
