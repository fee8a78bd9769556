"""A minimal browser-level CDP endpoint for the default (no real browser) daemon tests.

It answers the Target methods the guard itself uses (createTarget, closeTarget, getTargets)
and `{}` for anything else, and records every method it receives, so tests can prove what
reached "Chrome" and what the gate stopped.
"""
from __future__ import annotations

import asyncio
import json
import threading
import uuid

from aiohttp import web


class FakeCdp:
    def __init__(self) -> None:
        self.methods: list[str] = []
        self.targets: dict[str, str] = {}
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != web.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            method = data.get("method", "")
            self.methods.append(method)
            result: dict = {}
            if method == "Target.createTarget":
                tid = uuid.uuid4().hex.upper()
                self.targets[tid] = data.get("params", {}).get("url", "about:blank")
                result = {"targetId": tid}
            elif method == "Target.closeTarget":
                result = {"success": self.targets.pop(data.get("params", {}).get("targetId"), None) is not None}
            elif method == "Target.getTargets":
                result = {"targetInfos": [{"targetId": t, "type": "page", "url": u, "title": "",
                                           "attached": False, "browserContextId": "CTX"}
                                          for t, u in self.targets.items()]}
            reply = {"id": data.get("id"), "result": result}
            if "sessionId" in data:
                reply["sessionId"] = data["sessionId"]
            await ws.send_str(json.dumps(reply))
        return ws

    def start(self) -> str:
        def run() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_get("/devtools/browser/{id}", self._ws)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"ws://127.0.0.1:{port}/devtools/browser/{uuid.uuid4()}"
            self._ready.set()
            self._loop.run_forever()
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake CDP endpoint did not start"
        return self.url

    def stop(self) -> None:
        if self._loop is None:
            return
        async def down():
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
