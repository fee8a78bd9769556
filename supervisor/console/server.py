"""The operator console: an aiohttp server the guard runs, on loopback by default (issue 16).

    sfguard start [--console [HOST][:PORT]] [--console-url URL] [--console-tls-cert PEM
                  --console-tls-key PEM] [--console-trusted-proxy ADDRESS] [--console-public
                  [--console-plain-http]] [--no-console]          (listen.py checks them)
    sfguard console [--as NAME]  -> a one-time login link (at the public URL when one is set)

Pages (server-rendered with Jinja2, autoescaped; PAGES): overview (runs, stages, leases and
queues, browsers, proxies, site policy state), approvals (approvals_page.py), decisions (the
decision log with filters, the rule and its source line, a copy-ready `sfguard policy explain`),
profiles (names, scope, sealed or leased, last login check; never a cookie), audit (chain state
and the latest records), runs (runs_page.py), and the live view of a login handoff. `/events`
pushes fresh page fragments over SSE. Every page and endpoint needs a session from a one-time
link (sfguard.supervisor.console.auth; 401 otherwise); a live-view session reaches only its own
handoff. The middleware checks every request's peer, Host and Origin (an Origin is required on
every POST, which also needs its CSRF token; reach.py) and puts the same strict headers on every
answer (`_headers`).

What each session reaches, the checks and the headers, and why: docs/decisions/0029-console-sessions.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import WSMsgType, web
from aiohttp.typedefs import Handler

from sfguard.supervisor.console import approvals_page, pages, runs_page
from sfguard.supervisor.console import handoff as live
from sfguard.supervisor.console.auth import LINK_TTL, SESSION_TTL, ConsoleAuth, Session
from sfguard.supervisor.console.listen import ConsoleConfig
from sfguard.supervisor.console.reach import HSTS, Reach
from sfguard.supervisor.console.view import AUDIT_ERRORS, ConsoleView
from sfguard.supervisor.states import HandoffPhase

log = logging.getLogger("sfguard.console")

HERE = Path(__file__).resolve().parent
STATIC = {p.name: p for p in (HERE / "static").iterdir() if p.suffix in (".js", ".css")}
CONSOLE_COOKIE = "sfguard_console"
LIVE_COOKIE = "sfguard_live"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
       "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SSE_STEP = 1.0
SSE_HEARTBEAT = 15.0
PAGES = ("overview", "approvals", "decisions", "profiles", "audit", "runs")
REFUSED_PERIOD = 60.0       # refused sign-in links: at most one audit record a minute

def _text(value: object) -> str | None:
    """A form field as text (a file upload is no text)."""
    return value if isinstance(value, str) else None


NO_SESSION_TEXT = "no session for this live view: open its link, or sign in with `sfguard console`\n"


def _fmt_ts(ts: Any) -> str:
    if isinstance(ts, (int, float)):
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))
    return str(ts or "")


class ConsoleServer:
    def __init__(self, view: ConsoleView, config: ConsoleConfig | None = None):
        self.view = view          # all it reaches of the guard (console/view.py)
        self.cfg = config or ConsoleConfig()
        self.reach = Reach(self.cfg)             # where it listens, who may reach it
        self.session_ttl = min(float(self.cfg.session_ttl), SESSION_TTL)
        self.auth = ConsoleAuth(on_end=self._wake)
        self.handoffs: dict[str, live.LiveHandoff] = {}
        self._runner: web.AppRunner | None = None
        self._version = 0
        self._wakers: set[asyncio.Event] = set()   # one per open stream or live socket
        self._stopping = False
        self._refused = 0                          # refused sign-in links not yet audited
        self._refused_at = -REFUSED_PERIOD
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE / "templates")),
                                      autoescape=True, undefined=jinja2.StrictUndefined)
        self.env.filters["ts"] = _fmt_ts

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> str:
        app = self.app()
        self.view.approvals.listeners.append(self.notify)   # a write held or decided: pages update
        # open SSE streams and live-view sockets must not hold up the guard's stop
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        return await self.reach.listen(self._runner, self.view.home)

    @property
    def base_url(self) -> str:
        """The URL its links use: --console-url, else its own address."""
        return self.reach.base_url

    @property
    def port(self) -> int:
        return self.reach.port

    def describe(self) -> str:
        return self.reach.describe()

    def end_sessions(self) -> None:
        """The guard stops: every session ends, and with them every open stream and socket."""
        self._stopping = True
        self.auth.end_all()
        self._wake()

    async def stop(self) -> None:
        self.end_sessions()
        self._audit_refused(flush=True)
        await live.close_all(self)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def login_link(self, ttl: float = LINK_TTL, person: str | None = None) -> dict[str, Any]:
        token = self.auth.new_link("console", ttl=float(ttl), session_ttl=self.session_ttl,
                                   person=person)
        return {"url": f"{self.base_url}/login?t={token}",
                "expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + ttl))}

    def notify(self) -> None:
        self._version += 1
        self._wake()

    def _wake(self) -> None:
        """Wake every open stream and live socket: something changed, or a session ended."""
        for ev in list(self._wakers):
            ev.set()

    def session_live(self, sess: Session) -> bool:
        return not self._stopping and self.auth.live(sess)

    async def _until_changed(self, waker: asyncio.Event, sess: Session) -> None:
        """Wait for a change, at most SSE_STEP, and never past the session's expiry."""
        left = max(0.0, min(SSE_STEP, sess.expires - time.time()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(waker.wait(), left)

    # -- audit -------------------------------------------------------------------------------
    async def audit_event(self, event: str, **fields: Any) -> None:
        """An audit record of a console session, written before the answer goes out (so the
        chain keeps the order things happened in)."""
        await self.view.record_audit(event, **fields)

    def _audit_refused(self, flush: bool = False) -> None:
        """Refused sign-in links are counted; one record a minute at most carries the count
        (an unauthenticated client cannot flood the audit log), the rest at the guard's stop."""
        self._refused += 0 if flush else 1
        now = time.monotonic()
        if self._refused and (flush or now - self._refused_at >= REFUSED_PERIOD):
            count, self._refused, self._refused_at = self._refused, 0, now
            self.view.record_audit_later("the audit record of refused console links",   # never raises
                                         "console_sign_in_refused", count=count, reason="link_not_valid")

    # -- the app -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        @web.middleware
        async def guard_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not self.reach.peer_ok(request):
                return self._headers(web.Response(status=403, text=(
                    f"this console is reached through its proxy: open {self.base_url}\n")))
            if not self.reach.host_ok(request):
                return self._headers(web.Response(status=421, text="wrong Host for this console\n"))
            if request.method not in ("GET", "HEAD") and not self.reach.same_origin(request):
                return self._headers(web.Response(status=403, text="cross-origin request refused\n"))
            if "Origin" in request.headers and not self.reach.same_origin(request):
                # a page of another site, another port or a sandboxed frame (`null`) asks for a
                # page, a stream or a socket with the operator's cookie: refused like a POST
                return self._headers(web.Response(status=403, text="cross-origin request refused\n"))
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                resp = exc
            except Exception:   # every route's top: a bug answers 500, said in the log (the path, no query)
                log.exception("console error on %s %s", request.method, request.rel_url.path)
                resp = web.Response(status=500, text="internal error; see the guard's log\n")
            if isinstance(resp, web.StreamResponse) and not resp.prepared:
                self._headers(resp)
                if self.reach.hsts(request):
                    resp.headers["Strict-Transport-Security"] = HSTS
            return resp

        app = web.Application(middlewares=[guard_mw], client_max_size=64 * 1024)
        app.router.add_get("/login", self.h_login)
        app.router.add_post("/logout", self.h_logout)
        app.router.add_get("/", self.h_page)
        for name in PAGES[1:]:
            app.router.add_get(f"/{name}", self.h_page)
        app.router.add_get("/events", self.h_events)
        app.router.add_get("/metrics", self.h_metrics)
        app.router.add_get("/static/{name}", self.h_static)
        app.router.add_get("/live/{hid}", self.h_live)
        app.router.add_get("/live/{hid}/ws", self.h_live_ws)
        app.router.add_post("/live/{hid}/done", self.h_live_end)
        app.router.add_post("/live/{hid}/cancel", self.h_live_end)
        approvals_page.register(app, self)
        runs_page.register(app, self)      # run records and the controls of running runs
        return app

    @staticmethod
    def _headers(resp: web.StreamResponse) -> web.StreamResponse:
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["Referrer-Policy"] = "same-origin"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Cross-Origin-Opener-Policy"] = "same-origin"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    def render_page(self, name: str, status: int = 200, **ctx: Any) -> web.Response:
        html = self.env.get_template(name).render(**ctx)
        return web.Response(status=status, text=html, content_type="text/html", charset="utf-8")

    def _set_cookie(self, request: web.Request, resp: web.StreamResponse, name: str, value: str,
                    sess: Session, path: str) -> None:
        resp.set_cookie(name, value, max_age=max(1, int(sess.expires - time.time())), path=path,
                        httponly=True, samesite="Strict", secure=self.reach.secure(request))

    def console_session(self, request: web.Request) -> Session | None:
        """A console-scope session under the console cookie; a live-view session is not one,
        whatever name its cookie is sent under."""
        sess = self.auth.session(request.cookies.get(CONSOLE_COOKIE))
        return sess if sess is not None and sess.is_console else None

    def unauthorized(self, request: web.Request) -> web.Response:
        if request.headers.get("Accept", "").startswith("text/event-stream"):
            return web.Response(status=401, text="sign in with a link from `sfguard console`\n")
        return self.render_page("message.html", 401, title="Not signed in", session=None,
                                message="This console needs a session. Run `sfguard console` on the "
                                        "guard's machine and open the one-time link it prints.")

    # -- sign in / out -----------------------------------------------------------------------
    async def h_login(self, request: web.Request) -> web.StreamResponse:
        got = self.auth.redeem(request.query.get("t"), scope="console")
        if got is None:
            self._audit_refused()
            return self.render_page("message.html", 401, title="Link not valid", session=None,
                                    message="This login link was already used, has expired, or is "
                                            "not one of this guard's. Run `sfguard console` for a new one.")
        cookie, sess = got
        named = {"person": sess.person} if sess.person else {}
        if not await self._audited_sign_in(cookie, sess, mode="console", **named):
            return self.audit_down()
        # A page (not a redirect) that moves on by itself: the next request starts on this
        # site, so the SameSite=Strict cookie goes with it wherever the link was clicked.
        resp = self.render_page("moved.html", title="Signed in", target="/", session=None)
        self._set_cookie(request, resp, CONSOLE_COOKIE, cookie, sess, "/")
        log.info("console: session %s signed in%s from %s", sess.public_id,
                 f" as {sess.person}" if sess.person else "", self.reach.client(request))
        return resp

    async def _audited_sign_in(self, cookie: str, sess: Session, **fields: Any) -> bool:
        """Audit a sign-in before its cookie is handed out; a session the audit log cannot
        record is ended at once, whatever went wrong (fail closed)."""
        recorded = False
        try:
            await self.audit_event("console_signed_in", by=sess.public_id, **fields)
            recorded = True
        except AUDIT_ERRORS as exc:
            log.error("console: sign-in refused, the audit log could not record it (%s)",
                      type(exc).__name__)
        finally:
            if not recorded:
                self.auth.end_session(cookie)
        return recorded

    def audit_down(self) -> web.Response:
        return self.render_page("message.html", 503, title="Sign-in not recorded", session=None,
                                message="The guard could not write this sign-in to its audit log, "
                                        "so it refused it. See the guard's log.")

    async def h_logout(self, request: web.Request) -> web.StreamResponse:
        sess = self.console_session(request)
        if sess is None:
            return self.unauthorized(request)
        form = await request.post()
        if not sess.csrf_ok(_text(form.get("csrf")) or request.headers.get("X-CSRF-Token")):
            return web.Response(status=403, text="CSRF token missing or wrong\n")
        self.auth.end_session(request.cookies.get(CONSOLE_COOKIE))
        try:
            await self.audit_event("console_signed_out", by=sess.public_id, reason="logout")
        except AUDIT_ERRORS as exc:   # signed out all the same; the log says what is missing
            log.error("console: sign-out of %s not audited (%s)", sess.public_id, type(exc).__name__)
        log.info("console: session %s signed out", sess.public_id)
        resp = self.render_page("message.html", title="Signed out", session=None,
                                message="Signed out. Run `sfguard console` to sign in again.")
        resp.del_cookie(CONSOLE_COOKIE, path="/")
        return resp

    async def h_static(self, request: web.Request) -> web.StreamResponse:
        path = STATIC.get(request.match_info["name"])
        if path is None:
            raise web.HTTPNotFound()
        ctype = "text/javascript" if path.suffix == ".js" else "text/css"
        return web.Response(body=path.read_bytes(), content_type=ctype, charset="utf-8")

    # -- pages -------------------------------------------------------------------------------
    async def h_page(self, request: web.Request) -> web.StreamResponse:
        sess = self.console_session(request)
        if sess is None:
            return self.unauthorized(request)
        page = request.path.strip("/") or "overview"
        ctx = await self.page_context(page, dict(request.query))
        return self.render_page(f"{page}.html", page=page, session=sess, **ctx)

    async def h_metrics(self, request: web.Request) -> web.StreamResponse:
        """The guard's Prometheus metrics (supervisor/daemon/metrics.py) for a console session,
        as the control API serves them."""
        if self.console_session(request) is None:
            return web.Response(status=401, text="sign in with a link from `sfguard console`\n")
        body, content_type = await self.view.metrics()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def page_context(self, page: str, query: dict[str, str]) -> dict[str, Any]:
        """What a page shows (supervisor/console/pages.py)."""
        return await pages.page_context(self.view, self.handoffs, page, query)

    # -- live updates ------------------------------------------------------------------------
    async def h_events(self, request: web.Request) -> web.StreamResponse:
        sess = self.console_session(request)
        if sess is None:
            return self.unauthorized(request)
        if request.headers.get("Sec-Fetch-Site") in ("cross-site", "same-site"):
            # no Origin (an <img> or <script> of another page), but the browser says whose
            return web.Response(status=403, text="cross-origin request refused\n")
        page = request.query.get("page", "overview")
        if page not in PAGES:
            raise web.HTTPBadRequest(text="unknown page\n")
        query = {k: v for k, v in request.query.items() if k != "page"}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self._headers(resp)
        await resp.prepare(request)
        last, beat = "", time.monotonic()
        waker = asyncio.Event()
        self._wakers.add(waker)
        try:
            while self.session_live(sess):
                waker.clear()     # a change while this renders wakes the next wait at once
                ctx = await self.page_context(page, query)
                if not self.session_live(sess):
                    break
                html = self.env.get_template(f"_{page}.html").render(session=sess, **ctx)
                digest = hashlib.sha256(html.encode()).hexdigest()
                if digest != last:
                    last = digest
                    data = "\n".join(f"data: {line}" for line in html.splitlines() or [""])
                    await resp.write(f"event: update\n{data}\n\n".encode())
                    beat = time.monotonic()
                elif time.monotonic() - beat > SSE_HEARTBEAT:
                    await resp.write(b": keep-alive\n\n")
                    beat = time.monotonic()
                await self._until_changed(waker, sess)
            # the session ended: say so (the page stops reconnecting), then end the stream
            await resp.write(b"event: ended\ndata: signed out\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._wakers.discard(waker)
        return resp

    # -- live view ---------------------------------------------------------------------------
    def _live(self, request: web.Request) -> tuple[live.LiveHandoff | None, Session | None]:
        h = self.handoffs.get(request.match_info["hid"])
        if h is None:
            return None, None
        # this handoff's own live session under the live cookie, or a console session
        sess = self.auth.session(request.cookies.get(LIVE_COOKIE))
        if sess is None or sess.scope != h.scope:
            sess = self.console_session(request)
        return h, sess

    def _live_gone(self) -> web.Response:
        return self.render_page("message.html", 410, title="Live view ended", session=None,
                                message="This live view has ended (done, cancelled, timed out, or its "
                                        "stage ended). Its link no longer works.")

    async def h_live(self, request: web.Request) -> web.StreamResponse:
        hid = request.match_info["hid"]
        h = self.handoffs.get(hid)
        if "t" in request.query:
            got = self.auth.redeem(request.query.get("t"), scope=f"live:{hid}")
            if got is None or h is None or h.state != HandoffPhase.OPEN:
                self._audit_refused()
                return self.render_page("message.html", 401, title="Link not valid", session=None,
                                        message="This live-view link was already used, has expired, "
                                                "or its login has ended.")
            cookie, live_sess = got
            if not await self._audited_sign_in(cookie, live_sess, mode="live_view",
                                               run=h.run_id, profile=h.profile):
                return self.audit_down()
            resp = self.render_page("moved.html", title="Live view", target=f"/live/{hid}", session=None)
            self._set_cookie(request, resp, LIVE_COOKIE, cookie, live_sess, f"/live/{hid}")
            return resp
        h, sess = self._live(request)
        if h is None or h.state != HandoffPhase.OPEN:
            return self._live_gone() if (h is not None or sess is not None) else self.unauthorized(request)
        if sess is None:
            return self.unauthorized(request)
        live.viewed(self, h, sess.public_id)
        return self.render_page("live.html", page="live", session=sess, h=h,
                                state=h.view.state(), csrf=sess.csrf)

    async def h_live_ws(self, request: web.Request) -> web.StreamResponse:
        h, sess = self._live(request)
        if h is None or sess is None:
            return web.Response(status=401, text=NO_SESSION_TEXT)
        if h.state != HandoffPhase.OPEN:
            return web.Response(status=410, text="this live view has ended\n")
        if not self.reach.same_origin(request):
            return web.Response(status=403, text="cross-origin WebSocket refused\n")
        ws = web.WebSocketResponse(heartbeat=20, max_msg_size=16 * 1024)
        await ws.prepare(request)
        q = h.view.add_viewer()
        waker = asyncio.Event()
        self._wakers.add(waker)

        async def watch() -> None:
            # the socket's session ends (sign-out, expiry, the guard's stop): the socket too
            while self.session_live(sess) and not h.view.closed.is_set():
                waker.clear()
                await self._until_changed(waker, sess)
            h.view.end_viewer(q)

        async def pump() -> None:
            while True:
                item = await q.get()
                if item is None:
                    break
                kind, payload = item
                if kind == "frame":
                    await ws.send_bytes(payload)
                else:
                    await ws.send_str(json.dumps(payload))
            # the handoff ended (its sessions end with it), or only this socket's session
            ended = h.finishing or h.state != HandoffPhase.OPEN or h.view.closed.is_set()
            state = h.view.outcome if ended else "signed_out"
            with contextlib.suppress(ConnectionError, RuntimeError):   # the viewer already left
                await ws.send_str(json.dumps({"t": "ended", "state": state}))
            await ws.close()

        loop = asyncio.get_running_loop()
        sender = loop.create_task(pump())
        watcher = loop.create_task(watch())
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT or h.state != HandoffPhase.OPEN:
                    continue
                if not self.session_live(sess):
                    break       # the session ended: no more input
                try:
                    data = json.loads(msg.data)
                except ValueError:
                    continue
                await h.view.input(data)
        finally:
            self._wakers.discard(waker)
            h.view.remove_viewer(q)
            for task in (sender, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await ws.close()
        return ws

    async def h_live_end(self, request: web.Request) -> web.StreamResponse:
        h, sess = self._live(request)
        if h is None or sess is None:
            return web.Response(status=401, text=NO_SESSION_TEXT)
        form = await request.post()
        if not sess.csrf_ok(_text(form.get("csrf")) or request.headers.get("X-CSRF-Token")):
            return web.Response(status=403, text="CSRF token missing or wrong\n")
        if h.state != HandoffPhase.OPEN:
            return self._live_gone()
        outcome = "done" if request.path.endswith("/done") else "cancelled"
        # a named console session decides as its person (console:NAME), else as its id
        result = await live.finish(self, h, outcome,
                                   by=sess.decider if sess.person else sess.public_id)
        return self.render_page("live_result.html", title="Live view ended", session=None, result=result)
