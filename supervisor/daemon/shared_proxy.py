"""One guard proxy process for many runs (`sfguard start --proxies shared`).

The default is a proxy process per run (run_proxy.RunProxy, docs/design.md 4.2). Shared, one
process (started, or forked from the zygote, exactly as a run's proxy is) serves every run, and
each run keeps what the per-run process gave it:

- its own listener: a port of its own in that process, chosen by the guard and kept for the
  run's life (its browsers and its stage bridge are pointed at it);
- its own credentials, bound to that listener: a run's client is refused (407) on any other
  run's port (`Client.port`, checked by the proxy's ConnectGuard);
- its own decision log lines (every line names its client's run);
- at its end its listener closes and every connection that came in through it is cut, as the
  end of its own process did.

A crash of the shared process fails every run closed (browsers get connection errors, never a
direct route); the watchdog restarts it once, on the same ports with every run's clients.

`SharedRunProxy` has RunProxy's interface, so the daemon (stages, teardown, watchdog, logins)
does not know which of the two a run has.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

from sfguard.supervisor.daemon.proxy_zygote import ForkedProxy, Zygote
from sfguard.supervisor.daemon.run_proxy import (
    PaceSetting,
    ProxyPool,
    RunClients,
    RunProxy,
    client_specs,
    short_id,
)
from sfguard.supervisor.errors import BrowserStartError, swallowed
from sfguard.supervisor.home import private_dir
from sfguard.supervisor.procs import ProcRecord

log = logging.getLogger("sfguard.guard")

#: how many free ports a run tries when the one it picked was taken in the meantime
PORT_TRIES = 5


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the proxy opens it next; a race is retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SharedProxy(RunProxy):
    """The one proxy process of every run (see the module docstring); it has no clients of its
    own: each message carries every member run's clients and listener ports."""

    def __init__(self, policy_path: Path, decision_log: Path, resolve: dict[str, str] | None = None,
                 zygote: Zygote | None = None, pace: PaceSetting | None = None):
        super().__init__(None, policy_path, decision_log, resolve, zygote, pace)
        self.members: dict[str, SharedRunProxy] = {}   # key -> the run's part
        self.failed_ports: set[int] = set()            # listeners the process could not open
        self._start_lock = asyncio.Lock()

    def _message(self) -> dict:
        members = [m for m in self.members.values() if m.port]
        return {"clients": [c for m in members
                            for c in client_specs(m.run_id, m.clients, m.client_writes, m.port, m.client_held,
                                                  m.client_pace)],
                "listeners": sorted(m.port for m in members)} | self.pace.message()

    async def push(self) -> None:
        answer = await self._push()
        if answer:
            self.failed_ports = set(answer.get("failed") or ())

    async def ensure_running(self) -> None:
        """Start the process, or start it again (same base port) if it died."""
        async with self._start_lock:
            if self.alive():
                return
            if self.proc is not None:
                with swallowed(log, "stopping the dead shared proxy"):
                    await RunProxy.stop(self)
            await RunProxy.start(self)
            await self.push()    # every member's listener and clients, at once

    async def close(self) -> None:
        self.members.clear()
        await RunProxy.stop(self)


class SharedRunProxy(RunClients):
    """One run's part of the shared proxy: RunProxy's interface over SharedProxy."""

    def __init__(self, host: SharedProxy, run_id: str | None):
        self.host = host
        self.run_id = run_id
        self.key = short_id()
        self.port = 0
        self.clients: dict[str, tuple[str, list[str]]] = {}
        self.client_writes: dict[str, str] = {}
        self.client_held: set[str] = set()
        self.client_pace: dict[str, tuple[str, list[dict]]] = {}

    # -- what the daemon reads ---------------------------------------------------------------
    @property
    def proc(self) -> asyncio.subprocess.Process | ForkedProxy | None:
        return self.host.proc

    @property
    def record(self) -> ProcRecord | None:
        return self.host.record

    @property
    def pace(self) -> PaceSetting:
        return self.host.pace

    @property
    def restarts(self) -> int:
        """The shared process's restarts: each of them was one for this run too."""
        return self.host.restarts

    @restarts.setter
    def restarts(self, value: int) -> None:
        self.host.restarts = value

    def alive(self) -> bool:
        return (self.host.alive() and self.key in self.host.members
                and self.port not in self.host.failed_ports)

    def to_guard_priority(self) -> None:
        """The shared process always runs at the guard's priority."""

    async def _sync(self) -> None:
        """Every change (RunClients) goes out with every run's clients and listeners."""
        await self.host.push()

    async def start(self, nice: int = 0) -> None:
        """Open this run's listener (the process started first if it is not running). A port
        chosen here and taken by another program in the meantime is replaced by another; a
        port the run already had (its browsers point at it) is kept."""
        await self.host.ensure_running()
        fixed = self.port != 0
        for _ in range(1 if fixed else PORT_TRIES):
            if not fixed:
                self.port = free_port()
            self.host.members[self.key] = self
            await self.host.push()
            if self.port not in self.host.failed_ports:
                return
        del self.host.members[self.key]
        raise BrowserStartError("the run's guard proxy could not open a listener")

    async def stop(self) -> None:
        """Close this run's listener and every connection that came in through it."""
        if self.host.members.pop(self.key, None) is None:
            return
        with swallowed(log, f"closing the listener of run {self.run_id}"):
            await self.host.push()


class SharedPool:
    """ProxyPool's interface for the shared process: `take` opens a run's listener in it."""

    def __init__(self, policy_path: Path, decision_log: Path, resolve: dict[str, str],
                 pace: PaceSetting | None = None):
        self.zygote = Zygote(policy_path, decision_log)
        self.host = SharedProxy(policy_path, decision_log, resolve, self.zygote, pace)
        self.pace = pace or PaceSetting()

    async def take(self, run_id: str) -> SharedRunProxy:
        proxy = SharedRunProxy(self.host, run_id)
        await proxy.start()
        return proxy

    def refill(self) -> None:
        """Nothing to start ahead: a run's listener opens in the running process in ms."""

    async def stop(self) -> None:
        await self.host.close()
        await self.zygote.stop()


#: what a run has, and what hands it out: either kind (the daemon uses their common interface)
AnyRunProxy = RunProxy | SharedRunProxy
AnyPool = ProxyPool | SharedPool


def pace_setting(home: Path, stores: object) -> PaceSetting:
    """Where the runs' proxies count pace and budgets: the home's `pace` folder (0700), and the
    shared store's connection when the guard has one (supervisor/profiles/pg_pace.py)."""
    backend = getattr(stores, "backend", None)
    return PaceSetting(private_dir(home / "pace"), getattr(backend, "url", None),
                       home / "logs" / "decisions.log")


def proxy_pool(mode: str, policy_path: Path, decision_log: Path, resolve: dict[str, str],
               pace: PaceSetting | None = None) -> AnyPool:
    """The guard's runs' proxies for `sfguard start --proxies MODE`, every one forked from one
    pre-loaded parent (supervisor/daemon/proxy_zygote.py): "per-run" (a process per run, one
    started ahead) or "shared" (one process, a listener per run); `pace`: where they count."""
    if mode == "shared":
        return SharedPool(policy_path, decision_log, resolve, pace)
    return ProxyPool.forked(policy_path, decision_log, resolve, pace)
