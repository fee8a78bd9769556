"""The control API: aiohttp routes over a unix socket (and optionally loopback TCP with a
bearer token). JSON in and out; every input through a pydantic model; every error is
{"error": {"code", "message", "field"}} with a 4xx status, never a traceback.

The routes are declared once in ROUTES; the OpenAPI document is generated from the same table
and the same models, so a runner in another language can generate its client from it.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from sfguard.supervisor import models as m
from sfguard.supervisor import redaction
from sfguard.supervisor.daemon import approval_models as am
from sfguard.supervisor.daemon import key_models as km
from sfguard.supervisor.daemon import status_models as sm
from sfguard.supervisor.daemon.callers import CALLER, caller_of
from sfguard.supervisor.daemon.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sfguard.supervisor.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    GuardError,
    NotFound,
    Unavailable,
    Unprocessable,
)

log = logging.getLogger("sfguard.api")
#: path parameters are validated like body fields (the same patterns as the models)
PATH_PARAMS = {"run_id": re.compile(m.RUN_ID), "stage_id": re.compile(m.STAGE_ID),
               "name": re.compile(m.PROFILE_NAME), "approval_id": am.APPROVAL_ID_RE}
MAX_BODY = 256 * 1024


#: The one mapping of the guard's domain errors (supervisor/errors.py) to HTTP.
ERROR_STATUS: dict[type[GuardError], int] = {
    BadRequest: 400, Forbidden: 403, NotFound: 404, Conflict: 409, Unprocessable: 422,
    Unavailable: 503,
}


def status_of(exc: GuardError) -> int:
    """The HTTP status of a domain error (its kind's; a kind not listed is a bug: 500)."""
    return next((status for kind, status in ERROR_STATUS.items() if isinstance(exc, kind)), 500)


def error_response(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    body = {"error": {"code": code, "message": message, "field": field}}
    return web.json_response(body, status=status)


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p not in ("function-after", "function-before"))


def validation_error(exc: ValidationError, model: type[BaseModel]) -> BadRequest:
    """Every error (at most 20), each worded as `sfguard validate` words it
    (sfguard.supervisor.models.error_message) after its field, joined by "; "; `field`
    names the first."""
    errors = exc.errors()
    parts = []
    for err in errors[:20]:
        where = m.field_path(err["loc"]) or None
        msg = m.error_message(err, model)
        parts.append(f"{where}: {msg}" if where else msg)
    if len(errors) > 20:
        parts.append(f"... and {len(errors) - 20} more")
    return BadRequest("invalid_request", "; ".join(parts), m.field_path(errors[0]["loc"]) or None)


#: the longest a stage GET may wait for a change (`?wait=SECONDS`)
MAX_WAIT = 60.0

# Errors every route can give, and those of routes with a body or path parameters.
# (invalid_request on every route: a bad path parameter or an unknown query parameter)
EDGE_ERRORS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (400, ("invalid_request",)), (401, ("unauthorized",)), (405, ("method_not_allowed",)),
    (500, ("internal",)))
BODY_ERRORS = ((400, ("invalid_json",)), (413, ("body_too_large",)))
STATUS_TEXT = {400: "bad input", 401: "no or a wrong bearer token (TCP listener only)",
               403: "refused: by the site policy, or the metrics token on a route it does not open",
               404: "no such run, stage or profile",
               405: "method not allowed on this route", 409: "conflicts with the current state",
               413: "body too large", 422: "the check could not decide", 500: "a bug: see the guard's log",
               503: "the browser could not be started, the shared store is unreachable, the guard's "
                    "disk is full, or (health) the guard is not ready"}
#: the metrics token (`sfguard start --metrics-token-file`) on a route it does not open
TOKEN_SCOPE = (403, ("token_scope",))
#: who may call a route on the TCP listener: `full` (the --tcp token), `scrape` (that token or
#: the metrics token), `open` (anyone: the health probes). The unix socket's mode is its check.
ACCESS = ("full", "scrape", "open")

#: What a code means at one status, where the guard answers that code with more than one status
#: (supervisor/daemon/stage_browser.py browser_failed): each route that lists the pair says so.
ERROR_CAUSES: dict[tuple[int, str], str] = {
    (409, "browser_failed"): "the profile's store refused to open the profile for the browser (its "
                             "sealed copy is damaged, its key is missing, or it is open elsewhere); the "
                             "message names the profile. Asking again does not help: tell the operator",
    (503, "browser_failed"): "the browser or the run's proxy did not start, or a page could not be "
                             "opened in it; retry later (a stage as a new attempt)",
}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: str  # "api_" + the name of the Guard's service method (and the operationId)
    summary: str
    body: type[BaseModel] | None = None
    answers: tuple[tuple[int, Any], ...] = ()     # (status, model or tuple of models)
    errors: tuple[tuple[int, tuple[str, ...]], ...] = ()   # beyond the edge, body and path errors
    description: str = ""
    query: tuple[str, ...] = ()                   # accepted query parameters
    service: str = ""                             # the Guard's service that answers (default: the Guard)
    access: str = "full"                          # who may call it over TCP (ACCESS)

    @property
    def operation(self) -> str:
        """The Guard's service method for this route."""
        return self.handler.removeprefix("api_")

    def success_status(self, answer: Any) -> int:
        """The status of a plain answer: 202 for a stage that is still waiting, else the
        route's first documented success status (201 for a created run, 200 otherwise)."""
        statuses = [status for status, _model in self.answers]
        if 202 in statuses and isinstance(answer, dict) and answer.get("state") == "waiting":
            return 202
        return statuses[0]

    def error_codes(self) -> dict[int, tuple[str, ...]]:
        """status -> error codes this route can answer (edge, body, path and its own)."""
        out: dict[int, list[str]] = {}
        edge = [e for e in EDGE_ERRORS if self.access != "open" or e[0] != 401]
        groups = (edge + (list(BODY_ERRORS) if self.body else []) + list(self.errors)
                  + ([TOKEN_SCOPE] if self.access == "full" else []))
        for status, codes in groups:
            for code in codes:
                if code not in out.setdefault(status, []):
                    out[status].append(code)
        return {k: tuple(v) for k, v in sorted(out.items())}


_RUN = ((404, ("run_not_found",)),)
ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/runs", "api_create_run", "Register a run", m.CreateRun,
          ((201, m.RunCreated),), ((409, ("run_exists",)),),
          "Register a pipeline run before its first browser stage. `pipeline` (the pipeline file's "
          "path) lets stages use the profile `@pipeline`, a name derived from that path."),
    Route("GET", "/v1/runs/{run_id}", "api_get_run", "A run's state (no secrets)", None,
          ((200, m.RunInfo),), _RUN,
          "The run's stages, browsers and proxy as the guard holds them: names and states only."),
    Route("POST", "/v1/runs/{run_id}/end", "api_end_run", "End a run: tear down its browsers, "
          "reseal its profiles, release its leases", m.RunEnd, ((200, m.RunEndAnswer),), _RUN,
          "Call once the run is terminal (any outcome). Ends every stage still open, closes the "
          "browsers gracefully (cookies are flushed), reseals profiles, stops the run's proxy and "
          "hands released profiles to the next run in their queue. Ending an ended run answers "
          "the same again."),
    Route("POST", "/v1/runs/{run_id}/stages", "api_request_stage",
          "Ask for a stage's browser: ready with the stage env, or waiting for a lease",
          m.StageRequest, ((200, m.StageReady), (202, m.StageWaiting)),
          _RUN + ((400, ("no_pipeline", "no_display")), (403, ("reviewer_only_address",)),
                  (409, ("run_ended", "stage_active", "attempt_used", "browser_failed")),
                  (503, ("browser_failed", "disk_full"))),
          "200 `ready` with the env to start the stage with (and `exec_prefix`, to run it "
          "confined); 202 `waiting` when another run "
          "holds the profile (poll the stage, or long-poll with ?wait=). The same request again "
          "(same stage_id, attempt and browser) is a resume and answers the same env."),
    Route("GET", "/v1/runs/{run_id}/stages/{stage_id}", "api_get_stage",
          "Poll a stage: the same answer as the request, identical env on resume",
          None, ((200, (m.StageReady, m.StageEnded)), (202, m.StageWaiting)),
          _RUN + ((404, ("stage_not_found",)), (409, ("browser_failed",)),
                  (503, ("browser_failed", "disk_full"))),
          f"Without `wait`, answers at once. With `?wait=SECONDS` (0-{MAX_WAIT:.0f}) a waiting "
          "stage's answer is held until it is ready or failed, or the time is up (then 202 "
          "again); poll again at once. Without long-poll, poll every 1-2 seconds.",
          query=("wait",)),
    Route("DELETE", "/v1/runs/{run_id}/stages/{stage_id}", "api_cancel_stage",
          "Withdraw a waiting stage request: leave the profile's queue",
          None, ((200, m.StageEnded),),
          _RUN + ((404, ("stage_not_found",)), (409, ("stage_not_waiting",))),
          "For a stage that is waiting (202): it leaves the queue and ends as `cancelled`; the "
          "run keeps its place only if another of its stages still waits for that profile. A "
          "ready stage is ended with POST .../end instead (409 stage_not_waiting). Deleting an "
          "ended stage answers its end again."),
    Route("GET", "/v1/runs/{run_id}/stages/{stage_id}/exec", "api_stage_exec",
          "What `sfguard stage-exec` needs to run a stage confined",
          None, ((200, m.StageExec),),
          _RUN + ((404, ("stage_not_found",)),
                  (409, ("stage_ended", "stage_failed", "stage_not_ready", "sandbox_unavailable"))),
          "For the runner's `sfguard stage-exec` only: the in-sandbox env (gate and proxy bridged "
          "on the same ports, a proxy credential of the stage's own), the bridge sockets, the guard "
          "folders to hide and the unprivileged user a root runner drops the stage to. 409 when the "
          "stage ended, failed, is not ready, or this machine cannot build the sandbox."),
    Route("POST", "/v1/runs/{run_id}/stages/{stage_id}/end", "api_end_stage",
          "End a stage: close its tabs and session, revoke its CDP token", m.StageEnd,
          ((200, m.EndAnswer),), _RUN + ((404, ("stage_not_found",)),),
          "Call when the stage is terminal. The stage's gate token stops working; the run's "
          "browser and lease stay for the run's next stages."),
    Route("POST", "/v1/runs/{run_id}/login-check", "api_login_check",
          "Check a profile's login in the run's browser: {logged_in, url}, computed by the guard",
          m.LoginCheckRequest, ((200, m.LoginResultAnswer),),
          _RUN + ((400, ("no_pipeline", "invalid_pattern")), (403, ("login_check_not_allowed",)),
                  (409, ("run_ended", "profile_leased", "browser_failed")), (422, ("login_check_failed",)),
                  (503, ("browser_failed", "store_unreachable", "disk_full"))),
          "The guard opens login_check.url in the run's browser for the profile (leasing it if "
          "needed), reads the final address (and the selector) and matches the patterns. The "
          "runner puts this answer into the check stage's envelope; the guard keeps it for "
          "login-check/verify."),
    Route("POST", "/v1/runs/{run_id}/login-check/verify", "api_login_verify",
          "Compare what a stage reported with the guard's own last login check (409 on mismatch)",
          m.LoginVerifyRequest, ((200, m.Ok),), _RUN + ((409, ("no_login_check", "envelope_mismatch")),),
          "For `verify: login_check`: after a login stage (or before trusting an envelope), the "
          "runner sends what it was told; the guard answers 409 envelope_mismatch when its own "
          "last check of that profile in this run says otherwise."),
    Route("POST", "/v1/runs/{run_id}/handoff", "api_handoff",
          "Open the profile's browser for a person to log in; answers the gate payload",
          m.HandoffRequest, ((200, m.HandoffAnswer),),
          _RUN + ((400, ("no_pipeline",)), (404, ("stage_not_found",)),
                  (409, ("run_ended", "handoff_impossible", "profile_leased", "browser_failed")),
                  (503, ("browser_failed", "store_unreachable", "disk_full"))),
          "For a login stage's gate; answers the payload to show the person. `kind` defaults to "
          "`auto`: a live view where the guard has no usable display and its console is on (and "
          "`url` is given), else a local window. `live_view` (or `auto` so decided): the login tab "
          "opens in the run's browser, headless is fine, and the payload's url is a one-time link "
          "to a live view of it in the guard's console; follow the handoff with GET .../handoff, "
          "whose `done` carries the guard's own login check. `local_window` (or `auto` with a "
          "display): the run's browser is reopened headed on the profile (409 handoff_impossible "
          "names why not: no display, a container, the console off); end the login stage when the "
          "person confirms, then run the login check."),
    Route("GET", "/v1/runs/{run_id}/handoff", "api_handoff_state",
          "The state of the run's newest handoff (long-poll with ?wait=)", None,
          ((200, m.HandoffState),), _RUN + ((404, ("handoff_not_found",)),),
          "open until the person presses Done (then `done` with the guard's own login check: "
          "logged_in and url, kept for login-check/verify as a POST .../login-check would be, so "
          "the runner need not check again; without a login_check in the handoff or its stage, "
          "`done` carries neither) or Cancel (`cancelled`; the handoff's stage failed), or the link "
          f"timed out (`expired`) or its stage or run ended (`ended`). With ?wait=SECONDS (0-{MAX_WAIT:.0f}) "
          "an open handoff's answer is held until it changes or the time is up. A local_window "
          "handoff is open until its time is up (`expired`) or its stage or run ends (`ended`); "
          "then its window closes (the anchor goes back to headless).",
          query=("wait",)),
    Route("POST", "/v1/console/link", "api_console_link",
          "A one-time login link to the operator console (`sfguard console`)",
          m.ConsoleLinkRequest, ((200, m.ConsoleLink),), ((409, ("console_off",)),),
          "The link is good once, for ttl_s seconds; its first use gives an HttpOnly, "
          "SameSite=Strict session cookie (Secure over TLS). `person` names whom it is for: what "
          "that session decides is audited as `console:NAME`. The URL starts with the console's "
          "public URL (`--console-url`). 409 console_off when the guard runs without a console."),
    Route("GET", "/v1/status", "api_status", "Runs, leases, queues, anchors, proxies, policy", None,
          ((200, sm.StatusAnswer),), (),
          "What `sfguard status` prints: every run, profile lease and queue, and the site policy's "
          "state (an invalid edit keeps the last good policy). Answers even when a shared store "
          "does not: then `leases` is empty and `guard.store_error` says why."),
    Route("GET", "/v1/health/live", "api_health_live", "Liveness: the guard answers", None,
          ((200, sm.HealthAnswer),), (),
          "For probes: 200 while the guard's loop answers. Needs no token, also on the TCP "
          "listener, and says nothing else.", (), "health", "open"),
    Route("GET", "/v1/health/ready", "api_health_ready", "Readiness: the guard can take stages", None,
          ((200, sm.HealthAnswer),), ((503, ("not_ready",)),),
          "For probes: 200 when the guard has started, is not stopping, its watchdog ran in the last "
          "10 s and its store answers within 2 s; else 503 not_ready. Needs no token, also on the TCP "
          "listener, and says nothing else (`sfguard status` says why).", (), "health", "open"),
    Route("GET", "/v1/profiles", "api_list_profiles", "Profiles of this guard's scope", None,
          ((200, m.ProfilesAnswer),), ((503, ("store_unreachable",)),),
          "Names, sizes, times, workflow identities and lease holders; never contents. 503 "
          "store_unreachable when a shared store's database does not answer.", (), "inventory"),
    Route("DELETE", "/v1/profiles/{name}", "api_delete_profile", "Delete a profile (not while leased)",
          None, ((200, m.Ok),), ((400, ("invalid_name",)), (404, ("profile_not_found",)),
                                 (409, ("profile_leased",)), (503, ("store_unreachable",))),
          "Deletes the sealed profile and its login; refused while a run leases it.", (), "inventory"),
    Route("POST", "/v1/keys/rotate", "api_rotate_keys",
          "Rotate the keys: a new key version for every sealed profile and the audit chain",
          None, ((200, km.KeysRotated),),
          ((409, ("keys_busy", "key_missing", "key_state")), (503, ("store_unreachable",))),
          "What `sfguard keys rotate` asks a running guard for. Makes a new key version current "
          "(the audit chain's `key_rotated` record hands it over), reseals every profile at rest "
          "under it (each readable under the old key or the new at every moment) and answers once "
          "they are done; a profile a run holds is resealed when that run ends (`pending`). A "
          "rotation a crash left is resumed instead (`resumed`). 409 keys_busy: another rotation "
          "or retirement is under way; key_missing: this host has not got the key version (a "
          "shared store: the new master key is not in its key file yet); key_state: the key state "
          "refuses (damaged keys.json).", (), "keys_service"),
    Route("GET", "/v1/approvals", "api_list_approvals", "Writes held for a person (write gates)", None,
          ((200, am.ApprovalsAnswer),), ((400, ("invalid_request",)),),
          "Held writes, newest last, with what a person needs to decide (form values masked where "
          "password-like). `run` and `state` filter; `wait=S` answers when the pending list changes "
          "or after S seconds (a long-poll for a runner that shows gates itself).",
          ("run", "state", "wait"), "approvals_api"),
    Route("GET", "/v1/approvals/{approval_id}", "api_get_approval", "One held write", None,
          ((200, am.ApprovalView),), ((404, ("approval_not_found",)),),
          "The approval: request, form fields, earlier writes of a retry, state, who decided.",
          (), "approvals_api"),
    Route("GET", "/v1/approvals/{approval_id}/screenshot", "api_approval_screenshot",
          "The tab of a held write, as it was when the write was held (PNG)", None,
          ((200, am.Png),), ((404, ("approval_not_found", "screenshot_not_found")),),
          "A PNG picture of the tab that sent the write, taken when it was held; kept while the "
          "approval is pending. 404 screenshot_not_found when the tab could not be captured or the "
          "approval was decided.", (), "approvals_api"),
    Route("POST", "/v1/approvals/{approval_id}", "api_decide_approval", "Approve or deny a held write",
          am.ApprovalDecision, ((200, am.ApprovalView),),
          ((404, ("approval_not_found",)), (409, ("approval_decided",))),
          "`approve` sends exactly that request, once, with its original bytes; `deny` fails it in "
          "the page with a clear message. 409 approval_decided when it was already decided or timed out.",
          (), "approvals_api"),
)


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for ROUTES (supervisor/daemon/openapi.py builds it)."""
    from sfguard.supervisor.daemon.openapi import document
    return document()


def _wait_seconds(values: list[str]) -> float:
    if len(values) != 1:
        raise BadRequest("invalid_request", "wait: give it once", "wait")
    try:
        wait = float(values[0])
    except ValueError:
        wait = -1.0
    if not 0 <= wait <= MAX_WAIT:  # also refuses nan and inf
        raise BadRequest("invalid_request", f"wait: seconds from 0 to {MAX_WAIT:.0f}", "wait")
    return wait


Handler = Callable[..., Awaitable[Any]]


#: the access level of the routes outside ROUTES (ACCESS); any other path wants the full token
EXTRA_ACCESS = {("GET", "/v1/openapi.json"): "full", ("GET", "/metrics"): "scrape"}


def access_of(request: web.Request) -> str:
    """The access level of the route `request` matched ("full" for no route)."""
    resource = request.match_info.route.resource
    method = "GET" if request.method == "HEAD" else request.method
    path = resource.canonical if resource is not None else ""
    found = next((r.access for r in ROUTES if r.method == method and r.path == path), None)
    return found or EXTRA_ACCESS.get((method, path), "full")


def _refusal(request: web.Request, token: str, scrape_token: str | None) -> web.Response | None:
    """None when the request's bearer token opens its route, else the answer: 401 without a
    valid token, 403 token_scope for the metrics token on a route it does not open."""
    need = access_of(request)
    if need == "open":
        return None
    given = request.headers.get("Authorization", "").encode()
    if hmac.compare_digest(given, f"Bearer {token}".encode()):
        return None
    if scrape_token is not None and hmac.compare_digest(given, f"Bearer {scrape_token}".encode()):
        if need == "scrape":
            return None
        return error_response(403, "token_scope", "the metrics token opens GET /metrics and the health "
                              "probes only")
    return error_response(401, "unauthorized", "a valid bearer token is required")


def _edge(token: str | None, scrape_token: str | None) -> Any:
    """The middleware every request passes: the bearer tokens (TCP listener), then the one
    mapping of errors to answers (never a traceback)."""

    @web.middleware
    async def errors(request: web.Request, handler):
        if token is not None:
            refused = _refusal(request, token, scrape_token)
            if refused is not None:
                return refused
        transport = request.transport
        CALLER.set(caller_of(transport.get_extra_info("socket") if transport else None, token is not None))
        try:
            return await handler(request)
        except GuardError as exc:
            return error_response(status_of(exc), exc.code, exc.message, exc.field)
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, "body_too_large", f"request bodies are limited to {MAX_BODY} bytes")
        except web.HTTPNotFound:
            return error_response(404, "not_found", "no such route")
        except web.HTTPMethodNotAllowed:
            return error_response(405, "method_not_allowed", "method not allowed on this route")
        except web.HTTPException as exc:
            return error_response(exc.status, "http_error", exc.reason)
        except Exception:   # the route's top: a bug answers 500 (traceback logged), never a dropped connection
            log.exception("internal error on %s %s", request.method, request.rel_url.path)
            return error_response(500, "internal", "internal error; see the guard's log")

    return errors


def build_app(target: Any, token: str | None = None, scrape_token: str | None = None) -> web.Application:
    """The aiohttp app. `target` (the Guard) has one service coroutine per route
    (Route.operation), called with the path parameters and, for routes with a body, the
    validated model; it returns a plain json-able answer or raises a GuardError. The status
    is decided here: Route.success_status for answers, ERROR_STATUS for domain errors.
    `token`: bearer token required (TCP listener); `scrape_token`: a second one that opens only
    the routes whose access is `scrape` or `open` (/metrics, the health probes)."""

    app = web.Application(middlewares=[_edge(token, scrape_token)], client_max_size=MAX_BODY)

    def make(route: Route):
        async def handle(request: web.Request) -> web.Response:
            kwargs: dict[str, Any] = dict(request.match_info)
            for name, value in kwargs.items():
                if not PATH_PARAMS[name].fullmatch(value):
                    raise BadRequest("invalid_request", f"{name}: not a valid {name} "
                                     f"(pattern {PATH_PARAMS[name].pattern})", name)
            for name in request.query:
                if name not in route.query:
                    raise BadRequest("invalid_request", f"{name}: unknown query parameter"
                                     + (f" (this route takes: {', '.join(route.query)})" if route.query else ""),
                                     name)
            if "wait" in request.query:
                kwargs["wait"] = _wait_seconds(request.query.getall("wait"))
            for name in route.query:
                if name != "wait" and name in request.query:
                    kwargs[name] = request.query[name]
            if route.body is not None:
                raw = await request.read()
                try:
                    data = json.loads(raw or b"null")
                except (ValueError, UnicodeDecodeError, RecursionError):
                    raise BadRequest("invalid_json", "the body is not valid JSON") from None
                if not isinstance(data, dict):
                    raise BadRequest("invalid_request", "the body must be a JSON object")
                try:
                    kwargs["body"] = route.body.model_validate(data)
                except ValidationError as exc:
                    raise validation_error(exc, route.body) from None
            owner = getattr(target, route.service) if route.service else target
            # every line logged while this request is served names its run and stage (JSON log)
            ids = redaction.bind_log_ids(run=kwargs.get("run_id"), stage=kwargs.get("stage_id"))
            try:
                answer = await getattr(owner, route.operation)(**kwargs)
            finally:
                redaction.unbind_log_ids(ids)
            if isinstance(answer, bytes):    # a picture (am.Png): never cached, never sniffed
                return web.Response(body=answer, content_type="image/png",
                                    headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})
            return web.json_response(answer, status=route.success_status(answer))
        return handle

    for r in ROUTES:
        app.router.add_route(r.method, r.path, make(r))

    async def openapi(_request):
        return web.json_response(openapi_document())
    app.router.add_get("/v1/openapi.json", openapi)

    async def metrics(_request):
        """Prometheus text format (supervisor/daemon/metrics.py): the state is read on the loop,
        the rest (decision log, processes, disk, audit) in a thread."""
        snap = target.metrics.snapshot(target)
        body = await asyncio.to_thread(target.metrics.render, snap)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})
    app.router.add_get("/metrics", metrics)
    return app


if __name__ == "__main__":  # python -m sfguard.supervisor.daemon.api > docs/openapi.json
    print(json.dumps(openapi_document(), indent=2, sort_keys=True))
