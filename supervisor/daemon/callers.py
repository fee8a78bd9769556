"""Who called the control API, for records that name a decider (an approval's `by`).

On the unix socket the caller is the OS user of the connecting process, read from the socket
itself (SO_PEERCRED: the kernel's word, not the request's): `user:NAME` (or `uid:N` when the
name is not a plain one). On the loopback TCP listener it is whoever holds its bearer token:
`api-token`. The API's middleware sets `CALLER` for each request; a service reads it.
"""
from __future__ import annotations

import contextvars
import pwd
import re
import socket
import struct
from typing import Any

#: the caller of the request being served ("api" outside a request)
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("sfguard_api_caller", default="api")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,40}$")


def peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end of a unix socket (None for another kind)."""
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


def describe_uid(uid: int) -> str:
    """`user:NAME` for a plain user name, else `uid:N`."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"
    return f"user:{name}" if _NAME_RE.fullmatch(name) else f"uid:{uid}"


def caller_of(sock: Any, token_listener: bool) -> str:
    """The caller of a request that came in on `sock`."""
    if token_listener:
        return "api-token"
    uid = peer_uid(sock)
    return describe_uid(uid) if uid is not None else "api"
