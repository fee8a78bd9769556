"""The console's runs: their records (supervisor/record) and the controls over running ones.

  GET  /runs                                   runs listed, newest first, searchable (words,
                                               pipeline, profile, outcome, dates); live updates
  GET  /runs/{rid}                             a run's page: its timeline with screenshots,
                                               filters (stage, kind, refused only; `at`: the
                                               moment of a decision line), and, while it runs,
                                               its stages and browsers with their controls
  GET  /runs/{rid}/shots/{shot}                one screenshot of its record
  GET  /runs/{rid}/stages/{sid}/watch          a read-only live view of the stage's tab
  GET  /runs/{rid}/stages/{sid}/watch/ws       its frames (nothing a viewer sends reaches the tab)
  POST /runs/{rid}/end                         end the run (cancelled)
  POST /runs/{rid}/stages/{sid}/cancel         cancel a stage (a waiting one leaves its queue)
  POST /runs/{rid}/browsers/{bkey}/restart     restart a browser of the run (its stages get new
                                               tokens, like after a crash)

Every route wants a console-scope session (a live-view session reaches only its own handoff);
a POST also its CSRF token and the console's Origin (the server's middleware). Each control
and each first watch of a stage is audited before it acts, with who did it (console:NAME or
the session's public id): an action the audit chain cannot record is refused (503).
"""
from __future__ import annotations

import asyncio
import calendar
import contextlib
import json
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from sfguard.supervisor import models
from sfguard.supervisor.console.auth import Session
from sfguard.supervisor.console.liveview import TAB_ERRORS
from sfguard.supervisor.console.view import AUDIT_ERRORS, ConsoleView, RunView, StageView
from sfguard.supervisor.errors import GuardError
from sfguard.supervisor.gate.cdp_pipe import CdpPipe
from sfguard.supervisor.protocols import validate_run_id
from sfguard.supervisor.record import catalog, files
from sfguard.supervisor.record import view as record_view
from sfguard.supervisor.record.watch import WatchView
from sfguard.supervisor.states import WAITING_STATES, RunState, StageState

if TYPE_CHECKING:
    from sfguard.supervisor.console.server import ConsoleServer

log = logging.getLogger("sfguard.console")

STAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SHOT_RE = re.compile(r"^[0-9]{5}\.(jpg|png)$")
BROWSER_RE = re.compile(r"^(tmp-)?[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
LISTED = 200
SHOWN = 3000
WATCH_STEP = 0.5
FILTERS = ("q", "pipeline", "profile", "outcome", "since", "until")


def _day(text: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%d"))) if text else None
    except ValueError:
        return None


async def context(view: ConsoleView, query: dict[str, str]) -> dict[str, Any]:
    """The runs page: records (this home's, a fleet's on a shared store) matching the filters."""
    f = {k: query.get(k, "").strip()[:200] for k in FILTERS}
    until = _day(f["until"])
    lines = await asyncio.to_thread(catalog.listing, view.records_root, view.records_backend)
    shown = [x for x in lines if record_view.matches(
        x, text=f["q"], pipeline=f["pipeline"], profile=f["profile"], outcome=f["outcome"],
        since=_day(f["since"]), until=until + 86400 if until is not None else None)]
    active = {r.run_id for r in view.runs.values() if r.state == RunState.ACTIVE}
    return {"records": shown[:LISTED], "more": max(0, len(shown) - LISTED), "filters": f, "active": active,
            "recording": view.recording_level}


def register(app: web.Application, server: ConsoleServer) -> None:
    routes = RunsRoutes(server)
    app.router.add_get("/runs/{rid}", routes.page)
    app.router.add_get("/runs/{rid}/shots/{shot}", routes.shot)
    app.router.add_get("/runs/{rid}/stages/{sid}/watch", routes.watch_page)
    app.router.add_get("/runs/{rid}/stages/{sid}/watch/ws", routes.watch_ws)
    app.router.add_post("/runs/{rid}/end", routes.end_run)
    app.router.add_post("/runs/{rid}/stages/{sid}/cancel", routes.cancel_stage)
    app.router.add_post("/runs/{rid}/browsers/{bkey}/restart", routes.restart_browser)


class RunsRoutes:
    def __init__(self, server: ConsoleServer):
        self.server = server
        self.watched: set[tuple[str, str, str]] = set()   # (session, run, stage) audited once

    @property
    def view(self) -> ConsoleView:
        return self.server.view

    # -- lookups ------------------------------------------------------------------------------
    @staticmethod
    def _rid(request: web.Request) -> str:
        rid = request.match_info["rid"]
        try:
            return validate_run_id(rid)
        except ValueError:
            raise web.HTTPNotFound(text="no such run\n") from None

    @staticmethod
    def _part(request: web.Request, name: str, pattern: re.Pattern[str]) -> str:
        value = request.match_info[name]
        if not pattern.fullmatch(value):
            raise web.HTTPNotFound(text=f"no such {name}\n")
        return value

    def _folder(self, rid: str) -> Path | None:
        root = self.view.records_root
        return catalog.find(root, rid, self.view.records_backend, root / catalog.SHARED_CACHE)

    def _session(self, request: web.Request) -> Session | None:
        return self.server.console_session(request)

    async def _csrf(self, request: web.Request, sess: Session) -> bool:
        form = await request.post()
        token = form.get("csrf")
        return sess.csrf_ok(token if isinstance(token, str) else None)

    async def _audited(self, event: str, sess: Session, **fields: Any) -> bool:
        """The audit record of a console action, before it acts; False: not recorded (refuse).
        Anything else the chain raises goes up: the action does not happen either."""
        try:
            await self.server.audit_event(event, by=sess.decider, **fields)
        except AUDIT_ERRORS as exc:
            log.error("console: %s refused, the audit log could not record it (%s)", event, type(exc).__name__)
            return False
        return True

    # -- pages --------------------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.StreamResponse:
        sess = self._session(request)
        if sess is None:
            return self.server.unauthorized(request)
        rid = self._rid(request)
        q = request.query
        stage, kind = q.get("stage", "")[:128], q.get("kind", "")[:30]
        only_refused = q.get("refused") in ("1", "on", "yes")
        folder = await asyncio.to_thread(self._folder, rid)
        run = self.view.runs.get(rid)
        if folder is None and run is None:
            raise web.HTTPNotFound(text="no such run (and no record of it)\n")
        index: dict[str, Any] = {}
        rows: list[dict[str, Any]] = []
        problems: list[str] = []
        if folder is not None:
            entries, _head, problems = await asyncio.to_thread(files.read_entries, folder)
            index = files.read_index(folder) or {}
            rows = record_view.rows(entries, stage=stage or None, kind=kind or None, only_refused=only_refused)
        at = record_view.nearest(rows, q.get("at", "")[:40])
        stages = sorted({r["stage"] for r in rows if r["stage"]} | set(index.get("stages") or []))
        return self.server.render_page("run.html", page="runs", session=sess, rid=rid, index=index, run=_live(run),
                                       rows=rows[:SHOWN], more=max(0, len(rows) - SHOWN), problems=problems,
                                       stage=stage, kind=kind, refused=only_refused, kinds=record_view.KINDS, at=at,
                                       stages=stages,
                                       record_name=folder.name if folder is not None else None)

    async def shot(self, request: web.Request) -> web.StreamResponse:
        if self._session(request) is None:
            return self.server.unauthorized(request)
        rid, name = self._rid(request), self._part(request, "shot", SHOT_RE)
        folder = await asyncio.to_thread(self._folder, rid)
        path = folder / files.SHOTS / name if folder is not None else None
        if path is None or not path.is_file() or path.is_symlink():
            raise web.HTTPNotFound(text="no such screenshot\n")
        data = await asyncio.to_thread(path.read_bytes)
        return web.Response(body=data, content_type="image/png" if name.endswith(".png") else "image/jpeg")

    # -- the read-only watch ------------------------------------------------------------------
    def _ready_stage(self, rid: str, sid: str) -> tuple[RunView, StageView]:
        run = self.view.runs.get(rid)
        stage = run.stages.get(sid) if run is not None else None
        if run is None or stage is None:
            raise web.HTTPNotFound(text="no such stage\n")
        return run, stage

    async def watch_page(self, request: web.Request) -> web.StreamResponse:
        sess = self._session(request)
        if sess is None:
            return self.server.unauthorized(request)
        rid, sid = self._rid(request), self._part(request, "sid", STAGE_RE)
        run, stage = self._ready_stage(rid, sid)
        if stage.state != StageState.READY or run.state != RunState.ACTIVE:
            return self.server.render_page("message.html", 410, page="runs", title="Nothing to watch", session=sess,
                                           message=f"Stage {sid} of run {rid} is {stage.state}: only a running "
                                                   "stage's tab can be watched.")
        if not await self._watched(sess, rid, sid):
            return self.server.audit_down()
        return self.server.render_page("watch.html", page="runs", session=sess, rid=rid, sid=sid)

    async def _watched(self, sess: Session, rid: str, sid: str) -> bool:
        """Audit the first watch of a stage by a session (its page or its socket); False: the
        audit chain could not record it (the watch is refused)."""
        key = (sess.public_id, rid, sid)
        if key not in self.watched:
            if not await self._audited("console_stage_watched", sess, run=rid, stage=sid):
                return False
            self.watched.add(key)
        return True

    def _tab(self, run: RunView, stage: StageView) -> tuple[CdpPipe, str] | None:
        browser = run.browsers.get(stage.browser_key or "")
        pipe = browser.anchor.pipe if browser is not None and browser.anchor else None
        if pipe is None or not stage.gate_key:
            return None
        last = self.view.last_tab(run.run_id, stage.stage_id)
        tabs = self.view.stage_tabs(stage.gate_key)
        pages = [t for t in sorted(tabs) if (pipe.targets.get(t) or {}).get("type") == "page"]
        tab = last if last in tabs else (pages[0] if pages else None)
        return (pipe, tab) if tab else None

    async def watch_ws(self, request: web.Request) -> web.StreamResponse:
        sess = self._session(request)
        if sess is None:
            return web.Response(status=401, text="sign in with a link from `sfguard console`\n")
        rid, sid = self._rid(request), self._part(request, "sid", STAGE_RE)
        run, stage = self._ready_stage(rid, sid)
        found = self._tab(run, stage) if stage.state == StageState.READY else None
        if found is None:
            return web.Response(status=410, text="this stage has no tab to watch\n")
        if not await self._watched(sess, rid, sid):
            return web.Response(status=503, text="the audit log could not record this watch\n")
        view_ = WatchView(found[0], found[1], name=f"watch:{rid}/{sid}")
        try:
            await view_.start()
        except TAB_ERRORS as exc:   # a tab that cannot be watched is said, never raised
            log.info("console: the tab of stage %s/%s cannot be watched (%s)", rid, sid, type(exc).__name__)
            await view_.close()
            return web.Response(status=503, text="the stage's tab cannot be watched now\n")
        ws = web.WebSocketResponse(heartbeat=20, max_msg_size=4096)
        await ws.prepare(request)
        try:
            await self._pump(ws, view_, sess, run, stage)
        finally:
            await view_.close()
            await ws.close()
        return ws

    async def _pump(self, ws: web.WebSocketResponse, view_: WatchView, sess: Session, run: RunView,
                    stage: StageView) -> None:
        q = view_.add_viewer()

        async def send() -> None:
            while (item := await q.get()) is not None:
                kind, payload = item
                await (ws.send_bytes(payload) if kind == "frame" else ws.send_str(json.dumps(payload)))

        async def drain() -> None:      # read and drop: a watch has no input path
            async for msg in ws:
                if msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                    break

        async def watch() -> None:
            while (self.server.session_live(sess) and stage.state == StageState.READY
                   and run.state == RunState.ACTIVE and not view_.closed.is_set()):
                await asyncio.sleep(WATCH_STEP)

        tasks = [asyncio.ensure_future(c) for c in (send(), drain(), watch())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            view_.remove_viewer(q)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(json.dumps({"t": "ended", "state": str(stage.state)}))

    # -- controls -----------------------------------------------------------------------------
    async def _control(self, request: web.Request) -> tuple[Session, str] | web.StreamResponse:
        sess = self._session(request)
        if sess is None:
            return self.server.unauthorized(request)
        if not await self._csrf(request, sess):
            return web.Response(status=403, text="CSRF token missing or wrong\n")
        return sess, self._rid(request)

    def _done(self, rid: str) -> web.StreamResponse:
        self.server.notify()
        raise web.HTTPSeeOther(f"/runs/{rid}")

    def _refused(self, sess: Session, text: str, status: int = 409) -> web.StreamResponse:
        return self.server.render_page("message.html", status, page="runs", title="Not done", session=sess,
                                           message=text)

    async def end_run(self, request: web.Request) -> web.StreamResponse:
        got = await self._control(request)
        if not isinstance(got, tuple):
            return got
        sess, rid = got
        run = self.view.runs.get(rid)
        if run is None or run.state != RunState.ACTIVE:
            return self._refused(sess, f"Run {rid} is not running. Nothing was changed.")
        if not await self._audited("console_run_ended", sess, run=rid):
            return self.server.audit_down()
        await self.view.end_run(rid, models.RunEnd(outcome="cancelled"))
        return self._done(rid)

    async def cancel_stage(self, request: web.Request) -> web.StreamResponse:
        got = await self._control(request)
        if not isinstance(got, tuple):
            return got
        sess, rid = got
        sid = self._part(request, "sid", STAGE_RE)
        run = self.view.runs.get(rid)
        stage = run.stages.get(sid) if run is not None and run.state == RunState.ACTIVE else None
        if stage is None or stage.state in (StageState.ENDED, StageState.FAILED):
            return self._refused(sess, f"Stage {sid} of run {rid} is not running. Nothing was changed.")
        if not await self._audited("console_stage_cancelled", sess, run=rid, stage=sid):
            return self.server.audit_down()
        try:
            if stage.state in WAITING_STATES and stage.state != StageState.RELAUNCHING:
                await self.view.cancel_stage(rid, sid)
            else:
                await self.view.end_stage(rid, sid, models.StageEnd(outcome="cancelled"))
        except GuardError as exc:
            return self._refused(sess, f"{exc.message}. Nothing was changed.")
        return self._done(rid)

    async def restart_browser(self, request: web.Request) -> web.StreamResponse:
        got = await self._control(request)
        if not isinstance(got, tuple):
            return got
        sess, rid = got
        bkey = self._part(request, "bkey", BROWSER_RE)
        run = self.view.runs.get(rid)
        browser = run.browsers.get(bkey) if run is not None and run.state == RunState.ACTIVE else None
        if browser is None or browser.anchor is None or browser.closing:
            return self._refused(sess, f"Run {rid} has no running browser {bkey}. Nothing was changed.")
        fields = {"profile": browser.profile.name} if browser.profile is not None else {}
        if not await self._audited("console_browser_restarted", sess, run=rid, **fields):
            return self.server.audit_down()
        await self.view.restart_browser(rid, bkey, by=sess.decider)
        return self._done(rid)


def _live(run: RunView | None) -> dict[str, Any] | None:
    """What the run page shows of a run the guard still has: its state, stages, browsers."""
    if run is None:
        return None
    return {"state": str(run.state), "outcome": run.outcome,
            "stages": [{"id": s.stage_id, "attempt": s.attempt, "state": str(s.state), "profile": s.browser_req.profile,
                        "ready": s.state == StageState.READY, "over": s.state in (StageState.ENDED, StageState.FAILED)}
                       for s in run.stages.values()],
            "browsers": [{"key": b.key, "profile": b.profile.name if b.profile else None,
                          "alive": b.anchor is not None, "restarts": b.restarts} for b in run.browsers.values()]}
