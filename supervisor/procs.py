"""Processes the guard owns, and how to end them safely (also after a crash).

A `ProcRecord` names a process by pid AND start time (psutil `create_time`), so a pid that the
kernel reused for somebody else's process is never signalled. Records are JSON-serialisable so
the daemon can persist them and the start-up sweep can end what a dead guard left behind.

`scan_orphans` finds browser / agent-browser / mitmproxy processes that mention one of the
guard's runtime paths (in their command line or environment) even when no record survived;
`uid_processes` finds every process of given uids (the browser users: nothing else runs as them).

This module holds the one terminate-wait-kill of the project: `terminate_recorded` for recorded
processes (by pid and start time), `end_child` for an asyncio child the caller started and still
holds, `end_popen` for a `subprocess.Popen` child. And the guard's CPU-priority helpers:
`niced` (start a child at a lower priority) and `renice_all_threads` (give it one back).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

import psutil

#: Start times are floats from /proc; allow for rounding when comparing.
CREATE_TIME_TOLERANCE = 0.05

#: Kinds the guard records: agent-browser daemon, the browser (Chrome main process), the
#: browser's crash handler, a per-run proxy, anything else we started.
KINDS = ("daemon", "browser", "crashpad", "proxy", "other")


@dataclass(frozen=True)
class ProcRecord:
    """A process the guard started (or found): pid + create_time + what it is."""
    pid: int
    create_time: float
    kind: str

    @classmethod
    def of(cls, pid: int, kind: str) -> ProcRecord | None:
        """Record a live process by pid (None when it does not exist)."""
        try:
            return cls(pid, psutil.Process(pid).create_time(), kind)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ProcRecord:
        pid, ct, kind = data["pid"], data["create_time"], data["kind"]
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError("ProcRecord.pid must be a positive integer")
        if not isinstance(ct, (int, float)) or isinstance(ct, bool):
            raise ValueError("ProcRecord.create_time must be a number")
        if kind not in KINDS:
            raise ValueError(f"ProcRecord.kind must be one of {', '.join(KINDS)}")
        return cls(pid, float(ct), kind)

    def process(self) -> psutil.Process | None:
        """The live process this record names, or None (gone, zombie, or pid reused)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > CREATE_TIME_TOLERANCE:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def alive(self) -> bool:
        return self.process() is not None


def _signal(proc: psutil.Process, rec: ProcRecord, sig: int) -> None:
    """Signal the process; a browser that leads its own process group gets the whole group
    (renderers, GPU and zygote processes) - checked against the record first."""
    try:
        if rec.kind == "browser" and os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, psutil.NoSuchProcess, PermissionError, psutil.AccessDenied):
        pass


def terminate_recorded(records: Iterable[ProcRecord], timeout: float = 5.0) -> list[ProcRecord]:
    """End every recorded process that is still alive (pid AND create_time must match).

    SIGTERM first, wait up to `timeout`, then SIGKILL and wait up to 2 s more. Returns the
    records that were alive and were signalled. Never blocks longer than timeout + 2 s.
    """
    live: list[tuple[ProcRecord, psutil.Process]] = []
    for rec in records:
        proc = rec.process()
        if proc is not None:
            live.append((rec, proc))
    for rec, proc in live:
        _signal(proc, rec, signal.SIGTERM)
    _wait_gone([r for r, _ in live], timeout)
    stubborn = [(r, p) for r, p in live if r.alive()]
    for rec, proc in stubborn:
        _signal(proc, rec, signal.SIGKILL)
    _wait_gone([r for r, _ in stubborn], 2.0)
    return [r for r, _ in live]


def wait_gone(records: Iterable[ProcRecord], timeout: float) -> bool:
    """Wait (bounded) until no record is alive; True when all are gone."""
    return _wait_gone(list(records), timeout)


def _wait_gone(records: list[ProcRecord], timeout: float) -> bool:
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        if not any(r.alive() for r in records):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# --------------------------------------------------------------------------- orphan scan

_TOOL_WORDS = ("chrom", "agent-browser", "mitmproxy", "mitmdump", "crashpad")


def _kind_of(cmdline: list[str]) -> str:
    """What a found process is, from its executable name (or, for a Python script, from an
    exact marker argument such as `-m mitmproxy` or the test fake's dummy processes)."""
    exe = os.path.basename(cmdline[0]).lower() if cmdline else ""
    for word, kind in (("crashpad", "crashpad"), ("agent-browser", "daemon"), ("chrom", "browser"),
                       ("mitm", "proxy")):
        if word in exe:
            return kind
    args = set(cmdline[1:])
    if "agent-browser-fake-daemon" in args or any(a.endswith("/agent-browser") for a in args):
        return "daemon"
    if "--fake-chromium" in args:
        return "browser"
    if args & {"mitmproxy", "mitmdump", "mitmproxy.tools.main"} or any("sfguard" in a and "proxy" in a for a in args):
        return "proxy"
    return "other"


def _mentions(marker_res: list[re.Pattern], values: Iterable[str]) -> bool:
    return any(r.search(v) for v in values for r in marker_res)


def scan_orphans(marker_paths: Iterable[str | os.PathLike],
                 uids: Iterable[int | None] = ()) -> list[ProcRecord]:
    """Browser, crash-handler, agent-browser and mitmproxy processes of this user (and of the
    users in `uids`: a root guard's browser user) whose command line or environment mentions
    one of `marker_paths` (a path, or anything below it).

    Used by the start-up sweep (markers: the guard's runtime dir) and by tests. Only processes
    whose command line names one of those tools are considered, so the guard's own daemon
    (whose env may name the same dirs) is not reported. The calling process is skipped.
    """
    markers = [os.fspath(m).rstrip("/") for m in marker_paths if os.fspath(m).strip("/")]
    if not markers:
        return []
    marker_res = [re.compile(re.escape(m) + r"(?=$|[/\s,;:=\"'])") for m in markers]
    me = os.getpid()
    owners = {os.getuid(), *(u for u in uids if u is not None)}
    found: list[ProcRecord] = []
    for proc in psutil.process_iter(["pid", "cmdline", "uids", "create_time", "status"]):
        info = proc.info
        try:
            if info["pid"] == me or info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if info["uids"] is None or info["uids"].real not in owners:
                continue
            cmdline = info["cmdline"] or []
            head = " ".join(cmdline).lower()
            if not any(w in head for w in _TOOL_WORDS):
                continue
            hit = _mentions(marker_res, cmdline)
            if not hit:
                try:
                    hit = _mentions(marker_res, proc.environ().values())
                except (psutil.AccessDenied, psutil.ZombieProcess):
                    hit = False
            if hit:
                found.append(ProcRecord(info["pid"], info["create_time"], _kind_of(cmdline)))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def uid_processes(uids: Iterable[int]) -> list[ProcRecord]:
    """Every live process whose real, effective or saved uid is one of `uids`, read from
    /proc/PID/status (a browser's sandboxed processes are not dumpable, so the owner of
    /proc/PID is no guide). Zombies and the calling process are skipped."""
    want = {int(u) for u in uids}
    if not want:
        return []
    me, found = os.getpid(), []
    try:
        names = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        names = [str(p.pid) for p in psutil.process_iter()]
    for name in names:
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                status = fh.read(4096)
        except OSError:
            continue
        ids: set[int] = set()
        zombie = False
        for line in status.splitlines():
            if line.startswith(b"State:"):
                zombie = b"(zombie)" in line
            elif line.startswith(b"Uid:"):
                ids = {int(x) for x in line.split()[1:4]}
                break
        if zombie or int(name) == me or not ids & want:
            continue
        try:
            proc = psutil.Process(int(name))
            found.append(ProcRecord(proc.pid, proc.create_time(), _kind_of(proc.cmdline())))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _signal_child(pid: int, sig: int, group: bool) -> None:
    """Signal a child we started and hold (its pid cannot be reused while it is unreaped);
    with `group`, also its own process group (a child started with start_new_session)."""
    targets = ((os.killpg, pid), (os.kill, pid)) if group else ((os.kill, pid),)
    for fn, target in targets:
        try:
            fn(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


class HeldChild(Protocol):
    """A child the guard holds a handle on: an asyncio child, or a proxy forked by the zygote
    (supervisor/daemon/proxy_zygote.py), which is signalled through its pidfd."""
    pid: int

    @property
    def returncode(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    async def wait(self) -> int: ...


def _signal_held(proc: HeldChild, sig: int, group: bool) -> None:
    """Signal a child through its own handle (an asyncio child, or a proxy the zygote forked,
    signalled through its pidfd), and with `group` its process group too."""
    if group:
        _signal_child(proc.pid, sig, True)
        return
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


async def end_child(proc: HeldChild, timeout: float = 5.0, *,
                    group: bool = False, kill_wait: float = 5.0) -> bool:
    """End an asyncio child: SIGTERM, wait up to `timeout`, then SIGKILL and wait up to
    `kill_wait`. `timeout` 0 sends SIGKILL at once. True when the child has exited."""
    if proc.returncode is not None:
        return True
    if timeout > 0:
        _signal_held(proc, signal.SIGTERM, group)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
            return True
        except TimeoutError:
            pass
    _signal_held(proc, signal.SIGKILL, group)
    try:
        await asyncio.wait_for(proc.wait(), kill_wait)
    except TimeoutError:
        return False
    return True


def end_popen(proc: subprocess.Popen, timeout: float = 5.0, *, group: bool = False,
              kill_wait: float = 5.0) -> bool:
    """`end_child` for a `subprocess.Popen` child (same steps, blocking)."""
    if proc.poll() is not None:
        return True
    if timeout > 0:
        _signal_child(proc.pid, signal.SIGTERM, group)
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            pass
    _signal_child(proc.pid, signal.SIGKILL, group)
    try:
        proc.wait(kill_wait)
    except subprocess.TimeoutExpired:
        return False
    return True


#: coreutils' `nice`, by absolute path only (never looked up on a PATH)
NICE_BINARIES = ("/usr/bin/nice", "/bin/nice")


def niced(argv: list[str], nice: int) -> list[str]:
    """`argv` started at niceness `nice` through coreutils' `nice` (which execs it in the same
    process: no window at the caller's priority); `argv` itself when `nice` is 0 or no `nice`
    binary exists."""
    nice_bin = next((b for b in NICE_BINARIES if os.access(b, os.X_OK)), None) if nice else None
    return [nice_bin, "-n", str(nice), *argv] if nice_bin else list(argv)


def renice_all_threads(pid: int, niceness: int) -> None:
    """Set every thread of `pid` to `niceness` (Linux applies a niceness per thread). Best
    effort: a thread that ended meanwhile, or a refusal, leaves the rest as they are."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:
            continue
