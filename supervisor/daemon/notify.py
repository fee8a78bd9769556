"""Webhooks: the guard tells people what they must act on or know (docs/operator-guide.md,
"Notifications"; configured by `<home>/notify.yaml`, supervisor/daemon/notify_config.py).

    notifier = Notifier.from_home(home, metrics=metrics, console=lambda: guard.console)
    await notifier.start()
    notifier.emit("write_held", {"run": ..., "stage": ..., ...})   # never blocks, never raises
    await notifier.stop()

Each event goes to every webhook that wants it as one POST of a JSON object, signed as GitHub and
Stripe sign theirs:

    X-Sfguard-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + raw body)>
    X-Sfguard-Event: <event>        X-Sfguard-Delivery: <id, the same on every retry>

A failed attempt (no connection, no answer in timeout_s, 5xx, 408, 429) is retried with backoff
(1 s, doubling, at most 60 s) until retry_for_s after the event; another status gives up at once.
Deliveries to one webhook go in order, one at a time; at most MAX_QUEUED wait. Every outcome is a
log line (the URL shown as scheme://host/...), a metric and a line of `status`.

Payloads keep only the fields in FIELDS, and addresses lose their query, fragment and user
part: never a cookie, token, password, form value or query value.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from sfguard.supervisor import redaction
from sfguard.supervisor.daemon.notify_config import EVENTS, NotifyConfig, Webhook, load_notify

log = logging.getLogger("sfguard.notify")

SIGNATURE_HEADER = "X-Sfguard-Signature"
#: a receiver should refuse a signature older than this (the documented recipe does)
TOLERANCE_S = 300
MAX_QUEUED = 1000
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0
#: how long the guard's stop waits for deliveries still queued
STOP_GRACE_S = 3.0
MAX_TEXT = 500
#: the fields a payload may carry (anything else is dropped)
FIELDS = ("run", "stage", "attempt", "profile", "site", "method", "path", "approval", "state",
          "why", "reason", "decided_by", "expires", "kind", "outcome", "file", "stages_failed",
          "problems")
#: the approvals store's names (Approval.public()) for the payload's
RENAMED = {"id": "approval", "run_id": "run", "stage_id": "stage", "host": "site"}
#: the console page a person opens for each event (the approval's own entry for writes)
PAGE = {"audit_chain_broken": "/audit"}


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp`."""
    mac = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def clean(payload: dict[str, Any]) -> dict[str, Any]:
    """Only FIELDS; addresses without query, fragment or user; texts bounded."""
    out: dict[str, Any] = {}
    for key, value in payload.items():
        key = RENAMED.get(key, key)
        if key not in FIELDS or value is None:
            continue
        if isinstance(value, str):
            value = _plain(value, is_path=key == "path")
        elif isinstance(value, (list, tuple)):
            value = [_plain(str(v), is_path=False) for v in value][:50]
        elif not isinstance(value, (bool, int, float)):
            continue
        out[key] = value
    return out


def _plain(text: str, *, is_path: bool) -> str:
    if is_path:
        text = text.split("?", 1)[0].split("#", 1)[0]
    elif "://" in text:
        try:
            p = urlsplit(text)
            text = f"{p.scheme}://{p.netloc.rsplit('@', 1)[-1]}{p.path}"
        except ValueError:
            text = text.split("://", 1)[0] + "://..."
    return text[:MAX_TEXT]


@dataclass
class _Delivery:
    event: str
    body: bytes
    id: str
    created: float                      # monotonic
    attempts: int = 0


@dataclass
class _Hook:
    """One webhook's queue, worker and counts."""
    hook: Webhook
    queue: asyncio.Queue[_Delivery] | None = None
    worker: asyncio.Task[None] | None = None
    busy: bool = False
    delivered: int = 0
    failed: int = 0
    last: dict[str, Any] | None = None

    def public(self) -> dict[str, Any]:
        queued = (self.queue.qsize() if self.queue is not None else 0) + (1 if self.busy else 0)
        return {"url": self.hook.shown, "events": sorted(self.hook.events), "delivered": self.delivered,
                "failed": self.failed, "queued": queued, "last": self.last}


class Notifier:
    """The guard's webhooks. Without a configuration every call is a no-op."""

    def __init__(self, config: NotifyConfig | None, *, metrics: Any = None,
                 console: Callable[[], Any] = lambda: None):
        """`console()`: the operator console (or None), whose address starts each link."""
        self.config, self.metrics, self.console = config, metrics, console
        self.hooks = [_Hook(h) for h in (config.webhooks if config else ())]
        for h in self.hooks:
            redaction.register_secret(h.hook.url)     # the whole URL never shows in a log line
        self.guard_host = socket.gethostname()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._early: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def from_home(cls, home: Any, **kw: Any) -> Notifier:
        """The notifier of `<home>/notify.yaml` (raises NotifyConfigError when it is invalid)."""
        return cls(load_notify(home), **kw)

    @property
    def enabled(self) -> bool:
        return bool(self.hooks)

    async def start(self) -> None:
        if not self.hooks:
            return
        self._loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(trust_env=False)
        for h in self.hooks:
            h.queue = asyncio.Queue(MAX_QUEUED)
            h.worker = self._loop.create_task(self._work(h))
        early, self._early = self._early, []
        for event, payload in early:
            self._enqueue(event, payload)
        shown = "; ".join(f"{h.hook.shown} ({', '.join(sorted(h.hook.events))})" for h in self.hooks)
        log.info("notifications: %d webhook(s) from %s: %s", len(self.hooks),
                 self.config.source if self.config else "-", shown)

    async def stop(self) -> None:
        """Give what is queued a moment (STOP_GRACE_S), then end the workers."""
        if self._loop is None:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while any(h.busy or (h.queue and not h.queue.empty()) for h in self.hooks) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = sum(h.public()["queued"] for h in self.hooks)
        for h in self.hooks:
            if h.worker is not None:
                h.worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await h.worker
        if left:
            log.warning("notifications: %d delivery(ies) not sent: the guard stopped", left)
        if self._session is not None:
            await self._session.close()
        self._loop = None

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Queue `event` for every webhook that wants it. From any thread; never raises."""
        if not self.hooks:
            return
        try:
            if event not in EVENTS:
                raise ValueError(f"unknown event {event!r}")
            loop = self._loop
            if loop is None:
                if len(self._early) < MAX_QUEUED:
                    self._early.append((event, dict(payload)))
                return
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._enqueue(event, payload)
            else:
                loop.call_soon_threadsafe(self._enqueue, event, dict(payload))
        except Exception as exc:   # boundary, from any thread: a notification never stops what it reports
            log.warning("notifications: %s not queued: %s: %s", event, type(exc).__name__, exc)

    def status(self) -> dict[str, Any] | None:
        if not self.hooks:
            return None
        return {"file": str(self.config.source) if self.config else None,
                "webhooks": [h.public() for h in self.hooks]}

    # -- inside ----------------------------------------------------------------------------
    def body(self, event: str, payload: dict[str, Any], delivery: str) -> bytes:
        data = {"event": event, "delivery": delivery, "about": EVENTS[event],
                "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "guard": self.guard_host,
                **clean(payload)}
        base = self.console_url()
        if base:
            approval = data.get("approval")
            page = f"/approvals#{approval}" if event.startswith("write_") and approval else PAGE.get(event, "/")
            data["link"] = base.rstrip("/") + page
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def console_url(self) -> str | None:
        """Where the console's links start (its public address when it has one), or None."""
        console = self.console()
        if console is None:
            return None
        return getattr(console, "public_url", None) or getattr(console, "base_url", None) or None

    def _enqueue(self, event: str, payload: dict[str, Any]) -> None:
        delivery = "d_" + secrets.token_hex(8)
        body = self.body(event, payload, delivery)
        for h in self.hooks:
            if event not in h.hook.events or h.queue is None:
                continue
            try:
                h.queue.put_nowait(_Delivery(event, body, delivery, time.monotonic()))
            except asyncio.QueueFull:
                self._record(h, None, "failed", f"{MAX_QUEUED} deliveries already wait", event)

    async def _work(self, h: _Hook) -> None:
        assert h.queue is not None
        while True:
            d = await h.queue.get()
            h.busy = True
            try:
                await self._deliver(h, d)
            finally:
                h.busy = False

    async def _deliver(self, h: _Hook, d: _Delivery) -> None:
        delay = BACKOFF_FIRST_S
        while True:
            d.attempts += 1
            retry, why = await self._attempt(h.hook, d)
            if why is None:
                self._record(h, d, "delivered")
                return
            if self.metrics is not None:
                self.metrics.webhook_attempt_failed()
            left = d.created + h.hook.retry_for_s - time.monotonic()
            if not retry or left <= 0:
                self._record(h, d, "failed", why)
                return
            wait = min(delay, BACKOFF_MAX_S, left)
            log.info("notification %s %s to %s: attempt %d failed (%s); again in %.0f s",
                     d.event, d.id, h.hook.shown, d.attempts, why, wait)
            await asyncio.sleep(wait)
            delay *= 2

    async def _attempt(self, hook: Webhook, d: _Delivery) -> tuple[bool, str | None]:
        """One POST: (worth retrying, why it failed or None when delivered)."""
        assert self._session is not None
        headers = {"Content-Type": "application/json", "User-Agent": "sfguard-webhook",
                   "X-Sfguard-Event": d.event, "X-Sfguard-Delivery": d.id,
                   SIGNATURE_HEADER: sign(hook.secret, int(time.time()), d.body)}
        try:
            async with self._session.post(hook.url, data=d.body, headers=headers, allow_redirects=False,
                                          timeout=aiohttp.ClientTimeout(total=hook.timeout_s)) as resp:
                await resp.content.read(64 * 1024)
                if 200 <= resp.status < 300:
                    return False, None
                return resp.status >= 500 or resp.status in (408, 429), f"HTTP {resp.status}"
        except TimeoutError:
            return True, f"no answer within {hook.timeout_s:.0f} s"
        except aiohttp.ClientConnectorError as exc:
            return True, f"cannot connect: {exc.os_error.strerror or type(exc.os_error).__name__}"
        except (aiohttp.ClientError, OSError) as exc:
            return True, type(exc).__name__

    def _record(self, h: _Hook, d: _Delivery | None, result: str, why: str | None = None,
                event: str | None = None) -> None:
        event = d.event if d is not None else event
        if result == "delivered":
            h.delivered += 1
            log.info("notification %s %s delivered to %s (attempt %d)", event, d.id if d else "-",
                     h.hook.shown, d.attempts if d else 0)
        else:
            h.failed += 1
            log.warning("notification %s %s to %s not delivered after %d attempt(s): %s", event,
                        d.id if d else "-", h.hook.shown, d.attempts if d else 0, why)
        h.last = {"event": event, "result": result, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "attempts": d.attempts if d else 0, "error": why}
        if self.metrics is not None:
            self.metrics.webhook_delivered(result)
