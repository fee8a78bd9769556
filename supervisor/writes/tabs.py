"""Which tab sent a request the write gate paused, and a picture of it for the person.

A paused request names the frame that sent it. A tab's main frame has the tab's target id; a
frame inside a page (same-site or out of process) is found in the pages' frame trees; a request
of a tab that has not shown a page yet (a form posted into a new tab or a popup) belongs to the
tab that opened it. Everything here is bounded: a tab that cannot be found or captured in time
gives None, and the write is judged and held all the same.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from typing import Any

from sfguard.supervisor.gate.cdp_pipe import CdpCallError, PipeClosed

log = logging.getLogger("sfguard.writes")

#: how long finding the tab of a request, or capturing it, may take; how many tabs are looked through
FIND_SECONDS = 3.0
CAPTURE_SECONDS = 5.0
MAX_TABS = 16
#: addresses of a tab that has not shown a page of its own yet
_BLANK = ("", "about:blank")


def _has_frame(tree: dict, frame_id: object) -> bool:
    if (tree.get("frame") or {}).get("id") == frame_id:
        return True
    return any(_has_frame(child, frame_id) for child in tree.get("childFrames") or [])


async def sender_tab(pipe: Any, frame_id: object) -> dict | None:
    """The targetInfo of the page (tab or popup) whose frame `frame_id` sent a request; None
    when no page holds it (a worker's request, a frame gone meanwhile)."""
    if not isinstance(frame_id, str) or not frame_id:
        return None
    info = pipe.targets.get(frame_id)
    if info is not None and info.get("type") == "page":
        return dict(info)
    pages = [t for t in list(pipe.targets.values()) if t.get("type") == "page"][:MAX_TABS]
    if info is not None and info.get("parentFrameId"):      # an out-of-process frame: its parent's page
        found = await sender_tab(pipe, info["parentFrameId"]) if info["parentFrameId"] != frame_id else None
        if found is not None:
            return found
    cdp = None
    try:
        async with asyncio.timeout(FIND_SECONDS):
            cdp = await pipe.session("write gate: the sending tab")
            for page in pages:
                attached = await cdp.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})
                sid = attached["sessionId"]
                try:
                    tree = await cdp.call("Page.getFrameTree", session=sid)
                finally:
                    with contextlib.suppress(PipeClosed, CdpCallError, TimeoutError):
                        await cdp.call("Target.detachFromTarget", {"sessionId": sid}, timeout=2)
                if _has_frame(tree.get("frameTree") or {}, frame_id):
                    return dict(page)
    except (PipeClosed, CdpCallError, TimeoutError, KeyError, OSError) as exc:
        log.info("the tab of a paused write was not found: %s", type(exc).__name__)
    finally:
        if cdp is not None:
            with contextlib.suppress(PipeClosed, OSError):
                await cdp.close()
    return None


def shown_tab(pipe: Any, tab: dict | None, url: str) -> dict | None:
    """The tab to show the person: the sender, or the tab that opened it when the sender has
    not shown a page yet (a form posted into a new tab or a popup shows its opener's page)."""
    if tab is None:
        return None
    opener = tab.get("openerId")
    if opener and (str(tab.get("url") or "") in _BLANK or tab.get("url") == url):
        return dict(pipe.targets.get(opener) or tab)
    return tab


#: the names of a page's password inputs (its frames' too, where the page may read them)
PASSWORD_FIELDS = ("(() => { const out = []; const walk = d => { for (const e of d.querySelectorAll("
                   "'input[type=password]')) out.push(e.name || e.id); for (const f of d.querySelectorAll('iframe'))"
                   " { try { if (f.contentDocument) walk(f.contentDocument); } catch (e) {} } }; walk(document);"
                   " return out.filter(Boolean).slice(0, 50); })()")


async def capture(pipe: Any, tab: dict | None,
                  read_inputs: bool = True) -> tuple[bytes | None, str | None, tuple[str, ...]]:
    """A PNG of `tab`, its address and (`read_inputs`) the names of its password inputs. (None,
    address, ()) when it cannot be captured within CAPTURE_SECONDS. A tab whose own navigation
    is held cannot be read (Chromium holds every DevTools message to it until the navigation
    commits, measured on Chromium 156): its picture is the browser's, its inputs are not read."""
    if tab is None:
        return None, None, ()
    url = str(tab.get("url") or "") or None
    cdp = None
    try:
        async with asyncio.timeout(CAPTURE_SECONDS):
            cdp = await pipe.session("write gate capture")
            attached = await cdp.call("Target.attachToTarget", {"targetId": tab["targetId"], "flatten": True})
            sid = attached["sessionId"]
            try:
                shot = await cdp.call("Page.captureScreenshot", {"format": "png"}, session=sid)
                names: tuple[str, ...] = ()
                with contextlib.suppress(CdpCallError, TimeoutError, KeyError):
                    if not read_inputs:
                        return base64.b64decode(shot.get("data") or ""), url, names
                    res = await cdp.call("Runtime.evaluate", {"expression": PASSWORD_FIELDS, "returnByValue": True},
                                         session=sid, timeout=2)
                    value = (res.get("result") or {}).get("value")
                    if isinstance(value, list):
                        names = tuple(str(x)[:100] for x in value if isinstance(x, str))
                return base64.b64decode(shot.get("data") or ""), url, names
            finally:
                with contextlib.suppress(PipeClosed, CdpCallError, TimeoutError):
                    await cdp.call("Target.detachFromTarget", {"sessionId": sid}, timeout=2)
    except (PipeClosed, CdpCallError, TimeoutError, KeyError, ValueError) as exc:  # held without its picture
        log.info("no screenshot of the tab of a held write: %s", type(exc).__name__)
    finally:
        if cdp is not None:
            with contextlib.suppress(PipeClosed, OSError):
                await cdp.close()
    return None, url, ()
