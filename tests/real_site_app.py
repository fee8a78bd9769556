"""An ASGI site for the real-site tests (tests/daemon/test_real_site_features.py), served over
HTTPS by hypercorn: HTTP/2 by ALPN, a WebSocket echo, Server-Sent Events, a download and a
file input. Each page writes what it saw into `window.__result` for the stage to read."""
from __future__ import annotations

import asyncio

PAGES = {
    "/proto": "<script>window.__result = performance.getEntriesByType('navigation')[0].nextHopProtocol;</script>",
    "/ws": """<script>
      const ws = new WebSocket('wss://' + location.host + '/echo');
      ws.onopen = () => ws.send('ping');
      ws.onmessage = (e) => { window.__result = e.data; ws.close(); };
      ws.onerror = () => { window.__result = 'error'; };
    </script>""",
    "/sse": """<script>
      const got = []; const es = new EventSource('/events');
      es.onmessage = (e) => {
        got.push(e.data);
        if (got.length === 3) { es.close(); window.__result = got.join(','); }
      };
      es.onerror = () => { if (got.length < 3) window.__result = 'error:' + got.join(','); };
    </script>""",
    "/files": """<a id=dl href="/report.csv">report</a>
      <form method=post action="/upload" enctype="multipart/form-data"><input id=up type=file name=f></form>""",
}


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "websocket":
        await receive()                                   # websocket.connect
        await send({"type": "websocket.accept"})
        msg = await receive()
        if msg["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": "pong:" + (msg.get("text") or "")})
        await send({"type": "websocket.close"})
        return
    path = scope["path"]
    if path == "/events":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")]})
        for i in range(1, 4):
            await send({"type": "http.response.body", "body": f"data: e{i}\n\n".encode(), "more_body": True})
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/report.csv":
        body = b"id,value\n1,sfguard\n"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/csv"),
                                (b"content-disposition", b'attachment; filename="report.csv"'),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    page = PAGES.get(path, "")
    body = f"<html><head><title>real site</title></head><body><p id=path>{path}</p>{page}</body></html>".encode()
    await send({"type": "http.response.start", "status": 200 if page else 404,
                "headers": [(b"content-type", b"text/html; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
