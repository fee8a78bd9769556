"""The control API's OpenAPI 3.1 document, generated from the route table (api.ROUTES) and the
pydantic models: served at GET /v1/openapi.json, written to docs/openapi.json by
`python -m sfguard.supervisor.daemon.api > docs/openapi.json` (a test checks it is current)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from sfguard.supervisor import models as m
from sfguard.supervisor.daemon import approval_models as am
from sfguard.supervisor.daemon.api import ERROR_CAUSES, MAX_WAIT, ROUTES, STATUS_TEXT, TOKEN_SCOPE, Route

#: OpenAPI `security` of each access level (ACCESS): the unix socket needs none ({})
SECURITY = {"full": [{}, {"bearer": []}], "scrape": [{}, {"bearer": []}, {"metrics_bearer": []}],
            "open": [{}]}


class _Doc:
    """The OpenAPI document being built: components (the pydantic models) and one operation per
    route."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}
        self.err = self.ref(m.ErrorAnswer)

    def ref(self, model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            self.components[name] = sub
        self.components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def answer_schema(self, model: Any) -> dict[str, Any]:
        if isinstance(model, tuple):
            return {"oneOf": [self.ref(x) for x in model]}
        return self.ref(model)

    def errors(self, codes_by_status: dict[int, tuple[str, ...]]) -> dict[str, Any]:
        responses: dict[str, Any] = {}
        for status, codes in codes_by_status.items():
            causes = {code: ERROR_CAUSES[(status, code)] for code in codes if (status, code) in ERROR_CAUSES}
            text = f"{STATUS_TEXT.get(status, 'error')}; error.code is one of: {', '.join(codes)}"
            text += "".join(f". {code} here: {cause}" for code, cause in causes.items())
            responses[str(status)] = {"description": text, "content": {"application/json": {"schema": self.err}},
                                      "x-error-codes": list(codes)}
            if causes:
                responses[str(status)]["x-error-causes"] = causes
        return responses

    def operation(self, r: Route) -> dict[str, Any]:
        op: dict[str, Any] = {"summary": r.summary, "description": r.description,
                              "operationId": r.handler.removeprefix("api_")}
        if r.access != "full":
            op["security"] = SECURITY[r.access]
        params: list[dict[str, Any]] = [
            {"name": p, "in": "path", "required": True,
             "schema": {"type": "string", "pattern": m.PROFILE_NAME if p == "name" else m.RUN_ID}}
            for p in (seg[1:-1] for seg in r.path.split("/") if seg.startswith("{"))]
        if "wait" in r.query:
            params.append({"name": "wait", "in": "query", "required": False,
                           "description": f"long-poll: hold a waiting answer up to this many seconds "
                                          f"(0-{MAX_WAIT:.0f})",
                           "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT}})
        if params:
            op["parameters"] = params
        if r.body:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": self.ref(r.body)}}}
        responses: dict[str, Any] = {}
        for status, model in r.answers:
            if model is am.Png:
                responses[str(status)] = {"description": "ok", "content": {
                    am.Png.media_type: {"schema": {"type": "string", "format": "binary"}}}}
                continue
            responses[str(status)] = {"description": "waiting" if status == 202 else "ok",
                                      "content": {"application/json": {"schema": self.answer_schema(model)}}}
        op["responses"] = {**responses, **self.errors(r.error_codes())}
        return op


def document() -> dict[str, Any]:
    """OpenAPI 3.1 for ROUTES (and /v1/openapi.json, /metrics), with the pydantic models as
    components."""
    doc = _Doc()
    paths: dict[str, Any] = {}
    for r in ROUTES:
        paths.setdefault(r.path, {})[r.method.lower()] = doc.operation(r)
    paths["/v1/openapi.json"] = {"get": {
        "summary": "This document", "description": "The OpenAPI document of this API.",
        "operationId": "openapi", "security": SECURITY["full"],
        "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                      **doc.errors({401: ("unauthorized",), **dict([TOKEN_SCOPE])})}}}
    paths["/metrics"] = {"get": {
        "summary": "Prometheus metrics", "operationId": "metrics", "security": SECURITY["scrape"],
        "description": ("The guard's metrics in the Prometheus text format (version 0.0.4): decisions by "
                        "outcome and reason, runs and stages by state, lease queue and waits, stage start "
                        "latency, login checks, open handoffs, pending approvals and the oldest wait, "
                        "browser and proxy restarts, webhook deliveries, processes and memory by kind, "
                        "free disk, policy and audit state, the version. Labels never carry hosts, runs "
                        "or profiles. On the TCP listener the --tcp token or the metrics token "
                        "(--metrics-token-file) opens it."),
        "responses": {"200": {"description": "ok", "content": {"text/plain": {"schema": {"type": "string"}}}},
                      **doc.errors({401: ("unauthorized",)})}}}
    doc.components["ErrorBody"]["properties"]["code"]["enum"] = list(m.ERROR_CODES)
    return {
        "openapi": "3.1.0",
        "info": {"title": "sfguard control API", "version": "1",
                 "description": ("The guard's control API for pipeline runners. JSON in and out; "
                                 "every error is {\"error\": {\"code\", \"message\", \"field\"}}. "
                                 "On the unix socket (<home>/guard.sock, 0600) no token is needed; "
                                 "on the optional TCP listener (sfguard start --tcp PORT) every "
                                 "request carries Authorization: Bearer TOKEN, except the health "
                                 "probes (none) and /metrics (that token or the metrics token). The "
                                 "runner's sequence: docs/runner-guide.md.")},
        "security": SECURITY["full"],
        "paths": paths,
        "components": {"schemas": doc.components, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "the TCP listener's token (printed by sfguard start --tcp, or written "
                                      "to --token-file); not needed on the unix socket"},
            "metrics_bearer": {"type": "http", "scheme": "bearer",
                               "description": "the metrics token (sfguard start --metrics-token-file): "
                                              "GET /metrics and the health probes only; 403 token_scope "
                                              "on every other route"}}},
    }
