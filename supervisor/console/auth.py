"""Console authentication: one-time links, sessions and CSRF tokens, all in memory.

A *link token* is printed by `sfguard console` (or put in a live-view gate payload); it is
good for one exchange before it expires. The exchange gives a *session*: an opaque cookie
value (HttpOnly, SameSite=Strict, Path=/, Max-Age = the session's life) and a CSRF token that
the pages put in their forms and the scripts send in a header. Only SHA-256 digests of link
tokens and cookie values are kept, so a memory dump of the table gives no usable credential.

Scopes: "console" (every page) or "live:<handoff id>" (that live view only). Ending a scope
(`end_scope`) kills its unused links and its sessions at once: a live-view URL dies with its
handoff. Each session has a short public id (`s-xxxxxxxx`) for the audit log; the cookie
value itself is never logged.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

from sfguard.supervisor import redaction

LINK_TTL = 600.0            # an unused console login link lives 10 minutes
SESSION_TTL = 8 * 3600.0    # a console session lives 8 hours
MAX_LINK_TTL = 24 * 3600.0


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


@dataclass
class Session:
    public_id: str
    scope: str
    expires: float
    csrf: str = field(repr=False)

    def alive(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) < self.expires

    def can_view(self, scope: str) -> bool:
        """A console session sees everything, a live session only its own handoff."""
        return self.scope == "console" or self.scope == scope

    def csrf_ok(self, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf, str(token))


@dataclass
class _Link:
    scope: str
    expires: float
    session_ttl: float


class ConsoleAuth:
    def __init__(self, clock=time.time):
        self._clock = clock
        self._links: dict[str, _Link] = {}         # digest(token) -> link
        self._sessions: dict[str, Session] = {}    # digest(cookie) -> session

    def _sweep(self) -> None:
        now = self._clock()
        for d in [d for d, l in self._links.items() if l.expires <= now]:
            del self._links[d]
        for d in [d for d, s in self._sessions.items() if s.expires <= now]:
            del self._sessions[d]

    def new_link(self, scope: str = "console", ttl: float = LINK_TTL,
                 session_ttl: float = SESSION_TTL) -> str:
        """A one-time token for `scope`, good for `ttl` seconds."""
        if not 0 < ttl <= MAX_LINK_TTL:
            raise ValueError(f"a link lives between 1 second and {MAX_LINK_TTL:.0f} seconds")
        self._sweep()
        token = secrets.token_urlsafe(32)
        redaction.register_secret(token)
        self._links[_digest(token)] = _Link(scope, self._clock() + ttl, session_ttl)
        return token

    def redeem(self, token: str | None, scope: str) -> tuple[str, Session] | None:
        """Exchange a link token for `scope` once: (cookie value, session), or None when the
        token is unknown, used, expired or made for another scope."""
        if not token or len(token) > 200:
            return None
        self._sweep()
        link = self._links.get(_digest(token))
        if link is None or link.scope != scope:
            return None
        del self._links[_digest(token)]
        cookie = secrets.token_urlsafe(32)
        redaction.register_secret(cookie)
        sess = Session(f"s-{secrets.token_hex(4)}", link.scope,
                       min(self._clock() + link.session_ttl, self._clock() + SESSION_TTL),
                       secrets.token_urlsafe(24))
        self._sessions[_digest(cookie)] = sess
        return cookie, sess

    def session(self, cookie: str | None) -> Session | None:
        if not cookie or len(cookie) > 200:
            return None
        sess = self._sessions.get(_digest(cookie))
        if sess is None or not sess.alive(self._clock()):
            return None
        return sess

    def end_session(self, cookie: str | None) -> None:
        if cookie:
            self._sessions.pop(_digest(cookie), None)

    def end_scope(self, scope: str) -> None:
        for d in [d for d, l in self._links.items() if l.scope == scope]:
            del self._links[d]
        for d in [d for d, s in self._sessions.items() if s.scope == scope]:
            del self._sessions[d]
