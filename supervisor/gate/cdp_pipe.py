"""The guard's end of a browser's DevTools pipe (`--remote-debugging-pipe`), shared by clients.

The guard starts every Chromium itself with `--remote-debugging-pipe`: Chromium reads CDP
commands on fd 3 and writes replies and events on fd 4, each message a JSON text followed by a
NUL byte. No DevTools port exists; whoever does not hold these two pipe ends cannot speak CDP to
the browser. `CdpPipe` holds both ends and multiplexes several logical *clients* onto the one
browser-level connection, as if each had its own WebSocket:

  * ids: a client's own command ids, sent under pipe-wide ids, its replies under its own;
  * flat sessions: a session attached by a client (`Target.attachToTarget` with flatten, or a
    child auto-attached inside one of its sessions) belongs to that client; events and replies
    carrying that sessionId go to it only. When a client goes away its sessions are detached,
    as Chromium does when a WebSocket closes;
  * target discovery: the pipe itself discovers targets once; a client's
    `Target.setDiscoverTargets` is answered by the pipe (existing targets announced, later
    target events passed on while it is on), so one client cannot switch it off for another;
  * proxy authentication: `Fetch.enable {handleAuthRequests}` at browser level, answered by the
    pipe with the run proxy's credential (and only to the proxy's challenge). The credential never
    leaves the guard process: clients cannot use the Fetch domain (the gate's policy). Any Fetch
    interception slows every request of the browser (measured 1.2x on a page load, patterns or
    not), so it is on only while needed: Chromium caches the credential and sends it unasked on
    later requests and connections to the proxy (tests/browser_host/test_fetch_switch_off.py).
    `FETCH_QUIET` seconds after the last challenge the pipe keeps only the write gate's patterns
    (`apply_write_patterns`), or none; `Target.createBrowserContext` turns it back on first.

The pipe closing (EOF on fd 4) means the browser is gone: `closed` is set, every pending call
fails, every client gets end-of-stream. Nothing here logs message contents or the credential.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sfguard.supervisor.gate.cdp_session import CdpCallError, CdpSession, PipeClosed
from sfguard.supervisor.gate.warden import TargetWarden

log = logging.getLogger("sfguard.cdp_pipe")

__all__ = ["CdpCallError", "CdpPipe", "CdpSession", "PipeClient", "PipeClosed", "m_end"]

#: Largest message accepted from the browser (a full-page screenshot stays far below).
MAX_MESSAGE = 256 * 1024 * 1024
#: Browser-wide proxy authentication. Chromium hands a challenge to Fetch only for requests
#: its patterns intercept (measured: with a pattern matching no URL the proxy's 407 ends the
#: request with ERR_INVALID_AUTH_CREDENTIALS), so every request pauses at its start and is let
#: go at once (_answer_fetch); challenges get the credential.
FETCH_ENABLE = {"handleAuthRequests": True, "patterns": [{"urlPattern": "*"}]}
#: A Fetch pattern no address matches: interception on, nothing new paused (see apply_write_patterns)
HOLD_ONLY = {"urlPattern": "sfguard-hold-only:*"}
#: Seconds without a new proxy challenge, after one was answered, before Fetch is switched off.
#: The parallel requests of a first page load each get their challenge within milliseconds
#: (they started before the credential was cached); later ones carry it from the cache.
FETCH_QUIET = 1.0
_REPLY_ID_RE = re.compile(r'^\{"id":(\d+)([,}])')
_TARGET_LIST_EVENTS = frozenset({"Target.targetCreated", "Target.targetInfoChanged",
                                 "Target.targetDestroyed", "Target.targetCrashed"})


class PipeClient:
    """One logical connection on the pipe. `send` a command dict; `recv` the next message text
    (None once the client or the pipe is closed)."""

    def __init__(self, pipe: CdpPipe, name: str) -> None:
        self.pipe, self.name = pipe, name
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.discover = False
        self.closed = False

    async def send(self, msg: dict) -> None:
        await self.pipe._client_send(self, msg)

    async def recv(self) -> str | None:
        if self.closed and self.queue.empty():
            return None
        return await self.queue.get()

    def _deliver(self, text: str) -> None:
        if not self.closed:
            self.queue.put_nowait(text)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.queue.put_nowait(None)
        await self.pipe._client_closed(self)


class CdpPipe:
    """Both ends of one browser's DevTools pipe, multiplexed (see the module docstring).

    pipe = CdpPipe(reader, writer); await pipe.start(proxy_auth=("name", "token"))
    client = pipe.client("stage key")  # for the gate; or: s = await pipe.session("login")
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.WriteTransport) -> None:
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._routes: dict[int, tuple[PipeClient | None, Any, str, dict]] = {}  # the client's own id: any JSON
        self._owner: dict[str, PipeClient] = {}          # sessionId -> client
        self._parent: dict[str, str | None] = {}         # sessionId -> parent sessionId
        self._pending_attach: dict[str, list[PipeClient]] = defaultdict(list)
        self._clients: set[PipeClient] = set()
        self._own: dict[int, asyncio.Future] = {}         # the pipe's own commands
        self._auth: tuple[str, str] | None = None
        self.targets: dict[str, dict] = {}                # targetId -> targetInfo
        self.closed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.fetch_on = False                             # browser-wide Fetch interception
        self._fetch_off_timer: asyncio.TimerHandle | None = None
        #: the write gate (supervisor/writes/intercept.py): paused requests go to it
        self.writes: Any = None
        #: closes pages nobody opened (supervisor/gate/warden.py), once the start tab is known
        self.warden = TargetWarden(lambda tid, _why: self._fire("Target.closeTarget", {"targetId": tid}))
        self.websockets: Any = None   # its WebSocket part (supervisor/writes/websockets.py)
        self._tab_watchers: list[Callable[[str, str], None]] = []

    def watch_tabs(self, watcher: Callable[[str, str], None]) -> None:
        """Call `watcher(kind, target_id)` when a tab of this browser ends (`gone`, before any
        client is told) or the write gate holds its navigation (`held`): the CDP gate keeps its
        stages' tabs true even when no connection of the stage is open, and answers a stage's
        navigation command to a held tab at once."""
        self._tab_watchers.append(watcher)

    def tell_tab_watchers(self, kind: str, target_id: str) -> None:
        """`kind` (gone, held) happened to tab `target_id` (see `watch_tabs`)."""
        for watcher in self._tab_watchers:
            watcher(kind, target_id)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, *, proxy_auth: tuple[str, str] | None = None, timeout: float = 60.0) -> dict:
        """Start reading; wait until the browser answers; turn on target discovery and, with a
        proxy credential, browser-wide proxy authentication. Returns Browser.getVersion."""
        self._auth = proxy_auth
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        # All sent at once: the browser reads its pipe in order and answers each as soon as it
        # can, so nothing waits for a round trip while it is still starting up.
        calls = [self.call("Browser.getVersion", timeout=timeout),
                 self.call("Target.setDiscoverTargets", {"discover": True}, timeout=timeout)]
        if proxy_auth is not None:
            calls.append(self.call("Fetch.enable", FETCH_ENABLE, timeout=timeout))
        tasks = [asyncio.ensure_future(c) for c in calls]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            left = [t for t in tasks if not t.done()]   # after a failure: the others end too
            for t in left:
                t.cancel()
            if left:
                await asyncio.gather(*left, return_exceptions=True)
        if proxy_auth is not None:
            self.fetch_on = True
        return results[0]

    async def close(self) -> None:
        for client in list(self._clients):
            await client.close()
        with contextlib.suppress(RuntimeError, OSError):   # its loop closed, or the pipe already gone
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._mark_closed()

    # -- clients -----------------------------------------------------------------------------
    def client(self, name: str) -> PipeClient:
        if self.closed.is_set():
            raise PipeClosed("the browser closed its DevTools pipe")
        c = PipeClient(self, name)
        self._clients.add(c)
        return c

    async def session(self, name: str) -> CdpSession:
        return CdpSession(self.client(name))

    async def _client_send(self, client: PipeClient, msg: dict) -> None:
        if client.closed:
            return
        if self.closed.is_set():
            client._deliver(json.dumps({"id": msg.get("id"), "error": {
                "code": -32000, "message": "the browser is gone"}}))
            return
        method, params = msg.get("method"), msg.get("params") or {}
        sid = msg.get("sessionId")
        if method == "Target.setDiscoverTargets" and sid is None:
            client.discover = bool(params.get("discover"))
            if client.discover:
                for info in list(self.targets.values()):
                    client._deliver(json.dumps({"method": "Target.targetCreated",
                                                "params": {"targetInfo": info}}))
            client._deliver(json.dumps({"id": msg.get("id"), "result": {}}))
            return
        if sid is not None and self._owner.get(sid) is not client:
            client._deliver(json.dumps({"id": msg.get("id"), "sessionId": sid, "error": {
                "code": -32001, "message": "Session with given id not found."}}))
            return
        if method == "Target.createBrowserContext" and self._auth is not None and not self.fetch_on:
            # A new context starts with an empty auth cache: answer its first challenge.
            self._fire("Fetch.enable", FETCH_ENABLE)
            self.fetch_on = True
        if method == "Target.attachToTarget" and sid is None and isinstance(params.get("targetId"), str):
            self._pending_attach[params["targetId"]].append(client)
        if method == "Target.createTarget":
            self.warden.creating()
        gid = next(self._ids)
        self._routes[gid] = (client, msg.get("id"), method or "", params)
        out = dict(msg)
        out["id"] = gid
        self._write(out)

    async def _client_closed(self, client: PipeClient) -> None:
        self._clients.discard(client)
        for lst in self._pending_attach.values():
            while client in lst:
                lst.remove(client)
        for sid, owner in list(self._owner.items()):
            if owner is client:
                del self._owner[sid]
                if self._parent.pop(sid, None) is None and not self.closed.is_set():
                    self._fire("Target.detachFromTarget", {"sessionId": sid})

    # -- the pipe's own commands -------------------------------------------------------------
    async def call(self, method: str, params: dict | None = None, *, session: str | None = None,
                   timeout: float | None = 30.0) -> dict:
        if self.closed.is_set():
            raise PipeClosed("the browser closed its DevTools pipe")
        gid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._own[gid] = fut
        msg: dict[str, Any] = {"id": gid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        creating = method == "Target.createTarget"
        if creating:
            self.warden.creating()
        self._write(msg)
        reply: dict = {}
        try:
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._own.pop(gid, None)
            if creating:
                self.warden.answered((reply.get("result") or {}).get("targetId"))
        if "error" in reply:
            err = reply["error"] if isinstance(reply["error"], dict) else {}
            raise CdpCallError(f"{method}: {str(err.get('message', 'error'))[:200]}")
        return reply.get("result") or {}

    # -- the write gate's answers to a paused request (supervisor/writes/intercept.py) ---------
    def continue_request(self, request_id: Any) -> None:
        """Let a request Fetch paused go on, unchanged."""
        self._fire("Fetch.continueRequest", {"requestId": request_id})

    def fulfill_request(self, request_id: Any, status: int, headers: list[dict[str, str]], body: bytes) -> None:
        """Answer a paused request in the guard's name: the site never sees it."""
        self._fire("Fetch.fulfillRequest", {"requestId": request_id, "responseCode": status,
                                            "responseHeaders": headers, "body": base64.b64encode(body).decode()})

    def _fire(self, method: str, params: dict, session: str | None = None) -> None:
        """A command whose answer nobody waits for."""
        gid = next(self._ids)
        self._routes[gid] = (None, None, method, params)
        msg: dict[str, Any] = {"id": gid, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self._write(msg)

    def _write(self, msg: dict) -> None:
        if self.closed.is_set():
            raise PipeClosed("the browser closed its DevTools pipe")
        try:
            self._writer.write(json.dumps(msg).encode() + b"\0")
        except (OSError, RuntimeError):
            self._mark_closed()
            raise PipeClosed("the browser closed its DevTools pipe") from None

    # -- reading -----------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    raw = await self._reader.readuntil(b"\0")
                except asyncio.IncompleteReadError:
                    break
                except asyncio.LimitOverrunError:
                    log.warning("a DevTools message over the size limit; closing the pipe")
                    break
                text = raw[:-1].decode("utf-8", errors="replace")
                try:
                    self._dispatch(text)
                except Exception:  # the reader's loop: one bad message must not stop the browser's reader
                    log.exception("dispatching a DevTools message failed")
        except (OSError, ConnectionError):
            pass
        finally:
            self._mark_closed()

    def _mark_closed(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self._fetch_off_timer is not None:
            self._fetch_off_timer.cancel()
        for fut in self._own.values():
            if not fut.done():
                fut.set_exception(PipeClosed("the browser closed its DevTools pipe"))
        self._own.clear()
        for client in list(self._clients):
            client.closed = True
            client.queue.put_nowait(None)
        self._clients.clear()

    def _dispatch(self, text: str) -> None:
        m = _REPLY_ID_RE.match(text)
        if m:
            self._reply(int(m.group(1)), m.group(2), text)
            return
        data = json.loads(text)
        if "id" in data:  # a reply whose id was not first: normalise
            self._reply(int(data["id"]), ",", None, data)
            return
        self._event(data, text)

    def _reply(self, gid: int, sep: str, text: str | None, data: dict | None = None) -> None:
        fut = self._own.pop(gid, None)
        if fut is not None:
            if not fut.done():
                fut.set_result(data if data is not None else json.loads(text or "null"))
            return
        route = self._routes.pop(gid, None)
        if route is None:
            return
        client, orig_id, method, params = route
        if method == "Target.createTarget":
            data = data if data is not None else json.loads(text or "null")
            self.warden.answered(((data or {}).get("result") or {}).get("targetId"))
        if method == "Target.attachToTarget" and "sessionId" not in (data or {}):
            # the session is the client's even if its attachedToTarget event was missed
            data = data if data is not None else json.loads(text or "null")
            sid = (data.get("result") or {}).get("sessionId")
            tid = params.get("targetId")
            if client is not None and isinstance(tid, str) and client in self._pending_attach.get(tid, []):
                self._pending_attach[tid].remove(client)
            if isinstance(sid, str):
                if client is None or client.closed:
                    self._owner.pop(sid, None)
                    self._fire("Target.detachFromTarget", {"sessionId": sid})
                    return
                self._owner.setdefault(sid, client)
                self._parent.setdefault(sid, None)
        if client is None and method == "Fetch.enable":
            self._fetch_enabled(data if data is not None else json.loads(text or "null"), params)
        if client is None or client.closed:
            return
        if data is not None:
            data = dict(data)
            data["id"] = orig_id
            client._deliver(json.dumps(data))
        else:
            assert text is not None  # no parsed answer: the raw one is forwarded
            client._deliver('{"id":' + json.dumps(orig_id) + sep + text[m_end(text):])

    def _event(self, data: dict, text: str) -> None:
        method = data.get("method")
        params = data.get("params") or {}
        sid = data.get("sessionId")
        if method in ("Fetch.authRequired", "Fetch.requestPaused") and sid is None:
            self._answer_fetch(method, params)
            return
        if method in _TARGET_LIST_EVENTS and sid is None:
            info = params.get("targetInfo") or {}
            if method == "Target.targetDestroyed":
                self.targets.pop(str(params.get("targetId")), None)
                self.warden.gone(params.get("targetId"))
                if isinstance(params.get("targetId"), str):
                    self.tell_tab_watchers("gone", params["targetId"])
            elif isinstance(info.get("targetId"), str):
                self.targets[info["targetId"]] = info
                if method == "Target.targetCreated":
                    self.warden.appeared(info)
            for client in list(self._clients):
                if client.discover:
                    client._deliver(text)
            return
        if method == "Target.attachedToTarget":
            child = params.get("sessionId")
            tid = (params.get("targetInfo") or {}).get("targetId")
            if sid is None:
                waiting = (self._pending_attach.get(tid) if isinstance(tid, str) else None) or []
                owner = waiting.pop(0) if waiting else None
                parent = None
            else:
                owner, parent = self._owner.get(sid), sid
            if owner is None or owner.closed:
                if isinstance(child, str) and sid is None:
                    self._fire("Target.detachFromTarget", {"sessionId": child})
                return
            if isinstance(child, str):
                self._owner[child] = owner
                self._parent[child] = parent
            owner._deliver(text)
            return
        if method == "Target.detachedFromTarget":
            child = params.get("sessionId")
            owner = self._owner.pop(child, None) if isinstance(child, str) else None
            if isinstance(child, str):
                self._parent.pop(child, None)
            if sid is not None:
                owner = owner or self._owner.get(sid)
            if owner is not None:
                owner._deliver(text)
            return
        if sid is not None:
            owner = self._owner.get(sid)
            if owner is not None:
                owner._deliver(text)
            return
        # Other browser-level events (downloads, ...) belong to no client: dropped.

    def _answer_fetch(self, method: str, params: dict) -> None:
        if method == "Fetch.requestPaused":
            if self.writes is not None:
                self.writes.paused(params)
            else:
                self._fire("Fetch.continueRequest", {"requestId": params.get("requestId")})
            return
        from_proxy = (params.get("authChallenge") or {}).get("source") == "Proxy"
        if from_proxy and self._auth:
            answer = {"response": "ProvideCredentials", "username": self._auth[0],
                      "password": self._auth[1]}
            if self._fetch_off_timer is not None:
                self._fetch_off_timer.cancel()
            self._fetch_off_timer = asyncio.get_running_loop().call_later(FETCH_QUIET, self._fetch_off)
        else:
            answer = {"response": "CancelAuth"}
        self._fire("Fetch.continueWithAuth", {"requestId": params.get("requestId"),
                                              "authChallengeResponse": answer})

    def _fetch_enabled(self, reply: Any, params: dict) -> None:
        """A refused Fetch.enable leaves the patterns before it, which may name fewer hosts than
        the write gate needs now, in force: every request pauses instead (fail closed)."""
        if isinstance(reply, dict) and "error" in reply and params.get("patterns") != [{"urlPattern": "*"}]:
            log.error("the browser refused the write gate's patterns (%s); every request pauses instead",
                      str(reply["error"])[:200])
            with contextlib.suppress(PipeClosed):
                self._fire("Fetch.enable", {"handleAuthRequests": bool(params.get("handleAuthRequests")),
                                            "patterns": [{"urlPattern": "*"}]})

    def _fetch_off(self) -> None:
        """No proxy challenge for FETCH_QUIET seconds: the credential is in Chromium's auth
        cache, requests stop pausing. A request paused meanwhile is let go by Chromium."""
        self._fetch_off_timer = None
        if self.closed.is_set() or not self.fetch_on:
            return
        self.fetch_on = False
        self.apply_write_patterns()

    def apply_write_patterns(self) -> None:
        """After the proxy challenges: Fetch stays on only for the write gate's patterns; Chromium
        answers challenges from its cache, as when Fetch is off (see FETCH_ENABLE)."""
        if self.closed.is_set() or self.fetch_on:
            return
        patterns = self.writes.patterns() if self.writes is not None else []
        if not patterns and self.writes is not None and self.writes.holding():
            # Fetch.disable lets every paused request go (measured): a held write would be
            # sent unapproved. Interception stays on, naming nothing, until none is held.
            patterns = [HOLD_ONLY]
        with contextlib.suppress(PipeClosed):
            if patterns:
                self._fire("Fetch.enable", {"handleAuthRequests": False, "patterns": patterns})
            else:
                self._fire("Fetch.disable", {})


def m_end(text: str) -> int:
    """Where the client's id must be spliced into a reply text starting `{"id":N,`."""
    m = _REPLY_ID_RE.match(text)
    return m.end() if m else 0
