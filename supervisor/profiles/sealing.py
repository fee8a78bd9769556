"""Seal a profile folder into one authenticated, encrypted file, and unseal it again.

    seal_dir(src, dest, scope_key, scope, name, key_version=N)  the folder into `dest`, atomically
    unseal_to(sealed, dest, keys, scope, name)   into the new folder `dest`, every chunk verified
    verify_sealed(sealed, keys, scope, name)     every chunk authenticated, nothing written
    reseal(sealed, dest, old_keys, new_key, N, scope, name)   to key version N, never unpacked
    key_version_of(sealed, scope, name)          the key version (`kid`) its header names

`keys` is the scope key or a lookup by key version. The file: MAGIC ("SFGSEAL" 0x02; 0x01, key
version 1, is still read) | header length (u32 BE) | header (canonical JSON: version, scope,
name, `kid`, salt, nonce prefix, chunk size), then chunks of a PAX tar stream of the folder,
each a length (u32 BE) and its AES-256-GCM ciphertext+tag. Anything that cannot be trusted is a
`SealError`, and leaves nothing unsealed behind; a crash keeps the previous sealed copy. Only
folders and regular files are sealed, read without following a link; caches, `Service Worker`,
the saved session and `Singleton*` files are left out (`is_excluded`).

Why this format, and what each part guarantees: docs/decisions/0026-sealed-profile-format.md.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import secrets
import shutil
import stat
import struct
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sfguard.supervisor.home import DIR_MODE, FILE_MODE, atomic_file, fsync_dir
from sfguard.supervisor.protocols import ProfileError

MAGIC = b"SFGSEAL\x02"
MAGIC_V1 = b"SFGSEAL\x01"      # read only: files sealed before key versions existed (kid 1)
VERSION = 2
CHUNK_SIZE = 1 << 20          # 1 MiB of plaintext per chunk
MAX_HEADER = 4096
TAG_BYTES = 16

# Folder names (anywhere in the tree) that are caches: left out of the seal.
CACHE_DIRS = frozenset({
    "Cache", "Code Cache", "GPUCache", "ShaderCache", "GrShaderCache", "GraphiteDawnCache",
    "DawnCache", "DawnGraphiteCache", "DawnWebGPUCache", "component_crx_cache",
    "extensions_crx_cache", "Crashpad", "BrowserMetrics",
})
# "Service Worker" is left out whole: its registrations without their scripts (ScriptCache, a
# cache) never start again in the next run, and a page waiting for its worker waits for ever
# (measured: tests/daemon/test_write_gate_websocket.py). A site registers its worker again.
SERVICE_WORKER_DIR = "Service Worker"
# A saved session (the tabs Chromium restores) is left out: a page a person or an earlier run
# left open must not come back and run before the guard's rules in the next run (issue 52).
SESSION_FILES = frozenset({"Sessions", "Sessions_Encrypted", "Current Session", "Current Tabs", "Last Session",
                           "Last Tabs"})


class SealError(ProfileError):
    """The sealed file cannot be trusted or read: wrong key, tampered, truncated, foreign."""


#: the scope key of a key version (raises KeyMissing, a ProfileError, when it is not here)
KeyLookup = Callable[[int], bytes]


def _lookup(keys: bytes | KeyLookup) -> KeyLookup:
    """A key lookup; plain bytes are the key whatever version the file names (tools, tests)."""
    if isinstance(keys, bytes):
        return lambda _version: keys
    return keys


def is_excluded(rel: str) -> bool:
    """True when the relative path `rel` ('Default/Cache/x') is left out of the seal."""
    parts = rel.split("/")
    if parts[-1].startswith("Singleton"):
        return True
    for i, part in enumerate(parts):
        if part in CACHE_DIRS or (part == SERVICE_WORKER_DIR and i + 1 < len(parts)) \
                or (part in SESSION_FILES and i >= 1):
            return True
    return False


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _file_key(scope_key: bytes, hdr: dict) -> AESGCM:
    """The per-file key of a header (its format version is part of the HKDF info)."""
    if len(scope_key) != 32:
        raise SealError("the scope key must be 32 bytes")
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=bytes.fromhex(hdr["salt"]),
                info=f"sfguard seal v{hdr['v']} {hdr['scope']}/{hdr['name']}".encode())
    return AESGCM(hkdf.derive(scope_key))


def _aad(header_digest: bytes, index: int, final: bool) -> bytes:
    return header_digest + struct.pack(">QB", index, 1 if final else 0)


class _SealWriter(io.RawIOBase):
    """A write-only stream: buffers plaintext and writes sealed chunks to `out`.

    Keeps one chunk back so that the last chunk can be flagged final in `finish()`.
    """

    def __init__(self, out, aes: AESGCM, prefix: bytes, digest: bytes, chunk_size: int):
        super().__init__()
        self._out, self._aes, self._prefix, self._digest = out, aes, prefix, digest
        self._chunk = chunk_size
        self._buf = bytearray()
        self._index = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._buf += data
        while len(self._buf) > self._chunk:
            self._emit(bytes(self._buf[:self._chunk]), final=False)
            del self._buf[:self._chunk]
        return len(data)

    def _emit(self, plain: bytes, final: bool) -> None:
        nonce = self._prefix + struct.pack(">Q", self._index)
        ct = self._aes.encrypt(nonce, plain, _aad(self._digest, self._index, final))
        self._out.write(struct.pack(">I", len(ct)))
        self._out.write(ct)
        self._index += 1

    def finish(self) -> None:
        self._emit(bytes(self._buf), final=True)
        self._buf.clear()


def _open_chunk(aes: AESGCM, prefix: bytes, digest: bytes, index: int, ct: bytes) -> tuple[bytes, bool]:
    """(plaintext, final flag) of chunk `index`; SealError when it does not authenticate."""
    nonce = prefix + struct.pack(">Q", index)
    # A chunk verifies either as a middle chunk or as the final one; try both flags.
    for final in (False, True):
        try:
            return aes.decrypt(nonce, ct, _aad(digest, index, final)), final
        except InvalidTag:
            continue
    raise SealError(f"sealed file failed authentication at chunk {index} "
                    "(wrong key, tampered or not this profile's file)")


class _UnsealReader(io.RawIOBase):
    """A read-only stream of verified plaintext; raises SealError on any bad chunk."""

    def __init__(self, src, aes: AESGCM, prefix: bytes, digest: bytes, chunk_size: int):
        super().__init__()
        self._src, self._aes, self._prefix, self._digest = src, aes, prefix, digest
        self._max_ct = chunk_size + TAG_BYTES
        self._plain = memoryview(b"")
        self._index = 0
        self.finished = False

    def readable(self) -> bool:
        return True

    def _next_chunk(self) -> None:
        head = self._src.read(4)
        if len(head) < 4:
            raise SealError("sealed file is truncated (no final chunk)")
        (length,) = struct.unpack(">I", head)
        if length < TAG_BYTES or length > self._max_ct:
            raise SealError(f"sealed file is damaged (chunk {self._index} has a bad length)")
        ct = self._src.read(length)
        if len(ct) < length:
            raise SealError("sealed file is truncated (chunk cut off)")
        plain, final = _open_chunk(self._aes, self._prefix, self._digest, self._index, ct)
        self._index += 1
        self._plain = memoryview(plain)
        if final:
            self.finished = True
            if self._src.read(1):
                raise SealError("sealed file has data after its final chunk")

    def readinto(self, b) -> int:
        while not self._plain:
            if self.finished:
                return 0
            self._next_chunk()
        n = min(len(b), len(self._plain))
        b[:n] = self._plain[:n]
        self._plain = self._plain[n:]
        return n

    def drain(self) -> None:
        """Read (and verify) to the final chunk; what is left must be tar padding (zeros)."""
        while True:
            data = self.read(1 << 16)
            if not data:
                break
            if data.strip(b"\0"):
                raise SealError("sealed file holds data after the end of the archive")


def _header(scope: str, name: str, chunk_size: int, key_version: int) -> tuple[bytes, dict]:
    if isinstance(key_version, bool) or not isinstance(key_version, int) or key_version < 1:
        raise SealError("the key version must be a whole number from 1")
    hdr = {"v": VERSION, "scope": scope, "name": name, "kid": key_version,
           "salt": secrets.token_hex(16), "prefix": secrets.token_hex(4), "chunk": chunk_size}
    body = _canonical(hdr)
    return MAGIC + struct.pack(">I", len(body)) + body, hdr


def _read_header(fh, scope: str, name: str) -> tuple[bytes, dict]:
    """(the header's raw bytes, the header) of a version 2 or version 1 file; a version 1
    header gets `kid` 1 (the key version that sealed every file before versions existed)."""
    magic = fh.read(len(MAGIC))
    if magic not in (MAGIC, MAGIC_V1):
        raise SealError("not a sealed profile file (bad magic or unsupported version)")
    raw_len = fh.read(4)
    if len(raw_len) < 4:
        raise SealError("sealed file is truncated (header)")
    (length,) = struct.unpack(">I", raw_len)
    if length > MAX_HEADER:
        raise SealError("sealed file header is too large")
    body = fh.read(length)
    try:
        hdr = json.loads(body)
        version = 1 if magic == MAGIC_V1 else VERSION
        if isinstance(hdr, dict) and version == 1 and "kid" not in hdr:
            hdr["kid"] = 1
        kid = hdr.get("kid") if isinstance(hdr, dict) else None
        ok = (isinstance(hdr, dict) and hdr.get("v") == version
              and isinstance(kid, int) and not isinstance(kid, bool) and kid >= 1
              and isinstance(hdr.get("chunk"), int) and 0 < hdr["chunk"] <= 64 << 20
              and len(bytes.fromhex(hdr["salt"])) == 16 and len(bytes.fromhex(hdr["prefix"])) == 4)
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise SealError("sealed file header is damaged")
    if hdr.get("scope") != scope or hdr.get("name") != name:
        raise SealError("sealed file belongs to another profile or scope")
    return magic + raw_len + body, hdr


def key_version_of(sealed: Path, scope: str, name: str) -> int:
    """The key version that sealed `sealed` (from its header; 1 for a version 1 file)."""
    with open(sealed, "rb") as fh:
        return int(_read_header(fh, scope, name)[1]["kid"])


def _iter_sources(src: Path):
    """(relative posix path, lstat, folder fd, name) of the folders and regular files to seal,
    sorted, walked through folder descriptors (os.fwalk) without following any link.

    Under a root guard the folder belongs to the browser user while root reads it: a link or
    a folder swapped for one during the walk is never followed, so nothing outside the
    profile can be sealed into it. The fd is valid until the next item is asked for."""
    for root, dirs, files, dfd in os.fwalk(src, topdown=True, follow_symlinks=False):
        rel_root = os.path.relpath(root, src)
        rel_root = "" if rel_root == "." else rel_root.replace(os.sep, "/")
        keep_dirs = []
        for d in sorted(dirs):
            rel = f"{rel_root}/{d}" if rel_root else d
            if is_excluded(rel):
                continue
            try:
                st = os.lstat(d, dir_fd=dfd)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):   # a link to a folder is listed as one
                continue
            keep_dirs.append(d)
            yield rel, st, dfd, d
        dirs[:] = keep_dirs
        for f in sorted(files):
            rel = f"{rel_root}/{f}" if rel_root else f
            if is_excluded(rel):
                continue
            try:
                st = os.lstat(f, dir_fd=dfd)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):   # never symlinks, sockets, fifos, devices
                yield rel, st, dfd, f


def _open_regular(name: str, dfd: int):
    """The regular file `name` in folder `dfd`, opened without following a link (None when it
    is gone or is no longer a regular file)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):   # gone, a link, a socket
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def seal_dir(src: Path, dest: Path, scope_key: bytes, scope: str, name: str,
             *, chunk_size: int = CHUNK_SIZE, key_version: int = 1) -> int:
    """Seal folder `src` into file `dest` atomically under `scope_key`, which is key version
    `key_version` (written in the header); returns the sealed size in bytes.

    Writes `.<dest>.<random>.tmp` (0600) next to `dest`, fsyncs, renames over `dest`, fsyncs
    the folder. Any failure (or crash) before the rename leaves the previous `dest` untouched.
    """
    src, dest = Path(src), Path(dest)
    header, hdr = _header(scope, name, chunk_size, key_version)
    aes = _file_key(scope_key, hdr)
    with atomic_file(dest, FILE_MODE, buffering=1 << 20) as out:
        out.write(header)
        writer = _SealWriter(out, aes, bytes.fromhex(hdr["prefix"]),
                             hashlib.sha256(header).digest(), chunk_size)
        # copybufsize: a TarFile keyword that open() passes on; typeshed's overloads omit it
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                          bufsize=1 << 20, copybufsize=1 << 20) as tf:
            for rel, st, dfd, leaf in _iter_sources(src):
                # Built by hand (no owner names, no pwd/grp lookups): only what unsealing needs.
                info = tarfile.TarInfo(rel)
                info.mtime = int(st.st_mtime)
                if stat.S_ISDIR(st.st_mode):
                    info.type, info.mode = tarfile.DIRTYPE, DIR_MODE
                    tf.addfile(info)
                else:
                    info.mode = FILE_MODE
                    fh = _open_regular(leaf, dfd)
                    if fh is None:
                        continue
                    with fh:
                        info.size = os.fstat(fh.fileno()).st_size
                        tf.addfile(info, fh)
        writer.finish()
        size = out.tell()
    return size


def _check_member(m: tarfile.TarInfo) -> None:
    name = m.name
    if not (m.isreg() or m.isdir()):
        raise SealError(f"sealed archive holds a link, device or fifo ({ascii(name)[:100]}): refused")
    if (not name or name.startswith("/") or "\\" in name or "\0" in name
            or any(p in ("..", ".", "") for p in name.rstrip("/").split("/"))):
        raise SealError(f"sealed archive holds an unsafe path ({ascii(name)[:100]}): refused")


def unseal_to(sealed: Path, dest: Path, scope_key: bytes | KeyLookup, scope: str, name: str) -> None:
    """Verify and unpack `sealed` into the new folder `dest` (which must not exist), with the
    scope key of the version its header names (`scope_key`: a lookup by version, or the key).

    Unpacks into a temporary 0700 sibling and renames it to `dest` only when every chunk
    verified and the final chunk was seen; on any error the temporary folder is removed and
    SealError is raised, so nothing half-unsealed is ever left behind.
    """
    sealed, dest = Path(sealed), Path(dest)
    if os.path.lexists(dest):
        raise SealError("the unseal destination already exists")
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.unsealing-"))
    unsealed = False
    try:
        os.chmod(tmp, DIR_MODE)
        with open(sealed, "rb", buffering=1 << 20) as fh:
            header, hdr = _read_header(fh, scope, name)
            aes = _file_key(_lookup(scope_key)(hdr["kid"]), hdr)
            reader = _UnsealReader(fh, aes, bytes.fromhex(hdr["prefix"]),
                                   hashlib.sha256(header).digest(), hdr["chunk"])
            try:
                with tarfile.open(fileobj=reader, mode="r|", bufsize=1 << 20) as tf:
                    _extract_all(tf, tmp)
            except tarfile.TarError as exc:
                raise SealError(f"sealed archive is malformed ({type(exc).__name__})") from None
            reader.drain()
            if not reader.finished:
                raise SealError("sealed file is truncated (no final chunk)")
        os.rename(tmp, dest)
        unsealed = True
    finally:
        if not unsealed:    # nothing half-unsealed stays
            shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(dest.parent)


def verify_sealed(sealed: Path, scope_key: bytes | KeyLookup, scope: str, name: str) -> None:
    """Authenticate every chunk of `sealed` without writing anything; raises SealError."""
    with open(sealed, "rb", buffering=1 << 20) as fh:
        header, hdr = _read_header(fh, scope, name)
        aes = _file_key(_lookup(scope_key)(hdr["kid"]), hdr)
        reader = _UnsealReader(fh, aes, bytes.fromhex(hdr["prefix"]),
                               hashlib.sha256(header).digest(), hdr["chunk"])
        while reader.read(1 << 20):
            pass


def reseal(sealed: Path, dest: Path, old_keys: bytes | KeyLookup, new_key: bytes, key_version: int,
           scope: str, name: str) -> tuple[int, int]:
    """Seal the contents of `sealed` again under `new_key` (key version `key_version`) into
    `dest` atomically (`dest` may be `sealed` itself), chunk by chunk: each chunk is verified
    under the key of the version its header names and sealed again with the same plaintext
    and final flag. Nothing is unpacked. Returns (the old key version, the new file's size);
    on any failure `dest` is left as it was."""
    with open(sealed, "rb", buffering=1 << 20) as src:
        old_header, old = _read_header(src, scope, name)
        old_aes = _file_key(_lookup(old_keys)(old["kid"]), old)
        old_digest, old_prefix = hashlib.sha256(old_header).digest(), bytes.fromhex(old["prefix"])
        header, hdr = _header(scope, name, old["chunk"], key_version)
        aes, prefix = _file_key(new_key, hdr), bytes.fromhex(hdr["prefix"])
        digest = hashlib.sha256(header).digest()
        with atomic_file(dest, FILE_MODE, buffering=1 << 20) as out:
            out.write(header)
            index, final = 0, False
            while not final:
                head = src.read(4)
                if len(head) < 4:
                    raise SealError("sealed file is truncated (no final chunk)")
                (length,) = struct.unpack(">I", head)
                if length < TAG_BYTES or length > old["chunk"] + TAG_BYTES:
                    raise SealError(f"sealed file is damaged (chunk {index} has a bad length)")
                ct = src.read(length)
                if len(ct) < length:
                    raise SealError("sealed file is truncated (chunk cut off)")
                plain, final = _open_chunk(old_aes, old_prefix, old_digest, index, ct)
                nonce = prefix + struct.pack(">Q", index)
                new_ct = aes.encrypt(nonce, plain, _aad(digest, index, final))
                out.write(struct.pack(">I", len(new_ct)))
                out.write(new_ct)
                index += 1
            if src.read(1):
                raise SealError("sealed file has data after its final chunk")
            size = out.tell()
    return int(old["kid"]), size


def _extract_all(tf: tarfile.TarFile, root: Path) -> None:
    """Unpack a checked stream of folders and regular files under `root` (a fresh folder).

    Our own loop instead of TarFile.extract: only folders and regular files exist in a
    sealed profile (no links), so every path component is a folder created here, files are
    created with O_EXCL|O_NOFOLLOW (a duplicate member is refused), folders 0700, files 0600.
    """
    made: set[str] = set()

    def folder(rel: str) -> Path:
        path = root.joinpath(*rel.split("/")) if rel else root
        if rel and rel not in made:
            parent, _, _ = rel.rpartition("/")
            folder(parent)
            try:
                os.mkdir(path, DIR_MODE)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise SealError("sealed archive has a folder and a file of one name") from None
            os.chmod(path, DIR_MODE)
            made.add(rel)
        return path

    for member in tf:
        _check_member(member)
        rel = member.name.rstrip("/")
        if member.isdir():
            folder(rel)
            continue
        parent, _, leaf = rel.rpartition("/")
        target = folder(parent) / leaf
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         FILE_MODE)
        except FileExistsError:
            raise SealError(f"sealed archive holds {ascii(rel)[:100]} twice: refused") from None
        with os.fdopen(fd, "wb") as out:
            os.fchmod(fd, FILE_MODE)
            src = tf.extractfile(member)
            if src is None:             # not a regular file: _check_member let only those by
                raise SealError(f"sealed archive member {ascii(rel)[:100]} has no data: refused")
            shutil.copyfileobj(src, out, 1 << 20)
