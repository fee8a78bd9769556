"""The guard's domain errors: what went wrong, in the guard's words, without HTTP.

The Guard and its services raise these; supervisor/daemon/api.py alone turns them into an HTTP
status (its ERROR_STATUS table) and the {"error": {"code", "message", "field"}} body. `code` is
one of models.ERROR_CODES; `field` names the offending input (e.g. `browser.profile`) or is None.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from sfguard.errors import SfguardError


class IllegalTransition(SfguardError):
    """A state move its transition table does not list (a stage's, daemon/runs.py; a
    handoff's, models.py): a bug in the guard, answered as an internal error."""


class BrowserStartError(SfguardError):
    """A browser, or the run proxy it needs, that could not be started or updated: the runner
    is told `browser_failed` (daemon/stage_browser.py BROWSER_ERRORS)."""


class GuardError(SfguardError):
    """A refusal the caller can act on: a stable code, a message for people, the input field."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code, self.message, self.field = code, message, field

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r}, {self.field!r})"


class BadRequest(GuardError):
    """The input itself is wrong (or asks for something this guard cannot give, e.g. a window
    without a display)."""


class Forbidden(GuardError):
    """Refused by the site policy."""


class NotFound(GuardError):
    """No such run, stage, profile or handoff."""


class Conflict(GuardError):
    """Conflicts with the current state (a run that ended, a leased profile, ...)."""


class Unprocessable(GuardError):
    """The input was fine but the check could not decide (e.g. a login check's page)."""


class Unavailable(GuardError):
    """Something the guard needs is away: a browser that would not start, the shared store."""


@contextlib.contextmanager
def swallowed(log: logging.Logger, why: str,
              kinds: tuple[type[Exception], ...] = (Exception,)) -> Iterator[None]:
    """A best-effort step whose failure must not stop the caller (a cleanup after another
    failure, a close on the way out): the exception (`kinds`, narrow it where the step's own
    errors are known) is logged with `why`, never dropped silently. Logging masks secrets."""
    try:
        yield
    except kinds as exc:
        log.info("%s failed (left as it is): %s: %s", why, type(exc).__name__, exc)
