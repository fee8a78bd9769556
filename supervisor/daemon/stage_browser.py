"""A stage's browser before the guard has one: whether it opens a window (`effective_headed`),
and what a browser that cannot be had answers (`BROWSER_ERRORS`, `browser_failed`): a refused
profile conflicts, a full disk says so, anything else is away (503)."""
from __future__ import annotations

from sfguard.supervisor import models
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.host import AnchorError
from sfguard.supervisor.daemon.deferred import no_space
from sfguard.supervisor.errors import BadRequest, BrowserStartError, Conflict, GuardError, Unavailable
from sfguard.supervisor.gate.cdp_gate import GateError
from sfguard.supervisor.protocols import ProfileError

#: what a browser that cannot be had is. Nothing wider: an IllegalTransition or another bug of
#: the guard is not a browser failure; it reaches the API as a 500 with its traceback logged.
BROWSER_ERRORS = (AnchorError, GateError, ProfileError, BrowserStartError, OSError, TimeoutError)


def browser_failed(exc: BaseException, message: str, field: str | None) -> GuardError:
    """A browser that could not be had: a refused profile conflicts, a full disk is named as
    such (it passes when space returns), anything else is away."""
    if no_space(exc):
        return Unavailable("disk_full", f"{message}: the guard has no disk space left (its home "
                           f"or runtime folder is full: {exc}); free space, then ask again", field)
    if isinstance(exc, ProfileError):
        return Conflict("browser_failed", f"{message}: {exc}", field)
    return Unavailable("browser_failed", f"{message}: {exc}", field)


def effective_headed(req: models.BrowserField) -> bool:
    """Whether a stage's browser opens a window: `headed` (the default) needs a display; asked
    for explicitly without one it is refused (no_display), by default it runs headless."""
    if not req.headed:
        return False
    if tools.display_available():
        return True
    if "headed" in req.model_fields_set:
        where = ("; the guard runs inside a container, where a visible window is not possible"
                 if tools.in_container() else "")
        raise BadRequest("no_display", "headed: true needs a display, but neither DISPLAY nor "
                         f"WAYLAND_DISPLAY is set{where}; set headed: false for this stage or run "
                         "the guard in a desktop session", "browser.headed")
    return False  # default headed, but no display: headless
