"""Console authentication: one-time links, sessions and CSRF tokens, all in memory.

A *link token* is printed by `sfguard console` (or put in a live-view gate payload); it is
good for one exchange before it expires. The exchange gives a *session*: an opaque cookie
value (HttpOnly, SameSite=Strict, Path=/, Max-Age = the session's life) and a CSRF token that
the pages put in their forms and the scripts send in a header. Only SHA-256 digests of link
tokens and cookie values are kept, so a memory dump of the table gives no usable credential.

Scopes: "console" (every console page) or "live:<handoff id>" (that live view only: its page,
its socket, its Done and Cancel; never a console page). Ending a scope (`end_scope`) kills its
unused links and its sessions at once: a live-view URL dies with its handoff. A session that
ends for any reason (sign-out, its scope ended, expiry, `end_all` at the guard's stop) is
marked `ended` and `on_end` is called, so that open streams of that session stop at once.
Each session has a short public id (`s-xxxxxxxx`) for the audit log; the cookie value itself
is never logged. A console link may name the person it is for (`sfguard console --as NAME`):
its session then decides as `console:NAME`, else as `console:<public id>`.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sfguard.supervisor import redaction
from sfguard.supervisor.models import PERSON_NAME

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
    ended: bool = False
    person: str | None = None

    @property
    def decider(self) -> str:
        """Who decides what this session decides, as the audit chain records it."""
        return f"console:{self.person or self.public_id}"

    def alive(self, now: float | None = None) -> bool:
        return not self.ended and (now if now is not None else time.time()) < self.expires

    @property
    def is_console(self) -> bool:
        return self.scope == "console"

    def csrf_ok(self, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf, str(token))


@dataclass
class _Link:
    scope: str
    expires: float
    session_ttl: float
    person: str | None = None


class ConsoleAuth:
    def __init__(self, clock: Callable[[], float] = time.time, on_end: Callable[[], None] | None = None):
        self._clock = clock
        self._links: dict[str, _Link] = {}         # digest(token) -> link
        self._sessions: dict[str, Session] = {}    # digest(cookie) -> session
        self.on_end = on_end                       # called after sessions ended

    def _drop(self, digests: list[str]) -> None:
        for d in digests:
            self._sessions.pop(d).ended = True
        if digests and self.on_end is not None:
            self.on_end()

    def _sweep(self) -> None:
        now = self._clock()
        for d in [d for d, l in self._links.items() if l.expires <= now]:
            del self._links[d]
        self._drop([d for d, s in self._sessions.items() if s.expires <= now])

    def live(self, sess: Session) -> bool:
        """The session is still good: not ended, not expired."""
        return sess.alive(self._clock())

    def new_link(self, scope: str = "console", ttl: float = LINK_TTL,
                 session_ttl: float = SESSION_TTL, person: str | None = None) -> str:
        """A one-time token for `scope`, good for `ttl` seconds; `person` names whom it is for
        (console links only)."""
        if not 0 < ttl <= MAX_LINK_TTL:
            raise ValueError(f"a link lives between 1 second and {MAX_LINK_TTL:.0f} seconds")
        if person is not None and (scope != "console" or not PERSON_NAME.fullmatch(person)):
            raise ValueError("a person's name: 1-32 of a-z 0-9 . _ -, starting with a letter, not s-")
        self._sweep()
        token = secrets.token_urlsafe(32)
        redaction.register_secret(token)
        self._links[_digest(token)] = _Link(scope, self._clock() + ttl, session_ttl, person)
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
                       secrets.token_urlsafe(24), person=link.person)
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
        if cookie and _digest(cookie) in self._sessions:
            self._drop([_digest(cookie)])

    def end_scope(self, scope: str) -> None:
        for d in [d for d, l in self._links.items() if l.scope == scope]:
            del self._links[d]
        self._drop([d for d, s in self._sessions.items() if s.scope == scope])

    def end_all(self) -> None:
        """Every link and session ends (the guard stops)."""
        self._links.clear()
        self._drop(list(self._sessions))
