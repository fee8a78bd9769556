"""The control API: aiohttp routes over a unix socket (and optionally loopback TCP with a
bearer token). JSON in and out; every input through a pydantic model; every error is
{"error": {"code", "message", "field"}} with a 4xx status, never a traceback.

The routes are declared once in ROUTES; the OpenAPI document is generated from the same table
and the same models, so a runner in another language can generate its client from it.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel, ValidationError

from supervisor import models as m

log = logging.getLogger("sfguard.api")
#: path parameters are validated like body fields (the same patterns as the models)
PATH_PARAMS = {"run_id": re.compile(m.RUN_ID), "stage_id": re.compile(m.STAGE_ID),
               "name": re.compile(m.PROFILE_NAME)}
MAX_BODY = 256 * 1024


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


def error_response(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    body = {"error": {"code": code, "message": message, "field": field}}
    return web.json_response(body, status=status)


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p not in ("function-after", "function-before"))


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    field = _loc(first["loc"]) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    elif first["type"] == "missing":
        msg = "required field is missing"
    return ApiError(400, "invalid_request", f"{field}: {msg}" if field else msg, field)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: str  # name of the Supervisor coroutine
    summary: str
    body: type[BaseModel] | None = None
    answers: tuple[tuple[int, type[BaseModel] | None], ...] = ()


ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/runs", "api_create_run", "Register a run", m.CreateRun,
          ((201, m.RunCreated),)),
    Route("GET", "/v1/runs/{run_id}", "api_get_run", "A run's state (no secrets)"),
    Route("POST", "/v1/runs/{run_id}/end", "api_end_run", "End a run: tear down its browsers, "
          "reseal its profiles, release its leases", m.RunEnd, ((200, m.Ok),)),
    Route("POST", "/v1/runs/{run_id}/stages", "api_request_stage",
          "Ask for a stage's browser: ready with the stage env, or waiting for a lease",
          m.StageRequest, ((200, m.StageReady), (202, m.StageWaiting))),
    Route("GET", "/v1/runs/{run_id}/stages/{stage_id}", "api_get_stage",
          "Poll a stage: the same answer as the request, identical env on resume",
          None, ((200, m.StageReady), (202, m.StageWaiting))),
    Route("GET", "/v1/runs/{run_id}/stages/{stage_id}/exec", "api_stage_exec",
          "What `sfguard stage-exec` needs to run the stage confined: in-sandbox env, bridge "
          "sockets, folders to hide, the user to run as (409 when ended, not ready, or no sandbox)",
          None, ((200, m.StageExec),)),
    Route("POST", "/v1/runs/{run_id}/stages/{stage_id}/end", "api_end_stage",
          "End a stage: close its tabs and session, revoke its CDP token", m.StageEnd,
          ((200, m.Ok),)),
    Route("POST", "/v1/runs/{run_id}/login-check", "api_login_check",
          "Check a profile's login in the run's browser: {logged_in, url}, computed by the guard",
          m.LoginCheckRequest, ((200, m.LoginResultAnswer),)),
    Route("POST", "/v1/runs/{run_id}/login-check/verify", "api_login_verify",
          "Compare what a stage reported with the guard's own last login check (409 on mismatch)",
          m.LoginVerifyRequest, ((200, m.Ok),)),
    Route("POST", "/v1/runs/{run_id}/handoff", "api_handoff",
          "Open the profile's browser for a person to log in; answers the gate payload",
          m.HandoffRequest),
    Route("GET", "/v1/status", "api_status", "Runs, leases, queues, anchors, proxies, policy"),
    Route("GET", "/v1/profiles", "api_list_profiles", "Profiles of this guard's scope"),
    Route("DELETE", "/v1/profiles/{name}", "api_delete_profile", "Delete a profile (not while leased)",
          None, ((200, m.Ok),)),
)


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for ROUTES, with the pydantic models as components."""
    components: dict[str, Any] = {}

    def ref(model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            components[name] = sub
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    err = ref(m.ErrorAnswer)
    paths: dict[str, Any] = {}
    for r in ROUTES:
        op: dict[str, Any] = {"summary": r.summary, "operationId": r.handler.removeprefix("api_")}
        params = [seg[1:-1] for seg in r.path.split("/") if seg.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True,
                                 "schema": {"type": "string", "pattern": m.RUN_ID if p != "name"
                                            else m.PROFILE_NAME}} for p in params]
        if r.body:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": ref(r.body)}}}
        responses: dict[str, Any] = {}
        for status, model in r.answers or ((200, None),):
            content = {"application/json": {"schema": ref(model) if model else {"type": "object"}}}
            responses[str(status)] = {"description": "ok", "content": content}
        for status in ("400", "404", "409", "413"):
            responses[status] = {"description": "error",
                                 "content": {"application/json": {"schema": err}}}
        op["responses"] = responses
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "sfguard control API", "version": "1"},
        "paths": paths,
        "components": {"schemas": components},
    }


Handler = Callable[..., Awaitable[tuple[int, Any]]]


def build_app(target: Any, token: str | None = None) -> web.Application:
    """The aiohttp app. `target` has one coroutine per route (Route.handler), called with the
    path parameters and, for routes with a body, the validated model; it returns
    (status, json-able) or raises ApiError. `token`: bearer token required (TCP listener)."""

    @web.middleware
    async def errors(request: web.Request, handler):
        if token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return error_response(401, "unauthorized", "a valid bearer token is required")
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc.status, exc.code, exc.message, exc.field)
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, "body_too_large", f"request bodies are limited to {MAX_BODY} bytes")
        except web.HTTPNotFound:
            return error_response(404, "not_found", "no such route")
        except web.HTTPMethodNotAllowed:
            return error_response(405, "method_not_allowed", "method not allowed on this route")
        except web.HTTPException as exc:
            return error_response(exc.status, "http_error", exc.reason)
        except Exception:
            log.exception("internal error on %s %s", request.method, request.rel_url.path)
            return error_response(500, "internal", "internal error; see the guard's log")

    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)

    def make(route: Route):
        async def handle(request: web.Request) -> web.Response:
            kwargs = dict(request.match_info)
            for name, value in kwargs.items():
                if not PATH_PARAMS[name].fullmatch(value):
                    raise ApiError(400, "invalid_request", f"{name}: not a valid {name} "
                                   f"(pattern {PATH_PARAMS[name].pattern})", name)
            if route.body is not None:
                raw = await request.read()
                try:
                    data = json.loads(raw or b"null")
                except (ValueError, UnicodeDecodeError, RecursionError):
                    raise ApiError(400, "invalid_json", "the body is not valid JSON") from None
                if not isinstance(data, dict):
                    raise ApiError(400, "invalid_request", "the body must be a JSON object")
                try:
                    kwargs["body"] = route.body.model_validate(data)
                except ValidationError as exc:
                    raise validation_error(exc) from None
            status, answer = await getattr(target, route.handler)(**kwargs)
            return web.json_response(answer, status=status)
        return handle

    for r in ROUTES:
        app.router.add_route(r.method, r.path, make(r))

    async def openapi(_request):
        return web.json_response(openapi_document())
    app.router.add_get("/v1/openapi.json", openapi)
    return app


if __name__ == "__main__":  # python -m supervisor.api > docs/openapi.json
    print(json.dumps(openapi_document(), indent=2, sort_keys=True))
