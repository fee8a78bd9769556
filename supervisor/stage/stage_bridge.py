"""Per-stage bridges: the only ways out of a `sfguard stage-exec` sandbox.

For every ready stage the guard serves two unix sockets in a folder of that stage alone:

  <bridge root>/<random>/gate.sock   -> relays bytes to the CDP gate (the stage's token URL)
  <bridge root>/<random>/proxy.sock  -> relays bytes to the run's guard proxy

and adds a proxy client of the stage's own to the run proxy (allowlist = the stage's
allow_domains). Inside the sandbox socat listens on 127.0.0.1 and forwards to these sockets, so
the stage's shell reaches exactly its gate and its proxy. At stage end the sockets are closed
and removed, every open relay is cut, and the proxy client is removed: access ends at once.

The bridge root is a sibling of the runtime folder (`sfb-...`, 0711: it can be crossed but not
listed). Each stage folder has a random name and is 0700, owned by the stage user when the guard
runs as root (bubblewrap, run as that user, must reach the sockets to bind them), 0710 with the
API group when one is set (a runner under another user). Socket files are 0600 (0660 with the
API group), with the same owner.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.home import HomeError

log = logging.getLogger("sfguard.bridge")

BUF = 64 * 1024


def bridge_root_for(runtime: Path) -> Path:
    """`/dev/shm/sfg-0-abc` -> `/dev/shm/sfb-0-abc` (short: unix sockets have a path limit)."""
    return runtime.parent / ("sfb-" + runtime.name.removeprefix("sfg-"))


def _private_folder(path: Path, mode: int, gid: int | None, owner: int | None = None) -> Path:
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise HomeError(f"{path} is not a plain directory of this user")
    if gid is not None or owner is not None:
        os.chown(path, -1 if owner is None else owner, -1 if gid is None else gid)
    os.chmod(path, mode)
    return path


@dataclass
class _Bridge:
    """One listening unix socket relaying to one TCP address."""
    path: Path
    target: tuple[str, int]
    server: asyncio.base_events.Server | None = None
    conns: set[asyncio.Task] = field(default_factory=set)

    async def start(self, owner_uid: int | None, gid: int | None) -> None:
        old = os.umask(0o177)
        try:
            self.server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)
        if owner_uid is not None or gid is not None:
            os.chown(self.path, -1 if owner_uid is None else owner_uid, -1 if gid is None else gid)
        os.chmod(self.path, 0o660 if gid is not None else 0o600)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:        # always, inside a connection callback
            self.conns.add(task)
        up_w = None
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*self.target), 10)
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        except (TimeoutError, OSError):
            pass
        except asyncio.CancelledError:
            # cut by close() (stage end, the guard's stop): a normal end. Python 3.11's done
            # callback of a connection task calls task.exception(), which raises for a task
            # that ends cancelled and logs it as an ERROR with a traceback; so this one returns.
            pass
        finally:
            self.conns.discard(task)
            for w in (writer, up_w):
                if w is not None:
                    with contextlib.suppress(OSError, RuntimeError):   # already closed, or its loop
                        w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        for t in list(self.conns):
            t.cancel()
        if self.conns:
            await asyncio.wait(list(self.conns), timeout=5)
        if self.server is not None:
            with contextlib.suppress(TimeoutError):   # a connection still draining; the folder goes anyway
                await asyncio.wait_for(self.server.wait_closed(), 5)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(BUF):
            dst.write(data)
            await dst.drain()
    finally:
        with contextlib.suppress(OSError, RuntimeError):   # the other side is gone already
            if dst.can_write_eof():
                dst.write_eof()


@dataclass
class StageBridges:
    folder: Path
    gate: _Bridge
    proxy: _Bridge
    proxy_client: str
    proxy_url: str       # http://CLIENT:TOKEN@127.0.0.1:PORT: the stage's own proxy credential

    def describe(self) -> dict:
        return {"dir": str(self.folder), "gate_socket": str(self.gate.path),
                "gate_port": self.gate.target[1], "proxy_socket": str(self.proxy.path),
                "proxy_port": self.proxy.target[1]}


class BridgeHost:
    """The guard's bridges, keyed by the stage's gate key (run/stage/attempt)."""

    def __init__(self, runtime: Path, *, stage_uid: int | None = None, api_gid: int | None = None):
        self.root = bridge_root_for(runtime)
        self.stage_uid = stage_uid
        self.api_gid = api_gid
        self._stages: dict[str, StageBridges] = {}

    def sweep(self) -> int:
        """At start (one guard per home): remove every stage folder a dead guard left."""
        _private_folder(self.root, 0o711, None)
        n = 0
        for p in self.root.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink()
            n += 1
        return n

    def get(self, key: str) -> StageBridges | None:
        return self._stages.get(key)

    async def open(self, key: str, cdp_url: str, proxy, allow: list[str],
                   writes: str = "allow", pace: tuple[str, list[dict]] | None = None) -> StageBridges:
        """Serve the stage's two sockets and give it a proxy client (idempotent: a stage whose
        browser was replaced keeps its bridges, the gate target is refreshed); `pace`: whose
        pace its requests count on (its browser's) and the stage's budget."""
        parts = urlsplit(cdp_url)
        gate_target = (parts.hostname or "127.0.0.1", int(parts.port or 0))
        have = self._stages.get(key)
        if have is not None:
            have.gate.target = gate_target
            return have
        gid = self.api_gid
        _private_folder(self.root, 0o711, None)
        folder = _private_folder(self.root / secrets.token_hex(8),
                                 0o710 if gid is not None else 0o700, gid, self.stage_uid)
        client = await proxy.add_client(allow, writes=writes, pace_key=pace[0] if pace else None,
                                        budgets=pace[1] if pace else None)
        serving = False
        try:
            gate = _Bridge(folder / "gate.sock", gate_target)
            prox = _Bridge(folder / "proxy.sock", ("127.0.0.1", proxy.port))
            await gate.start(self.stage_uid, gid)
            await prox.start(self.stage_uid, gid)
            serving = True
        finally:
            if not serving:
                with swallowed(log, "removing the bridge's proxy client after a failed start"):
                    await proxy.remove_client(client)
                shutil.rmtree(folder, ignore_errors=True)
        sb = StageBridges(folder, gate, prox, client, proxy.url_for(client))
        self._stages[key] = sb
        return sb

    async def close(self, key: str, proxy) -> None:
        """Cut the stage off: sockets closed and removed, relays cut, proxy client removed."""
        sb = self._stages.pop(key, None)
        if sb is None:
            return
        await sb.gate.close()
        await sb.proxy.close()
        shutil.rmtree(sb.folder, ignore_errors=True)
        if proxy is not None:
            with contextlib.suppress(RuntimeError):
                await proxy.remove_client(sb.proxy_client)

    async def close_all(self) -> None:
        """At guard stop: every stage's bridges, then the bridge root with whatever is left in
        it (no stage keeps a way out once its guard is gone)."""
        for key in list(self._stages):
            await self.close(key, None)
        self.remove()

    def remove(self) -> bool:
        """Remove the bridge root and everything in it (a guard stopping, or `sfguard sweep`
        after a dead one; the caller holds the home's instance lock). Only a plain folder of
        this user is removed, never what a symlink points at. True when it is gone."""
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            return True
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            log.error("%s is not a plain folder of this user; left in place", self.root)
        return not os.path.lexists(self.root)
