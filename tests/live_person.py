"""A person at a real site's login page, through the console's live view only (the viewer:
supervisor/console/viewer.py). Like a person, it knows the page from its frames: it sees the
field the page put the cursor in (`autofocus`, shown by Chromium's focus ring), clicks there and
types, presses Tab and sees the ring move to the field below, types, and clicks the site's
button where the frame shows it. No selector, no tab order guessed from the page's source, no
access to the guard's browser."""
from __future__ import annotations

from sfguard.supervisor.console.viewer import Viewer

FAR = 1 << 20


async def address(v: Viewer) -> str:
    """The login tab's address as the live view shows it (no query)."""
    return str(await v.eval("document.getElementById('address').textContent"))


async def wait_address(v: Viewer, prefix: str, timeout: float = 30, other_than: str | None = None) -> str:
    """Wait until the live view shows an address starting with `prefix` (and not `other_than`)."""
    cond = f"document.getElementById('address').textContent.startsWith({prefix!r})"
    if other_than is not None:
        cond += f" && document.getElementById('address').textContent !== {other_than!r}"
    await v.wait_for(cond, timeout, f"the login tab at {prefix}")
    return await address(v)


async def sign_in_by_sight(v: Viewer, user: str, password: str, button_rgb: tuple[int, int, int],
                           timeout: float = 30) -> tuple[float, float]:
    """Sign in on the login page the live view shows; returns the point clicked (frame pixels)."""
    first = await v.look(v.focused_field, timeout, "a focused field (the page's autofocus)")
    await v.click_frame((first[0] + first[2]) / 2, (first[1] + first[3]) / 2)
    await v.type_text(user)
    await v.key("Tab", 9)

    async def next_field():
        box = await v.focused_field()
        return box if box is not None and box[1] > first[3] else None

    second = await v.look(next_field, timeout, "the focus ring on the field below the first")
    await v.type_text(password)
    button = await v.look(lambda: v.find_colour(button_rgb, region=(0, second[3], FAR, FAR)), timeout,
                          "the sign-in button below the fields")
    await v.click_frame(*button)
    return button


async def click_focused_button(v: Viewer, button_rgb: tuple[int, int, int], timeout: float = 30) -> tuple[float, float]:
    """Click the button of colour `button_rgb` that the page focused (a consent page's
    `autofocus` Continue): it is the one inside the focus ring, so a frame of the page before
    (with a button of the same colour elsewhere) is not mistaken for it."""
    async def inside_ring():
        box = await v.focused_field()
        if box is None:
            return None
        return await v.find_colour(button_rgb, region=box)

    at = await v.look(inside_ring, timeout, "a focused button")
    await v.click_frame(*at)
    return at


async def press_done(v: Viewer, timeout: float = 30) -> str:
    """Press Done on the live-view page; the guard's answer as the page shows it."""
    await v.click_selector("#done")
    return str(await v.wait_for("document.getElementById('result') && document.getElementById('result').textContent",
                                timeout, "the result of Done"))
