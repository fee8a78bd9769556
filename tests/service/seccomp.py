"""A seccomp filter like the one systemd builds for `SystemCallFilter=~@group ...` with
`SystemCallErrorNumber=EPERM`, for bubblewrap's `--seccomp FD` (the service tests apply the
unit's restrictions without systemd as PID 1). The groups' members are systemd's own
(`systemd-analyze syscall-filter`); libseccomp (systemd's dependency) compiles the filter."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import subprocess
import tempfile
from typing import IO

SCMP_ACT_ALLOW = 0x7FFF0000


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


def group_members(group: str) -> list[str]:
    """The system calls of a systemd group (nested groups expanded)."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", group], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    names: list[str] = []
    for line in out.splitlines()[1:]:
        word = line.strip()
        if not word or word.startswith("#"):
            continue
        names += group_members(word) if word.startswith("@") else [word]
    return names


def deny_filter(groups: list[str]) -> IO[bytes]:
    """A file holding the BPF program that answers EPERM to every call of `groups` (those this
    architecture does not have are skipped, as systemd does) and lets all others through."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    assert ctx, "seccomp_init failed"
    denied = 0
    try:
        for name in sorted({n for g in groups for n in group_members(g)}):
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue
            assert lib.seccomp_rule_add(ctx, _errno_action(errno.EPERM), nr, 0) == 0, name
            denied += 1
        assert denied > 20, f"only {denied} calls denied: the groups were not read"
        out = tempfile.TemporaryFile()
        assert lib.seccomp_export_bpf(ctx, out.fileno()) == 0
        out.seek(0)
        return out
    finally:
        lib.seccomp_release(ctx)
