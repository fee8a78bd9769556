"""Run a guard proxy: a lean mitmproxy master with the guard addons.

Used in-process (the daemon) and by `sfguard proxy` (the CLI):

    proxy = GuardProxy(GuardConfig(policy_path=..., resolve={...}), clients=[client, ...])
    host, port = await proxy.start()     # accepting connections when this returns
    proxy.registry.add(make_client("run-2", token, ["*.example.com"], run="r2"))
    proxy.status()                       # GuardStatus: listen address, clients, policy state
    await proxy.stop()                   # listener closed, every connection dropped

The master carries only what the guard needs: mitmproxy's `Proxyserver` plus the guard's own
addons (LayerGuard replaces mitmproxy's NextLayer; no TlsConfig, so there is no CA and TLS can
never be intercepted; no flow storage, no dumper, no script loader).

mitmproxy keeps its master in a process-wide `ctx`: run at most ONE GuardProxy per process
(one proxy serves many clients through its ClientRegistry; use `sfguard proxy` subprocesses
for more).
"""
from __future__ import annotations

# ruff: noqa: E402 (every import after the first must follow _lean_import.install())
import asyncio
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sfguard.proxy_addons import _lean_import, versions

#: why this proxy will not start (another mitmproxy or h11 than the tested one), or None
UNTESTED = versions.untested()
if UNTESTED is None:
    _lean_import.install()  # before any mitmproxy import: skip mitmproxy's default addon set

from mitmproxy import options
from mitmproxy.addons import proxyserver
from mitmproxy.master import Master
from mitmproxy.proxy import mode_specs

from sfguard import policy
from sfguard.errors import SfguardError
from sfguard.proxy_addons import dispatch
from sfguard.proxy_addons.address_guard import AddressGuard
from sfguard.proxy_addons.clients import Client, ClientRegistry
from sfguard.proxy_addons.connect_guard import ConnectGuard
from sfguard.proxy_addons.connection_guard import ConnectionGuard
from sfguard.proxy_addons.decision_log import DecisionLog
from sfguard.proxy_addons.layer_guard import LayerGuard
from sfguard.proxy_addons.pacing import FilePaceStore, MemoryPaceStore, Pacer, PaceStore
from sfguard.proxy_addons.policy_watch import PolicyReloader, PolicySnapshot, PolicyStatus
from sfguard.proxy_addons.state import GuardState, Resolver

logger = logging.getLogger("sfguard.proxy")


class GuardStartError(SfguardError):
    """The proxy could not start (bad listen address, port in use, ...)."""


@dataclass
class GuardConfig:
    """How to run one guard proxy. `listen_port=0` picks a free port."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    listen_public: bool = False            # allow a non-loopback listen address
    policy_path: Path | None = None        # None: the shipped policy/sites.yaml
    resolve: dict[str, list[str]] = field(default_factory=dict)  # normalised host -> IPs
    decision_log: str | None = None        # None, "-" (stdout) or a file path (append, 0600)
    run: str | None = None                 # run id for log lines of clients without their own
    head_timeout: float = 10.0             # seconds to finish the first request head
    max_head_bytes: int = 64 * 1024        # largest request head accepted (CONNECT, HTTP, tunnel)
    max_header_count: int = 128            # most header lines in one request head
    policy_poll_interval: float = 0.25     # seconds between policy file checks
    quiet_flush_interval: float = 60.0     # seconds between quiet-denial aggregate lines
    pace_dir: str | None = None            # the pace counters' folder (None: in this process)

    def check(self) -> None:
        """Validate; raise GuardStartError with a one-line message."""
        try:
            ip = ipaddress.ip_address(self.listen_host)
        except ValueError:
            raise GuardStartError(
                f"listen address {self.listen_host!r} must be an IP address, e.g. 127.0.0.1") from None
        if not ip.is_loopback and not self.listen_public:
            raise GuardStartError(
                f"listen address {self.listen_host} is not loopback; pass --listen-public to "
                "accept connections from other machines")
        if not 0 <= self.listen_port <= 65535:
            raise GuardStartError(f"listen port {self.listen_port} is out of range")


@dataclass(frozen=True)
class GuardStatus:
    """A snapshot for `sfguard status`: no secrets."""

    listening: tuple[str, int] | None
    clients: list[str]
    policy: PolicySnapshot
    open_connections: int
    decisions: dict[str, int]


class GuardProxy:
    """One guard proxy (see the module docstring)."""

    def __init__(self, config: GuardConfig, clients: Iterable[Client] | ClientRegistry = ()) -> None:
        config.check()
        self.config = config
        self.registry = clients if isinstance(clients, ClientRegistry) else ClientRegistry(clients)
        self.policy_path = Path(config.policy_path or policy.default_policy_path())
        site = policy.load_policy(self.policy_path)  # raises policy.PolicyError
        self.policy_status = PolicyStatus(site, self.policy_path)
        self._master: Master | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self.address: tuple[str, int] | None = None
        self.decision_log: DecisionLog | None = None
        self.state: GuardState | None = None
        self._base_modes: list[mode_specs.ProxyMode] = []
        #: listeners of runs beside the first one (a proxy shared by many runs): port -> mode
        self._extra: dict[int, mode_specs.ProxyMode] = {}
        local: PaceStore = FilePaceStore(config.pace_dir) if config.pace_dir else MemoryPaceStore()
        #: the pace and budgets (proxy_addons/pacing.py); `use_shared_pace` puts the sites'
        #: rates on a store every guard host shares
        self.pacer = Pacer(local=local)
        self.shared_pace: str | None = None     # what `use_shared_pace` was given (never shown)

    def use_shared_pace(self, store: PaceStore, ident: str) -> None:
        """Count the sites' pace on `store` (the shared PostgreSQL store, `ident` its connection
        string) from now on."""
        self.pacer.shared, self.shared_pace = store, ident

    @property
    def url(self) -> str:
        if self.address is None:
            raise RuntimeError("the guard proxy is not started")
        return "http://" + policy.join_host_port(*self.address)

    async def start(self) -> tuple[str, int]:
        """Start listening; returns (host, port). Raises GuardStartError."""
        if self._master is not None:
            raise GuardStartError("already started")
        if UNTESTED is not None:         # fail closed: proxy_addons/versions.py
            raise GuardStartError(UNTESTED)
        self.decision_log = DecisionLog(self.config.decision_log)
        self.state = GuardState(
            self.registry, self.policy_status, Resolver(self.config.resolve), self.decision_log,
            run=self.config.run, head_timeout=self.config.head_timeout,
            max_head_bytes=self.config.max_head_bytes, max_header_count=self.config.max_header_count,
            pacer=self.pacer)

        opts = options.Options()
        master = Master(opts, event_loop=asyncio.get_running_loop())
        dispatch.install(master)  # call only the hooks that exist (measured: see dispatch.py)
        ps = proxyserver.Proxyserver()
        master.addons.add(
            ps,
            LayerGuard(self.state),
            ConnectionGuard(self.state),
            ConnectGuard(self.state),
            AddressGuard(self.state),
            PolicyReloader(self.policy_status, self.policy_path, self.config.policy_poll_interval),
        )
        opts.update(
            mode=["regular"],
            listen_host=self.config.listen_host,
            listen_port=self.config.listen_port,
            connection_strategy="lazy",  # connect only after the guard decided
            http2=False,                 # clients speak HTTP/1.1 to the proxy; h2 in tunnels flows
            http3=False,
            websocket=False,             # browsers tunnel ws:// with CONNECT; plain upgrades close
            rawtcp=False,
        )
        self._master = master
        self._run_task = asyncio.get_running_loop().create_task(master.run(), name="guard proxy")
        ready = asyncio.get_running_loop().create_task(self.state.running.wait())
        done, _ = await asyncio.wait({ready, self._run_task}, timeout=30,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            await self._abort()
            raise GuardStartError("the proxy did not start within 30 s")
        addrs = [a for s in ps.servers for a in s.listen_addrs]
        errors = [s.last_exception for s in ps.servers if s.last_exception]
        if not addrs:
            await self._abort()
            detail = f": {errors[0]}" if errors else ""
            raise GuardStartError(
                f"cannot listen on {policy.join_host_port(self.config.listen_host, self.config.listen_port)}{detail}")
        self.address = (str(addrs[0][0]), int(addrs[0][1]))
        self._base_modes = [s.mode for s in ps.servers]
        self._flush_task = asyncio.get_running_loop().create_task(self._flush_quiet())
        logger.info("guard proxy listening at %s:%d (%s)", *self.address, versions.describe())
        return self.address

    async def set_listeners(self, ports: Iterable[int]) -> list[int]:
        """Listen on exactly these extra ports (on the listen host) beside the first listener,
        each for the clients bound to it (`Client.port`): a proxy that serves many runs gives
        each run its own. A port no longer listed stops listening and every connection that
        came in through it is closed. Returns the ports that could not be listened on."""
        if self._master is None:
            raise GuardStartError("not started")
        ps = self._master.addons.get("proxyserver")
        wanted = {p: self._extra.get(p) or mode_specs.ProxyMode.parse(
            f"regular@{policy.join_host_port(self.config.listen_host, p)}") for p in set(ports)}
        removed = set(self._extra) - set(wanted)
        await ps.servers.update([*self._base_modes, *wanted.values()])
        failed = sorted(p for p, m in wanted.items() if not ps.servers[m].listen_addrs)
        if failed:       # keep no half-started instance: the caller may try another port
            for p in failed:
                del wanted[p]
            await ps.servers.update([*self._base_modes, *wanted.values()])
        self._extra = wanted
        if removed:
            for handler in list(ps.connections.values()):
                if handler.client.proxy_mode.custom_listen_port in removed:
                    io = handler.transports.get(handler.client)
                    if io is not None and io.handler is not None:
                        io.handler.cancel("the run's listener closed")
        return failed

    async def _flush_quiet(self) -> None:
        while True:
            await asyncio.sleep(self.config.quiet_flush_interval)
            if self.decision_log is not None:
                self.decision_log.flush_quiet()

    async def _abort(self) -> None:
        if self._master is not None:
            self._master.shutdown()
        if self._run_task is not None:
            try:
                await asyncio.wait_for(self._run_task, 10)
            except TimeoutError:  # its addons' errors are logged by mitmproxy (safecall), not raised
                logger.warning("the proxy's master did not stop within 10 s")
        if self.decision_log is not None:
            self.decision_log.close()
        self._master = None

    async def stop(self) -> None:
        """Close the listener and every open connection; write the quiet-denial aggregate."""
        master = self._master
        if master is None:
            return
        if self._flush_task is not None:
            self._flush_task.cancel()
        ps = master.addons.get("proxyserver")
        try:
            await asyncio.wait_for(ps.servers.update([]), 10)  # stop listening first (it logs its errors)
        except TimeoutError:  # pragma: no cover - logged, shutdown continues
            logger.error("stopping the listener took over 10 s")
        for handler in list(ps.connections.values()):
            io = handler.transports.get(handler.client)
            if io is not None and io.handler is not None:
                io.handler.cancel("guard proxy stopped")
        await self._abort()
        self.address = None
        for store in {id(self.pacer.shared): self.pacer.shared, id(self.pacer.local): self.pacer.local}.values():
            try:
                await store.close()
            except OSError as exc:  # pragma: no cover - a counter file's close; the shared store logs its own
                logger.warning("closing the pace counters failed: %s", type(exc).__name__)

    def status(self) -> GuardStatus:
        """What `sfguard status` shows: address, client names, policy state, counters."""
        ps = self._master.addons.get("proxyserver") if self._master else None
        return GuardStatus(
            listening=self.address,
            clients=self.registry.names(),
            policy=self.policy_status.snapshot(),
            open_connections=len(ps.connections) if ps else 0,
            decisions=dict(self.decision_log.counts) if self.decision_log else {},
        )
