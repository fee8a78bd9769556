"""A small synchronous client for the control API over the guard's unix socket.

Used by the CLI (`sfguard status`, `sfguard demo`) and by tests; a pipeline runner in another
language generates its own from /v1/openapi.json.
"""
from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from sfguard.errors import SfguardError


class GuardUnavailable(SfguardError):
    """No guard answers on this home's socket."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def socket_path(home: Path) -> Path:
    return home / "guard.sock"


class GuardClient:
    def __init__(self, home: Path, timeout: float = 120.0):
        self.path = str(socket_path(home))
        self.timeout = timeout

    def call(self, method: str, route: str, body: Any = None) -> tuple[int, Any]:
        conn = _UnixConnection(self.path, self.timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, route, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            raise GuardUnavailable(f"no guard is running on {self.path}: start it with `sfguard start`") from exc
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            message = raw[:200].decode(errors="replace")
            return resp.status, {"error": {"code": "bad_answer", "message": message, "field": None}}
