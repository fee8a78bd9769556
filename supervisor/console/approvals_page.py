"""The console's approvals: the held writes a person decides (supervisor/writes/approvals.py,
the same store as `sfguard approvals` and the control API).

  GET  /approvals                    the page (pending ones with their screenshot, the request
                                     and two buttons; the recently decided below); live updates
  GET  /approvals/{id}/screenshot    the tab as it was when the write was held (PNG)
  POST /approvals/{id}               decision=approve|deny, reason, csrf: decided by this
                                     console session (the audit chain names it: console:NAME
                                     for a link made with `--as NAME`, else console:<session id>)

Every route wants a console-scope session; a decision also its CSRF token and the console's
own Origin (the server's middleware refuses other origins)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sfguard.supervisor.console.view import ConsoleView
from sfguard.supervisor.states import ApprovalState
from sfguard.supervisor.writes.approvals import ApprovalDecided, ApprovalNotFound

if TYPE_CHECKING:
    from sfguard.supervisor.console.server import ConsoleServer

APPROVAL_ID = re.compile(r"^ap_[0-9a-f]{20}$")
#: decided approvals shown under the pending ones
DECIDED_SHOWN = 20
MAX_REASON = 500


def context(view: ConsoleView) -> dict[str, Any]:
    items = view.approvals.listing()
    pending = [a for a in items if a["state"] == ApprovalState.PENDING]
    decided = [a for a in reversed(items) if a["state"] != ApprovalState.PENDING][:DECIDED_SHOWN]
    return {"pending": pending, "decided": decided}


def register(app: web.Application, server: ConsoleServer) -> None:
    """The routes on the console's app (the server subscribes its pages to the store when it
    starts: ConsoleServer.start)."""

    def lookup(request: web.Request) -> str:
        aid = request.match_info["aid"]
        if not APPROVAL_ID.fullmatch(aid):
            raise web.HTTPNotFound(text="no such approval\n")
        return aid

    async def screenshot(request: web.Request) -> web.StreamResponse:
        if server.console_session(request) is None:
            return server.unauthorized(request)
        aid = lookup(request)
        try:
            png = server.view.approvals.get(aid).held.screenshot
        except ApprovalNotFound:
            png = None
        if png is None:
            raise web.HTTPNotFound(text="no screenshot for this approval\n")
        return web.Response(body=png, content_type="image/png")

    async def decide(request: web.Request) -> web.StreamResponse:
        sess = server.console_session(request)
        if sess is None:
            return server.unauthorized(request)
        form = await request.post()
        csrf = form.get("csrf")
        if not sess.csrf_ok(csrf if isinstance(csrf, str) else None):
            return web.Response(status=403, text="CSRF token missing or wrong\n")
        aid = lookup(request)
        decision = form.get("decision")
        if decision not in ("approve", "deny"):
            raise web.HTTPBadRequest(text="decision is approve or deny\n")
        reason = form.get("reason")
        reason = reason.strip()[:MAX_REASON] if isinstance(reason, str) else ""
        try:
            server.view.approvals.answer(aid, decision == "approve", sess.decider, reason)
        except ApprovalNotFound:
            raise web.HTTPNotFound(text="no such approval\n") from None
        except ApprovalDecided as exc:
            return server.render_page("message.html", 409, title="Already decided", session=sess,
                                      message=f"{exc}. Nothing was changed.")
        server.notify()
        raise web.HTTPSeeOther("/approvals")

    app.router.add_get("/approvals/{aid}/screenshot", screenshot)
    app.router.add_post("/approvals/{aid}", decide)
