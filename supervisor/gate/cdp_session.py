"""A request/response helper over one logical connection of a browser's DevTools pipe
(supervisor/gate/cdp_pipe.py), and the errors of that pipe. The guard's own work (login checks,
closing tabs, its extension, the write gate's pictures) speaks CDP through a `CdpSession`:

    cdp = await pipe.session("login check")
    info = await cdp.call("Target.getTargets")
    await cdp.close()
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any

from sfguard.errors import SfguardError


class PipeClosed(SfguardError):
    """The browser's pipe is closed (the browser exited or crashed)."""


class CdpCallError(SfguardError):
    """A CDP command answered with an error (the browser's message, no secrets)."""


class CdpSession:
    """A request/response helper on top of a PipeClient, for the guard's own work (login check,
    closing tabs, warm-up). Events go to `events` (a queue of dicts)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.events: asyncio.Queue[dict] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while (text := await self.client.recv()) is not None:
                try:
                    data = json.loads(text)
                except ValueError:
                    continue
                if "id" in data:
                    fut = self._pending.pop(data["id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(data)
                else:
                    self.events.put_nowait(data)
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(PipeClosed("the browser closed its DevTools pipe"))
            self._pending.clear()
            self.events.put_nowait({})     # an empty event: the session has ended

    async def call(self, method: str, params: dict | None = None, *, session: str | None = None,
                   timeout: float | None = 30.0) -> dict:
        if self.client.closed or self.client.pipe.closed.is_set():
            raise PipeClosed("the browser closed its DevTools pipe")
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self.client.send(msg)
        try:
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(msg_id, None)
        if "error" in reply:
            err = reply["error"] if isinstance(reply["error"], dict) else {}
            raise CdpCallError(f"{method}: {str(err.get('message', 'error'))[:200]}")
        return reply.get("result") or {}

    async def close(self) -> None:
        await self.client.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
