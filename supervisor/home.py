"""The guard home and the private runtime folder: the only place paths are rooted.

Home: `--home` flag, else `$SFGUARD_HOME`, else `~/.stageflow/guard`. Folders 0700, files 0600.
Runtime: a short private folder for sockets and unsealed profiles (unix sockets have a
103-byte path limit), preferably on a non-persistent file system.

Under a root guard every browser runs as a user of its own (supervisor/browsers/browser_pool.py),
who must reach its profile inside the runtime folder: `grant_traverse` names the runtime folder
whose folders `open_for_traverse` may make 0710 with a POSIX ACL that lets exactly the browser
users' uids cross (never list or read): `user:UID:--x` for each, the mask `--x`, the group and
others nothing. `private_dir` keeps a 0710 folder as it is (only its owner can have set it, on
purpose) and makes anything else 0700 (which also masks every ACL entry off).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from sfguard.errors import SfguardError

DEFAULT_HOME = Path("~/.stageflow/guard")
#: the live site policy of a guard started without --policy: in the home, beside the rest of
#: the guard's configuration, so that an upgrade of the installed package never replaces it
POLICY_NAME = "sites.yaml"
DIR_MODE = 0o700
FILE_MODE = 0o600


#: runtime roots whose folders may be 0710 with an ACL letting these uids cross: {root: uids}
_TRAVERSE: dict[str, tuple[int, ...]] = {}
TRAVERSE_MODE = 0o710
#: The POSIX ACL extended attribute (Linux: the kernel's binary form, version 2, entries of
#: tag, permissions, id; sorted by tag, then id).
ACL_XATTR = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED = 0xFFFFFFFF


class HomeError(SfguardError):
    """The guard home or runtime folder cannot be used safely."""


def grant_traverse(root: Path, uids: Iterable[int]) -> None:
    """Folders at or under `root` may be TRAVERSE_MODE, crossable by exactly `uids` (the
    browser users'): `private_dir` keeps that mode there. Set by the guard at start."""
    _TRAVERSE[os.path.normpath(os.fspath(root))] = tuple(sorted(set(uids)))


def revoke_traverse(root: Path) -> None:
    _TRAVERSE.pop(os.path.normpath(os.fspath(root)), None)


def traverse_root(path: Path) -> tuple[Path, tuple[int, ...]] | None:
    """(granted root, uids) covering `path` (a folder at or under that root), else None."""
    p = os.path.normpath(os.fspath(path))
    for root, uids in _TRAVERSE.items():
        if p == root or p.startswith(root.rstrip("/") + "/"):
            return Path(root), uids
    return None


def traverse_acl(uids: Iterable[int]) -> bytes:
    """The ACL of a cross-only folder: the owner rwx, each of `uids` --x, nothing for the
    group and others, the mask --x (so `ls -l` shows 0710)."""
    entries = [(_ACL_USER_OBJ, 7, _ACL_UNDEFINED)]
    entries += [(_ACL_USER, 1, uid) for uid in sorted(set(uids))]
    entries += [(_ACL_GROUP_OBJ, 0, _ACL_UNDEFINED), (_ACL_MASK, 1, _ACL_UNDEFINED),
                (_ACL_OTHER, 0, _ACL_UNDEFINED)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def acl_uids(path: Path) -> tuple[int, ...]:
    """The uids a folder's ACL names (`user:UID:...` entries); () without an ACL."""
    try:
        raw = os.getxattr(path, ACL_XATTR, follow_symlinks=False)
    except OSError:
        return ()
    return tuple(uid for tag, _perm, uid in struct.iter_unpack("<HHI", raw[4:]) if tag == _ACL_USER)


def open_for_traverse(path: Path) -> Path:
    """Make the folder `path` (ours, at or under a granted root) crossable by the granted
    uids: our group, mode 0710 through the ACL. HomeError when no grant covers it, or when
    its file system takes no POSIX ACL (the guard then refuses: fail closed)."""
    found = traverse_root(path)
    if found is None:
        raise HomeError(f"{path} is outside the runtime folder")
    want = traverse_acl(found[1])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise HomeError(f"{path} is not a plain folder of this user") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise HomeError(f"{path} is not a plain folder of this user")
        if st.st_gid != os.getgid():
            os.fchown(fd, -1, os.getgid())
        try:
            have = os.getxattr(fd, ACL_XATTR)
        except OSError:
            have = b""
        if have != want or stat.S_IMODE(st.st_mode) != TRAVERSE_MODE:
            try:
                os.setxattr(fd, ACL_XATTR, want)
            except OSError as exc:
                raise HomeError(f"{path}: its file system does not take the POSIX ACL that lets "
                                f"each browser user cross it ({exc.strerror})") from None
    finally:
        os.close(fd)
    return path


def resolve_home(flag: str | os.PathLike | None = None) -> Path:
    """The guard home path (not created): the flag wins over $SFGUARD_HOME."""
    raw = flag if flag not in (None, "") else os.environ.get("SFGUARD_HOME") or DEFAULT_HOME
    return Path(raw).expanduser().absolute()


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make it 0700 (a 0710 one stays: cross-only for a group,
    see above); refuse symlinks and foreign owners."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        st = os.lstat(path)
    except FileExistsError:
        raise HomeError(f"{path} is a file, not a folder") from None
    except NotADirectoryError:
        raise HomeError(f"{path}: a part of this path is a file, not a folder") from None
    except OSError as exc:
        raise HomeError(f"{path}: cannot create or use this folder: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise HomeError(f"{path} is not a plain directory")
    if st.st_uid != os.getuid():
        raise HomeError(f"{path} belongs to another user (uid {st.st_uid})")
    mode = stat.S_IMODE(st.st_mode)
    if mode == TRAVERSE_MODE:
        # Cross-only, set on purpose by this user (for the browser users through an ACL on
        # the runtime folder, for the API group on the home). Kept, also by another process of
        # this user (e.g. `sfguard profiles create` beside a running guard): resetting it
        # would cut a running browser off from its profile.
        return path
    if mode != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def existing_home(flag: str | os.PathLike | None = None) -> Path:
    """The guard home for read-only commands: resolved, never created. HomeError when it does
    not exist or is not a folder, naming the path (so a typo in --home is seen, not masked)."""
    home = resolve_home(flag)
    if not home.exists():
        raise HomeError(f"no guard home at {home} (check --home or $SFGUARD_HOME; `sfguard start` "
                        "or `sfguard profiles create` makes one)")
    if not home.is_dir():
        raise HomeError(f"{home} is a file, not a guard home folder")
    check_format(home)        # a newer sfguard's home is refused, even for reading
    return home


def ensure_home(flag: str | os.PathLike | None = None) -> Path:
    """Resolve and create the guard home with mode 0700; a home of a newer format is refused
    (check_format below; the guard and the commands that write migrate an older one)."""
    home = private_dir(resolve_home(flag))
    check_format(home)
    return home


def home_policy_path(home: Path) -> Path:
    """Where the live site policy of `home` is (not created): HOME/sites.yaml."""
    return home / POLICY_NAME


def ensure_home_policy(home: Path) -> Path:
    """HOME/sites.yaml, created from the shipped template (policy/sites.yaml) when missing:
    0600, written atomically (a half-written policy is never seen). An existing file, or a
    symlink a reviewer put there (e.g. to /etc/sfguard/sites.yaml), is left as it is: it is
    the reviewers' file, edited live."""
    from sfguard import policy  # noqa: PLC0415 (only the guard's start needs the template)

    path = home_policy_path(home)
    if os.path.lexists(path):
        return path
    data = policy.default_policy_path().read_bytes()
    with atomic_file(path) as fh:
        fh.write(data)
    return path


def runtime_dir(home: Path) -> Path:
    """A short private folder for this home's sockets and unsealed profiles, created (0700).

    Only what writes there calls this (the guard at start, a profile being unsealed); a
    reader asks `runtime_path`, which creates nothing, so a `profiles list` or a check after
    a guard stopped leaves no empty folder behind in /dev/shm.
    """
    return private_dir(runtime_path(home))


def runtime_path(home: Path) -> Path:
    """Where `runtime_dir(home)` is, without creating it.

    $XDG_RUNTIME_DIR (tmpfs, per user) when usable, else /dev/shm (tmpfs), else the system
    temp dir. The name is derived from the home so two homes never share one, and stays short
    for socket paths. Root skips $XDG_RUNTIME_DIR: root's (/run/user/0) is closed to other
    users, and a root guard's browser user must reach its profile in this folder.
    """
    tag = hashlib.sha256(str(home).encode()).hexdigest()[:10]
    base = None
    xdg = os.environ.get("XDG_RUNTIME_DIR") if os.geteuid() != 0 else None
    # memory-backed first, so an unsealed login never touches a disk
    for candidate in (xdg, "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            base = candidate
            break
    if base is None:
        base = tempfile.gettempdir()
    return Path(base) / f"sfg-{os.getuid()}-{tag}"


def prune_empty(folder: Path, stop: Path) -> None:
    """Remove `folder` and its parents up to and including `stop` while they are empty.

    rmdir only: a folder that holds anything (a socket, another profile) stays, so this is
    safe beside a running guard.
    """
    folder, stop = Path(folder), Path(stop)
    if folder != stop and not folder.is_relative_to(stop):
        return
    while True:
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == stop:
            return
        folder = folder.parent


def atomic_write(path: Path, data: bytes, mode: int = FILE_MODE, sync: bool = True) -> None:
    """Write `data` to `path` so a crash leaves either the old or the new file, never half
    (`sync`: see atomic_file)."""
    with atomic_file(path, mode, sync=sync) as fh:
        fh.write(data)


@contextlib.contextmanager
def atomic_file(path: Path, mode: int = FILE_MODE, buffering: int = -1,
                sync: bool = True) -> Iterator[BinaryIO]:
    """The one atomic write: yields a binary file to fill; on a clean exit it is flushed,
    fsynced and renamed over `path`, then the folder is fsynced. The temp file
    `.<name>.<random>.tmp` sits in the same folder, created with `mode`; on any error it is
    removed and `path` is left as it was. `sync` False: renamed without either fsync (a power
    cut may lose the new file, never leave half of it), for writes on the event loop."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    placed = False
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb", buffering=buffering) as fh:
            yield fh
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        placed = True
    finally:
        if not placed:      # an error (the caller's too): the temp file goes, `path` stays as it was
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    if sync:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the home's format
# The guard home's format version (`<home>/home.json`) and its migrations.
#
# Every file the guard keeps in its home (sealed profiles, keys, leases, run records, the audit
# chain and its segments) is laid out as the home's format says. `sfguard start` and every
# command that writes the home bring an older home up to FORMAT with the migrations below, in
# order, and record it; a read-only command reads an older home as it is. A home written by a
# newer sfguard (a higher format) is refused by every command with one clear message, so an
# older release never half-understands a newer layout (as the PostgreSQL schema is refused).
#
# Formats:
#   0  every home before home.json existed (through commit 18d718e).
#   1  home.json; the audit log may be closed into segments (audit.d/, audit.anchor). Nothing
#      of format 0 changes: the migration only records the format.
#   2  key versions: keys.json (which version is current), keys/vN/ for versions above 1,
#      sealed profiles in SFGSEAL version 2 (the header names its key version), audit records
#      keyed by a version above 1 name it (`kid`). Version 1 is what format 1 held: sealed
#      files of version 1 and records without `kid` were sealed and keyed by key version 1, so
#      nothing is rewritten; an older sfguard, which cannot read version 2 seals, is refused.

FORMAT_FILE = "home.json"
FORMAT = 2


class HomeFormatError(HomeError):
    """The home's format cannot be used by this sfguard (newer, or the file is damaged)."""


def _to_1(home: Path) -> None:
    """0 -> 1: nothing to rewrite (segments appear only when the log is closed)."""


def _to_2(home: Path) -> None:
    """1 -> 2: nothing to rewrite (what is there is key version 1; keys.json appears with the
    first rotation)."""


#: migration from format N to N + 1
MIGRATIONS: dict[int, Callable[[Path], None]] = {0: _to_1, 1: _to_2}


def read_format(home: Path) -> int:
    """The home's format: 0 without home.json; HomeFormatError for a damaged file."""
    try:
        raw = (Path(home) / FORMAT_FILE).read_bytes()
    except FileNotFoundError:
        return 0
    try:
        data = json.loads(raw)
        fmt = data["format"]
        if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise HomeFormatError(f"{Path(home) / FORMAT_FILE} is damaged (it must say {{\"format\": N}}); "
                              "it was left as it is") from None
    return fmt


def check_format(home: Path) -> int:
    """Refuse a home this sfguard cannot read; its format otherwise."""
    fmt = read_format(home)
    if fmt > FORMAT:
        raise HomeFormatError(f"the guard home {home} was written by a newer sfguard (home format "
                              f"{fmt}; this one reads formats up to {FORMAT}): upgrade sfguard, "
                              "or use another home")
    return fmt


def upgrade_format(home: Path) -> int:
    """Bring the home up to FORMAT (each migration in order) and record it; its format before."""
    before = check_format(home)
    fmt = before
    while fmt < FORMAT:
        MIGRATIONS[fmt](home)
        fmt += 1
    if before != FORMAT or not os.path.exists(Path(home) / FORMAT_FILE):
        atomic_write(Path(home) / FORMAT_FILE, json.dumps({"format": FORMAT}).encode() + b"\n", 0o600)
    return before
