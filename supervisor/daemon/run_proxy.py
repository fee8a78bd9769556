"""The guard proxy of a run, and the pool that keeps one started ahead.

Each run gets its own `python -m sfguard.supervisor.daemon.proxy_child` process (its own port
and clients); starting one takes ~0.7 s of CPU, so `ProxyPool` keeps one spare started ahead and
hands it to the next run. The spare starts at the lowest CPU priority (niceness 19) where the
guard may raise it again when a run takes it (root, or an RLIMIT_NICE that allows it): a refill
then runs on what the browsers of the run that just started leave idle, instead of competing
with their launch on a small machine.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sfguard.supervisor import redaction
from sfguard.supervisor.daemon.proxy_zygote import ForkedProxy, Zygote, ZygoteError
from sfguard.supervisor.daemon.proxy_zygote import enabled as zygote_enabled
from sfguard.supervisor.errors import BrowserStartError, swallowed
from sfguard.supervisor.procs import ProcRecord, end_child, niced, renice_all_threads

log = logging.getLogger("sfguard.guard")

PROXY_START_TIMEOUT = 20.0
#: the niceness a spare proxy starts at (when the guard can raise it back, see `can_renice`)
SPARE_PROXY_NICE = 19


@dataclass(frozen=True)
class PaceSetting:
    """Where a run's proxy keeps the pace counters: `folder` on this host (budgets, and the
    sites' pace without a shared store), and the shared store's connection string, sent over
    the proxy's stdin (never argv or a file) so every guard host counts one pace."""
    folder: Path | None = None
    shared_url: str | None = field(default=None, repr=False)
    #: where the guard's own pace lines go (the browser side, supervisor/daemon/pacing.py)
    decision_log: Path | None = None

    def message(self) -> dict:
        return {"pace_store": self.shared_url} if self.shared_url else {}


def can_renice(niceness: int) -> bool:
    """Whether this process may give a child at `niceness` its own priority back: root (or
    CAP_SYS_NICE), or an RLIMIT_NICE that reaches the guard's own niceness."""
    if niceness <= 0:
        return True
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)   # allowed ceiling: 20 - soft
    return 20 - soft <= os.getpriority(os.PRIO_PROCESS, 0)


def short_id() -> str:
    return secrets.token_hex(4)


def child_argv(port: int, policy_path: Path, decision_log: Path, resolve: dict[str, str],
               run: str | None = None, pace_dir: Path | None = None) -> list[str]:
    """How a run's proxy process is started (by the daemon, and by bench/proxy_bench.py, which
    measures exactly this). Optimised (`-O`): mitmproxy's debug-only checks (a type check of
    every field of every HTTP message it builds, an event-type assertion around every layer
    handler) do not run per connection; measured with proxy_bench, CPU per tunnel 0.69x -> 0.49x
    of bare mitmdump. Nothing of ours checks anything with `assert`."""
    return [sys.executable, "-O", "-m", "sfguard.supervisor.daemon.proxy_child",
            *proxy_args(port, policy_path, decision_log, resolve, run, pace_dir)]


def proxy_args(port: int, policy_path: Path, decision_log: Path, resolve: dict[str, str],
               run: str | None = None, pace_dir: Path | None = None) -> list[str]:
    """The arguments of `proxy_child.main`, whether it is started as its own process or forked
    from the zygote (`pace_dir`: the pace counters of this host, proxy_addons/pacing.py)."""
    argv = ["--listen-port", str(port), "--policy", str(policy_path), "--decision-log", str(decision_log)]
    if run is not None:
        argv += ["--run", run]
    if pace_dir is not None:
        argv += ["--pace-dir", str(pace_dir)]
    for host, ip in resolve.items():
        argv += ["--resolve", f"{host}={ip}"]
    return argv


def client_specs(run_id: str | None, clients: dict[str, tuple[str, list[str]]],
                 writes: dict[str, str], port: int | None = None, held: set[str] | None = None,
                 pace: dict[str, tuple[str, list[dict]]] | None = None) -> list[dict]:
    """A run's clients as the proxy child takes them (each bound to `port` when given; the
    `held` ones refused everything until the guard lets them go; `pace`: whose pace each
    counts on and the budgets of its stages)."""
    pace = pace or {}
    return [{"name": n, "token": t, "allow": a, "run": run_id}
            | ({"writes": writes[n]} if n in writes else {})
            | ({"port": port} if port is not None else {})
            | ({"held": True} if held and n in held else {})
            | ({"pace_key": pace[n][0], "budgets": pace[n][1]} if n in pace else {})
            for n, (t, a) in sorted(clients.items())]


class RunClients:
    """A run's proxy clients (one per browser or stage shell, each with its own credential and
    allowlist) and its listener port; each change is live in the proxy before it returns
    (`_sync`). Shared by RunProxy (a process of its own) and shared_proxy.SharedRunProxy."""

    port: int
    run_id: str | None
    clients: dict[str, tuple[str, list[str]]]   # name -> (token, allow patterns)
    client_writes: dict[str, str]              # a stage shell's client -> the stage's browser.writes
    #: browsers the guard has not yet put under its rules: every request refused
    client_held: set[str]
    #: whose pace each client counts on (its profile), and its stages' budgets (pacing.py)
    client_pace: dict[str, tuple[str, list[dict]]]

    async def _sync(self) -> None:
        raise NotImplementedError

    async def add_client(self, allow: list[str], writes: str | None = None, held: bool = False,
                         pace_key: str | None = None, budgets: list[dict] | None = None) -> str:
        """A client with its own credential; `writes` (a stage's shell): hosts whose writes are
        gated or refused for the stage are refused to it (proxy_addons/clients.py); `held` (a
        browser about to start): every request refused until `set_allow` lets it go;
        `pace_key`: the profile (or throw-away browser) whose pace its requests count on."""
        name = f"b-{short_id()}"
        token = secrets.token_urlsafe(24)
        redaction.register_secret(token)
        self.clients[name] = (token, sorted(set(allow)))
        if writes is not None:
            self.client_writes[name] = writes
        if held:
            self.client_held.add(name)
        if pace_key is not None:
            self.client_pace[name] = (pace_key, list(budgets or []))
        await self._sync()
        return name


    async def set_allow(self, name: str, allow: list[str], budgets: list[dict] | None = None) -> None:
        """The client's allow list (and with `budgets`, its stages' budgets), in force when this
        returns; a held client is let go (the guard calls it once the browser's rules are in
        force)."""
        token, old = self.clients[name]
        new = sorted(set(allow))
        pace = self.client_pace.get(name)
        budgets_changed = budgets is not None and pace is not None and pace[1] != budgets
        if budgets_changed and pace is not None and budgets is not None:
            self.client_pace[name] = (pace[0], list(budgets))
        if new != old or name in self.client_held or budgets_changed:
            self.clients[name] = (token, new)
            self.client_held.discard(name)
            await self._sync()

    async def remove_client(self, name: str) -> None:
        self.client_writes.pop(name, None)
        self.client_held.discard(name)
        self.client_pace.pop(name, None)
        if self.clients.pop(name, None) is not None:
            await self._sync()

    def url_for(self, name: str) -> str:
        return f"http://{name}:{self.clients[name][0]}@127.0.0.1:{self.port}"


class RunProxy(RunClients):
    """The guard proxy child of one run (`python -m sfguard.supervisor.daemon.proxy_child`).

    Clients (one per browser, each with its own credentials and allowlist) are sent over the
    child's stdin and acknowledged once live, so an allowlist change is in force before the
    daemon answers; tokens are never in argv, files or logs. If the child dies it is restarted
    on the same port with the same clients, so browsers only ever see connection errors."""

    ACK_TIMEOUT = 10.0

    def __init__(self, run_id: str | None, policy_path: Path, decision_log: Path,
                 resolve: dict[str, str] | None = None, zygote: Zygote | None = None,
                 pace: PaceSetting | None = None):
        self.run_id = run_id
        self.zygote = zygote   # forks the process when given (supervisor/daemon/proxy_zygote.py)
        self.policy_path = policy_path
        self.decision_log = decision_log
        self.pace = pace or PaceSetting()
        self.client_pace: dict[str, tuple[str, list[dict]]] = {}
        self.resolve = dict(resolve or {})
        self.port = 0
        self.proc: asyncio.subprocess.Process | ForkedProxy | None = None
        self.record: ProcRecord | None = None
        self.clients: dict[str, tuple[str, list[str]]] = {}  # name -> (token, allow patterns)
        self.client_writes: dict[str, str] = {}   # a stage shell's client -> the stage's browser.writes
        self.client_held: set[str] = set()        # browsers not yet under the guard's rules
        self.restarts = 0
        self._seq = 0
        self._acks: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._urgent = False   # a run waits for this proxy: no lower priority from then on

    def _message(self) -> dict:
        return {"clients": client_specs(self.run_id, self.clients, self.client_writes, held=self.client_held,
                                        pace=self.client_pace)} | self.pace.message()

    async def _push(self) -> dict:
        """Send the whole client set and wait until the proxy has it live; the proxy's answer."""
        if self.proc is None or self.proc.returncode is not None:
            return {}  # the watchdog restarts it with the current set
        async with self._lock:
            self._seq += 1
            fut = asyncio.get_running_loop().create_future()
            self._acks[self._seq] = fut
            msg = {"id": self._seq} | self._message()
            stdin = self.proc.stdin
            assert stdin is not None  # started with stdin=PIPE
            try:
                stdin.write(json.dumps(msg).encode() + b"\n")
                await stdin.drain()
                return dict(await asyncio.wait_for(fut, self.ACK_TIMEOUT))
            except (TimeoutError, ConnectionError) as exc:
                raise BrowserStartError("the run's guard proxy did not take the new allowlist "
                                   f"({type(exc).__name__})") from None
            finally:
                self._acks.pop(self._seq, None)

    async def _sync(self) -> None:
        await self._push()

    async def start(self, nice: int = 0) -> None:
        """Start the child (at niceness `nice`, through coreutils' `nice`, which execs it in the
        same process) and wait for its "ready" line."""
        self.proc = None
        if self.zygote is not None and zygote_enabled():
            try:
                self.proc = await self.zygote.spawn(
                    proxy_args(self.port, self.policy_path, self.decision_log, self.resolve,
                               pace_dir=self.pace.folder), nice)
            except ZygoteError as exc:
                log.warning("%s; starting the run's proxy as a process of its own", exc)
        if self.proc is None:
            argv = niced(child_argv(self.port, self.policy_path, self.decision_log, self.resolve,
                                    pace_dir=self.pace.folder), nice)
            env = {k: v for k, v in os.environ.items()
                   if k in ("PATH", "HOME", "LANG", "TMPDIR", "SFGUARD_HOME", "PYTHONPATH",
                            redaction.LOG_FORMAT_ENV)}
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=None, env=env, start_new_session=True)
        if nice and self._urgent:   # taken while it was being spawned
            self.to_guard_priority()
        self.record = ProcRecord.of(self.proc.pid, "proxy")
        assert self.proc.stdout is not None  # started with stdout=PIPE
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), PROXY_START_TIMEOUT)
        except TimeoutError:
            line = b""
        text = line.decode(errors="replace").strip()
        if not text.startswith("ready http://127.0.0.1:"):
            await self.stop()
            raise BrowserStartError("the run's guard proxy did not start")
        self.port = int(text.rsplit(":", 1)[1])
        self._reader = asyncio.get_running_loop().create_task(self._read_acks(self.proc))
        if self.clients:
            await self._push()

    async def _read_acks(self, proc: asyncio.subprocess.Process | ForkedProxy) -> None:
        assert proc.stdout is not None
        with swallowed(log, "reading the run proxy's answers"):
            while line := await proc.stdout.readline():
                msg = json.loads(line)
                fut = self._acks.get(msg.get("ack"))
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def to_guard_priority(self) -> None:
        """Back to the guard's own CPU priority (a spare started at a lower one)."""
        self._urgent = True
        if self.proc is not None and self.proc.returncode is None:
            renice_all_threads(self.proc.pid, os.getpriority(os.PRIO_PROCESS, 0))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and (
            self.record is None or self.record.alive())

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if proc is None:
            return
        await end_child(proc, 5)
        if isinstance(proc, ForkedProxy):
            proc.close()


class ProxyPool:
    """Run proxies for new runs: the warm spare when one is ready, else a new one; at most one
    spare is kept, started in the background at a low CPU priority (`SPARE_PROXY_NICE`) and
    given the guard's priority when a run takes it. A run that finds the spare still starting
    waits for it (it is further along than a new start would be)."""

    def __init__(self, make: Callable[[], RunProxy], spare_nice: int | None = None):
        self._make = make
        self._spare: RunProxy | None = None      # a started proxy child not yet given to a run
        self._task: asyncio.Task[None] | None = None
        self._starting: RunProxy | None = None   # the spare the task is starting
        self._stopping = False
        if spare_nice is None:
            spare_nice = SPARE_PROXY_NICE if can_renice(SPARE_PROXY_NICE) else 0
        self.spare_nice = spare_nice
        self.zygote: Zygote | None = None     # stopped with the pool (see `forked`)
        self.pace = PaceSetting()             # where its proxies count pace (see `forked`)

    @classmethod
    def forked(cls, policy_path: Path, decision_log: Path, resolve: dict[str, str],
               pace: PaceSetting | None = None) -> ProxyPool:
        """The guard's pool: every run's proxy forked from one zygote, which ends with the pool."""
        zygote = Zygote(policy_path, decision_log)
        pool = cls(lambda: RunProxy(None, policy_path, decision_log, resolve, zygote, pace))
        pool.zygote = zygote
        pool.pace = pace or PaceSetting()
        return pool

    async def take(self, run_id: str) -> RunProxy:
        if self._spare is None and self._task is not None and not self._task.done():
            starting = self._starting
            if starting is not None:      # under way: at the guard's priority from now on
                starting.to_guard_priority()
            with contextlib.suppress(TimeoutError):   # _make_spare logs its own failures
                await asyncio.wait_for(asyncio.shield(self._task), PROXY_START_TIMEOUT)
        spare, self._spare = self._spare, None
        if spare is not None and spare.alive():
            proxy = spare
            proxy.to_guard_priority()
        else:
            if spare is not None:
                await spare.stop()
            proxy = self._make()
            await proxy.start()
        proxy.run_id = run_id
        return proxy

    def refill(self) -> None:
        if self._spare is not None or self._stopping:
            return  # one warm spare at most
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._make_spare())

    async def _make_spare(self) -> None:
        proxy = self._starting = self._make()
        try:
            await proxy.start(nice=self.spare_nice)
        except (BrowserStartError, OSError, ValueError) as exc:   # did not start, could not be spawned
            log.warning("could not start a spare run proxy: %s", exc)
            return
        finally:
            self._starting = None
        if self._stopping or self._spare is not None:
            await proxy.stop()   # never overwrite (and so lose) a spare that is still running
        else:
            self._spare = proxy

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await self._task      # _make_spare catches and logs its own failures
        if self._spare is not None:
            await self._spare.stop()
            self._spare = None
        if self.zygote is not None:
            await self.zygote.stop()
