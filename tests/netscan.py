"""Which processes listen on TCP: read /proc/net/tcp and tcp6 (state 0A = LISTEN), map each
socket inode to the processes holding it through /proc/PID/fd. Used to prove that no browser
the guard started has a DevTools (or any other) port."""
from __future__ import annotations

import os

import psutil


def listening_inodes() -> dict[int, str]:
    """inode -> "addr:port" (hex, as the kernel prints it) of every listening TCP socket."""
    out: dict[int, str] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A":
                out[int(f[9])] = f[1]
        # (a socket of another network namespace would not be listed: these tests run in one)
    return out


def socket_inodes_of(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def process_tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.Error:
        return []


def listening_ports_of_tree(pid: int) -> dict[int, list[str]]:
    """pid -> listening sockets ("addr:port" hex) held by `pid` or any of its descendants."""
    listen = listening_inodes()
    found: dict[int, list[str]] = {}
    for p in process_tree(pid):
        hits = [listen[i] for i in socket_inodes_of(p) if i in listen]
        if hits:
            found[p] = hits
    return found
