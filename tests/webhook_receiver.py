"""A webhook receiver for tests, on 127.0.0.1: records every POST it answers (headers, raw body,
when), can answer the first N with a status of the test's choosing, and can go down and come
back on the same port. `doc_verify()` is the signature check docs/operator-guide.md shows,
executed from the guide itself, so the tests prove the recipe the operator copies."""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.conftest import free_port

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operator-guide.md"


@dataclass
class Got:
    headers: dict[str, str]
    body: bytes
    at: float
    path: str

    @property
    def event(self) -> dict[str, Any]:
        return json.loads(self.body)


class Receiver:
    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.got: list[Got] = []
        self.fail: list[int] = []          # statuses to answer before the next ones succeed
        self.refused = 0
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()

    def url(self, path: str = "/hooks/sfguard") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def up(self) -> Receiver:
        me = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with me._lock:
                    status = me.fail.pop(0) if me.fail else 204
                    if status < 300:
                        me.got.append(Got(dict(self.headers.items()), body, time.time(), self.path))
                    else:
                        me.refused += 1
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def events(self, name: str | None = None) -> list[Got]:
        with self._lock:
            return [g for g in self.got if name is None or g.event["event"] == name]

    def wait(self, name: str, count: int = 1, bound: float = 30.0) -> list[Got]:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            found = self.events(name)
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no {count} {name} event(s) within {bound} s; got "
                             f"{[g.event['event'] for g in self.events()]}")


def guide_block(marker: str) -> str:
    """The first ```python block of the operator guide that contains `marker`."""
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S):
        if marker in block:
            return block
    raise AssertionError(f"no python block with {marker!r} in {GUIDE}")


def doc_verify():
    """The guide's `verify(secret, header, body, now=None, tolerance=300)`."""
    space: dict[str, Any] = {"__name__": "guide"}
    exec(compile(guide_block("def verify("), str(GUIDE), "exec"), space)   # noqa: S102 - the doc's own code
    return space["verify"]
