"""The pipe's browser-level auto-attach (supervisor/gate/cdp_pipe.py), with a scripted browser
end: the sessions Chromium attaches on its own after a client's `Target.setAutoAttach` at
browser level (the WebSocket write gate's service and shared workers) belong to that client;
without one, the pipe detaches them; a client that goes away takes them along."""
from __future__ import annotations

import asyncio
import json
import os

from sfguard.supervisor.gate.cdp_pipe import CdpPipe


class Browser:
    """The browser's end of the pipe: what the guard wrote (parsed), and events to send."""

    def __init__(self) -> None:
        self.r_guard, self.w_guard = os.pipe()       # what the guard writes
        self.r_browser, self.w_browser = os.pipe()   # what the "browser" writes
        os.set_blocking(self.r_guard, False)
        self.buf = b""

    async def pipe(self) -> CdpPipe:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(self.r_browser, "rb", 0))
        transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(self.w_guard, "wb", 0))
        pipe = CdpPipe(reader, transport)
        pipe._task = loop.create_task(pipe._read_loop())
        return pipe

    def event(self, method: str, params: dict, session: str | None = None) -> None:
        msg = {"method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self.w_browser, json.dumps(msg).encode() + b"\0")

    async def written(self, settle: float = 0.2) -> list[dict]:
        await asyncio.sleep(settle)
        try:
            while chunk := os.read(self.r_guard, 65536):
                self.buf += chunk
        except BlockingIOError:
            pass
        *done, self.buf = self.buf.split(b"\0")
        return [json.loads(x) for x in done]


def attached(sid: str, kind: str = "service_worker") -> dict:
    return {"sessionId": sid, "targetInfo": {"targetId": f"t-{sid}", "type": kind, "url": "https://a.test/sw.js"},
            "waitingForDebugger": True}


async def messages(client, settle: float = 0.2) -> list[dict]:
    await asyncio.sleep(settle)
    out = []
    while not client.queue.empty():
        text = client.queue.get_nowait()
        if text is not None:
            out.append(json.loads(text))
    return out


async def test_auto_attached_sessions_belong_to_the_client_that_asked():
    b = Browser()
    pipe = await b.pipe()
    guard, other = pipe.client("websocket write gate"), pipe.client("another")
    try:
        # no client asked: an auto-attached session is detached again, nobody sees it
        b.event("Target.attachedToTarget", attached("S0"))
        assert ("Target.detachFromTarget", "S0") in [(m["method"], (m.get("params") or {}).get("sessionId"))
                                                     for m in await b.written()]
        await guard.send({"id": 1, "method": "Target.setAutoAttach", "params": {
            "autoAttach": True, "waitForDebuggerOnStart": True, "flatten": True}})
        assert [m["method"] for m in await b.written()] == ["Target.setAutoAttach"]
        b.event("Target.attachedToTarget", attached("S1"))
        got = await messages(guard)
        assert [m["params"]["sessionId"] for m in got if m.get("method") == "Target.attachedToTarget"] == ["S1"]
        assert await messages(other) == []
        assert not [m for m in await b.written(0) if m.get("method") == "Target.detachFromTarget"]
        # the session is the client's: its commands there go through, another client's do not
        await guard.send({"id": 2, "method": "Runtime.runIfWaitingForDebugger", "sessionId": "S1"})
        assert [(m["method"], m.get("sessionId")) for m in await b.written()] == [
            ("Runtime.runIfWaitingForDebugger", "S1")]
        await other.send({"id": 3, "method": "Runtime.evaluate", "sessionId": "S1", "params": {}})
        assert "not found" in json.dumps(await messages(other))
        assert await b.written(0) == []
        b.event("Runtime.consoleAPICalled", {"type": "log"}, session="S1")
        assert [m.get("sessionId") for m in await messages(guard)] == ["S1"]
        # the client goes away: its sessions are detached, later ones are nobody's
        await guard.close()
        assert ("Target.detachFromTarget", "S1") in [(m["method"], (m.get("params") or {}).get("sessionId"))
                                                     for m in await b.written()]
        b.event("Target.attachedToTarget", attached("S2"))
        assert ("Target.detachFromTarget", "S2") in [(m["method"], (m.get("params") or {}).get("sessionId"))
                                                     for m in await b.written()]
        assert await messages(other) == []
    finally:
        await pipe.close()
        for fd in (b.r_guard, b.w_browser):
            os.close(fd)
