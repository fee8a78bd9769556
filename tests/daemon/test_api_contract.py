"""The OpenAPI document is the API's contract: the served document matches the routes the
daemon answers, every operation is described, and every answer a real guard gives in a
scripted runner session (fake agent-browser) is documented for its route, with its status and
error code; 2xx bodies validate against the documented models. Documented error codes not
produced here are listed with where they are proven instead.
Also: long-poll (?wait=), DELETE of a waiting stage, and --token-file."""
from __future__ import annotations

import http.client
import json
import os
import re
import stat
import time

from sfguard.supervisor import models as m
from sfguard.supervisor.daemon import status_models as sm
from sfguard.supervisor.daemon.api import ERROR_STATUS, MAX_BODY, ROUTES, build_app, openapi_document
from tests.conftest import free_port
from tests.daemon.conftest import ROOT

DOC = openapi_document()
# documented (method, path template, status, code) that this file does not produce, and why
ELSEWHERE = {
    **{(mth, path, st, code): "tests/daemon/test_approvals_api.py (writes held through the guard's approver)"
       for mth, path, st, code in [("GET", "/v1/approvals", 200, None),
                                   ("GET", "/v1/approvals/{approval_id}", 200, None),
                                   ("GET", "/v1/approvals/{approval_id}", 404, "approval_not_found"),
                                   ("POST", "/v1/approvals/{approval_id}", 200, None),
                                   ("POST", "/v1/approvals/{approval_id}", 404, "approval_not_found"),
                                   ("POST", "/v1/approvals/{approval_id}", 409, "approval_decided")]},
    **{(mth, path, st, code): "tests/console/test_approvals_page.py (a real write held, then decided)"
       for mth, path, st, code in [("GET", "/v1/approvals/{approval_id}/screenshot", 200, None),
                                   ("GET", "/v1/approvals/{approval_id}/screenshot", 404, "approval_not_found"),
                                   ("GET", "/v1/approvals/{approval_id}/screenshot", 404,
                                    "screenshot_not_found")]},
    ("GET", "/v1/profiles", 503, "store_unreachable"): "tests/pg/test_outage.py (database stopped)",
    ("DELETE", "/v1/profiles/{name}", 503, "store_unreachable"): "tests/pg/test_outage.py",
    ("POST", "/v1/runs/{run_id}/login-check", 503, "store_unreachable"):
        "a shared store whose database is away while the run is granted the profile (the grant "
        "path of tests/pg/test_outage.py)",
    ("POST", "/v1/runs/{run_id}/handoff", 503, "store_unreachable"): "as login-check",
    ("POST", "/v1/runs/{run_id}/stages", 403, "reviewer_only_address"):
        "tests/daemon/test_guard_fakes.py and test_validate_parity.py (a special address)",
    ("POST", "/v1/runs/{run_id}/stages", 409, "browser_failed"): "tests/browser_host (a broken browser)",
    ("POST", "/v1/runs/{run_id}/stages", 503, "browser_failed"): "tests/browser_host (a broken browser)",
    ("GET", "/v1/runs/{run_id}/stages/{stage_id}", 409, "browser_failed"): "tests/browser_host",
    ("GET", "/v1/runs/{run_id}/stages/{stage_id}", 503, "browser_failed"): "tests/browser_host",
    ("POST", "/v1/runs/{run_id}/login-check", 422, "login_check_failed"): "tests/login (a real page)",
    ("POST", "/v1/runs/{run_id}/login-check/verify", 409, "envelope_mismatch"):
        "tests/daemon/test_real_browser.py (needs a real login check first)",
    ("POST", "/v1/runs/{run_id}/login-check", 400, "invalid_pattern"):
        "the model refuses a bad URL pattern first (invalid_request, tests/daemon/test_validate_parity.py)",
    ("POST", "/v1/runs/{run_id}/login-check", 200, None): "tests/daemon/test_real_browser.py (a real check)",
    ("POST", "/v1/runs/{run_id}/login-check/verify", 200, None): "tests/daemon/test_real_browser.py",
    ("GET", "/metrics", 200, None): "tests/daemon/test_metrics.py (the Prometheus text format)",
    ("POST", "/v1/runs/{run_id}/stages", 503, "disk_full"): "tests/daemon/test_full_disk.py (a small tmpfs home)",
    ("GET", "/v1/runs/{run_id}/stages/{stage_id}", 503, "disk_full"): "as the stage request (its long-poll answer)",
    ("POST", "/v1/runs/{run_id}/login-check", 503, "disk_full"): "the same browser start as the stage request",
    ("POST", "/v1/runs/{run_id}/handoff", 503, "disk_full"): "the same browser start as the stage request",
    ("POST", "/v1/runs/{run_id}/login-check", 400, "no_pipeline"):
        "only when the site policy's allow_always lets the check host through for '@pipeline' "
        "(otherwise 403 comes first); the same check as the stage request's no_pipeline, shown here",
    ("POST", "/v1/runs/{run_id}/handoff", 200, None):
        "tests/console and tests/daemon/test_runner_guide_live.py (a live_view handoff, real browsers)",
    ("POST", "/v1/runs/{run_id}/handoff", 400, "no_pipeline"): "needs a display (handoff_impossible first)",
    ("POST", "/v1/runs/{run_id}/handoff", 409, "profile_leased"): "needs a display (handoff_impossible first)",
    ("GET", "/v1/runs/{run_id}/stages/{stage_id}/exec", 409, "sandbox_unavailable"):
        "tests/stage_exec/test_stage_exec.py (a machine where bubblewrap fails)",
    ("GET", "/v1/runs/{run_id}/stages/{stage_id}/exec", 409, "stage_failed"):
        "tests/browser_host (a stage whose browser could not start)",
    ("POST", "/v1/runs/{run_id}/login-check", 409, "browser_failed"):
        "a damaged sealed profile (tests/reliability: refused with the profile named)",
    ("POST", "/v1/runs/{run_id}/handoff", 409, "browser_failed"): "needs a display (handoff_impossible first)",
    ("POST", "/v1/runs/{run_id}/handoff", 503, "browser_failed"): "needs a display (handoff_impossible first)",
    ("GET", "/v1/runs/{run_id}/handoff", 200, None): "tests/console (a live_view handoff, real browsers)",
    ("POST", "/v1/console/link", 409, "console_off"): "tests/console (a guard started with --no-console)",
    ("POST", "/v1/runs/{run_id}/handoff", 404, "stage_not_found"): "tests/console (live_view with an unknown stage_id)",
    ("POST", "/v1/runs/{run_id}/login-check", 503, "browser_failed"):
        "test_a_browser_that_cannot_start_is_an_answer_not_a_500 below",
    ("GET", "/v1/health/ready", 503, "not_ready"): "tests/pg/test_outage.py (the shared store's database away)",
    ("POST", "/v1/keys/rotate", 409, "keys_busy"):
        "tests/reliability/test_fault_key_rotation.py (a second rotation while one is held at a step)",
    ("POST", "/v1/keys/rotate", 409, "key_missing"):
        "tests/pg/test_key_rotation.py (the new master key not yet in this host's key file)",
    ("POST", "/v1/keys/rotate", 409, "key_state"): "a damaged keys.json (tests/daemon/test_key_rotation.py)",
    ("POST", "/v1/keys/rotate", 503, "store_unreachable"): "a shared store whose database is away (as /v1/profiles)",
    ("DELETE", "/v1/profiles/{name}", 400, "invalid_name"):
        "unreachable through HTTP: the path pattern refuses a bad name first (invalid_request)",
}


def template_of(method: str, path: str) -> str:
    path = path.split("?")[0]
    if path == "/v1/openapi.json":
        return path
    for r in ROUTES:
        if r.method == method and re.fullmatch(re.sub(r"\{[a-z_]+\}", "[^/]+", r.path), path):
            return r.path
    raise AssertionError(f"no route for {method} {path}")


def route_of(method: str, template: str):
    return next(r for r in ROUTES if r.method == method and r.path == template)


class Recorder:
    """Calls the guard like a runner and checks every answer against the document."""

    def __init__(self, daemon):
        self.d = daemon
        self.seen: set[tuple[str, str, int, str | None]] = set()

    def call(self, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
        if raw is not None:
            from sfguard.supervisor.client.guard_client import _UnixConnection, socket_path
            conn = _UnixConnection(str(socket_path(self.d.home)), 30)
            conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status, answer = resp.status, json.loads(resp.read())
            conn.close()
        else:
            status, answer = self.d.call(method, path, body)
        self.check(method, path, status, answer)
        return status, answer

    def check(self, method, path, status, answer) -> None:
        template = template_of(method, path)
        op = DOC["paths"][template][method.lower()]
        assert str(status) in op["responses"], (method, path, status, answer)
        if status >= 400:
            code = answer["error"]["code"]
            assert code in op["responses"][str(status)]["x-error-codes"], (method, path, status, code)
            self.seen.add((method, template, status, code))
        else:
            self.seen.add((method, template, status, None))
            if template == "/v1/openapi.json":
                return
            for st, model in route_of(method, template).answers:
                if st == status:
                    models = model if isinstance(model, tuple) else (model,)
                    errors = []
                    for mdl in models:
                        try:
                            mdl.model_validate(answer)
                            break
                        except Exception as exc:  # noqa: BLE001 - collected below
                            errors.append(exc)
                    else:
                        raise AssertionError(f"{method} {path} {status}: {answer} fits none of "
                                             f"{[x.__name__ for x in models]}: {errors}")


def stage_body(sid, profile="acct", attempt=1, **browser):
    body = {"stage_id": sid, "attempt": attempt,
            "browser": {"allow_domains": ["site-a.test"], "headed": False, **browser}}
    if profile is not None:
        body["browser"]["profile"] = profile
    return body


def test_document_covers_exactly_the_served_routes(daemon):
    status, served = daemon.call("GET", "/v1/openapi.json")
    assert status == 200 and served == json.loads(json.dumps(DOC))
    app = build_app(object())
    served_routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    documented = {(method.upper(), path) for path, ops in DOC["paths"].items() for method in ops}
    assert served_routes == documented
    for path, ops in DOC["paths"].items():
        for method, op in ops.items():
            assert op["summary"] and op["description"], (method, path)
            for status, resp in op["responses"].items():
                if path == "/metrics" and status == "200":
                    assert list(resp["content"]) == ["text/plain"]    # the Prometheus text format
                    continue
                if path.endswith("/screenshot") and status == "200":
                    assert list(resp["content"]) == ["image/png"]     # a picture of the tab
                    continue
                schema = resp["content"]["application/json"]["schema"]
                if int(status) < 300 and path != "/v1/openapi.json":
                    assert schema != {"type": "object"}, (method, path, status)   # typed answers
                if int(status) >= 400:
                    assert set(resp["x-error-codes"]) <= set(m.ERROR_CODES)
    enum = DOC["components"]["schemas"]["ErrorBody"]["properties"]["code"]["enum"]
    assert enum == list(m.ERROR_CODES)
    used = {c for ops in DOC["paths"].values() for op in ops.values()
            for resp in op["responses"].values() for c in resp.get("x-error-codes", [])}
    assert set(m.ERROR_CODES) - used == {"not_found", "http_error"}   # no route: any path
    bearer = DOC["components"]["securitySchemes"]["bearer"]
    assert bearer == {"type": "http", "scheme": "bearer", "description": bearer["description"]}


def test_every_error_code_in_the_source_is_in_the_enum():
    """Each code the guard can answer (a domain error such as Conflict("code", ...), whose
    status is api.ERROR_STATUS's, and error_response(...) with its own, in
    supervisor/ and its rooms) is listed in ErrorBody.code, and documented for some route with
    that status."""
    kinds = {kind.__name__: status for kind, status in ERROR_STATUS.items()}
    found: set[tuple[int, str]] = set()
    for path in (ROOT / "supervisor").rglob("*.py"):
        text = path.read_text()
        found |= {(int(s), c) for s, c in re.findall(r'error_response\(\s*(\d{3}),\s*"([a-z_]+)"', text)}
        found |= {(kinds[k], c) for k, c in re.findall(rf'\b({"|".join(kinds)})\(\s*"([a-z_]+)"', text)}
    assert found, "no error codes found in supervisor/"
    codes = {c for _, c in found}
    assert codes <= set(m.ERROR_CODES), codes - set(m.ERROR_CODES)
    documented = {(int(st), c) for ops in DOC["paths"].values() for op in ops.values()
                  for st, resp in op["responses"].items() for c in resp.get("x-error-codes", [])}
    missing = {(s, c) for s, c in found if (s, c) not in documented and c not in ("not_found", "http_error")}
    assert missing == set()


def test_a_runner_session_gets_only_documented_answers(daemon):
    rec = Recorder(daemon)
    call = rec.call
    # runs
    assert call("POST", "/v1/runs", {"run_id": "r1", "pipeline": "/pipelines/login.yaml"})[0] == 201
    assert call("POST", "/v1/runs", {"run_id": "r1"})[0] == 409
    assert call("POST", "/v1/runs", {"run_id": "../x"})[0] == 400
    assert call("POST", "/v1/runs", raw=b"{")[0] == 400
    assert call("POST", "/v1/runs", raw=b'{"run_id": "' + b"a" * (MAX_BODY + 10) + b'"}')[0] == 413
    assert call("GET", "/v1/runs/r1")[0] == 200
    assert call("GET", "/v1/runs/nope")[0] == 404
    assert call("GET", "/v1/runs/a%20b")[0] == 400
    status, body = daemon.call("PUT", "/v1/status")      # documented on every operation
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert "method_not_allowed" in DOC["paths"]["/v1/status"]["get"]["responses"]["405"]["x-error-codes"]
    assert call("GET", "/v1/status?x=1")[0] == 400
    # stages
    assert call("POST", "/v1/runs/r1/stages", stage_body("check"))[0] == 200
    assert call("POST", "/v1/runs/r1/stages", stage_body("check", attempt=2))[0] == 409   # stage_active
    assert call("POST", "/v1/runs/r1/stages", stage_body("x", profile="@pipeline"))[0] == 200
    assert call("POST", "/v1/runs/r1/stages", stage_body("h", headed=True))[0] == 400     # no_display
    assert call("GET", "/v1/runs/r1/stages/check")[0] == 200
    assert call("GET", "/v1/runs/r1/stages/nope")[0] == 404
    assert call("GET", "/v1/runs/r1/stages/check/exec")[0] in (200, 409)   # 409: no sandbox here
    assert call("GET", "/v1/runs/r1/stages/nope/exec")[0] == 404
    assert call("GET", "/v1/runs/nope/stages/s/exec")[0] == 404
    assert call("GET", "/v1/runs/r1/stages/check?wait=61")[0] == 400
    assert call("GET", "/v1/runs/r1/stages/check?wait=nan")[0] == 400
    assert call("DELETE", "/v1/runs/r1/stages/check")[0] == 409                           # ready
    assert call("DELETE", "/v1/runs/r1/stages/nope")[0] == 404
    assert call("POST", "/v1/runs/r1/stages/check/end", {"outcome": "succeeded"})[0] == 200
    assert call("GET", "/v1/runs/r1/stages/check")[1]["state"] == "ended"
    assert call("GET", "/v1/runs/r1/stages/check/exec")[0] == 409                      # stage_ended
    assert call("POST", "/v1/runs/r1/stages", stage_body("check"))[0] == 409              # attempt_used
    assert call("POST", "/v1/runs/r1/stages/nope/end", {"outcome": "failed"})[0] == 404
    # a second run waits for the profile; it can long-poll and withdraw
    call("POST", "/v1/runs", {"run_id": "r2"})
    assert call("POST", "/v1/runs/r2/stages", stage_body("w"))[0] == 202
    assert call("POST", "/v1/runs/r2/stages", stage_body("p", profile="@pipeline"))[0] == 400  # no_pipeline
    assert call("POST", "/v1/runs/r2/login-check",
                {"profile": "acct", "login_check": {"url": "http://site-a.test/", "logged_in": "*/in"}})[0] == 409
    assert call("POST", "/v1/runs/r2/handoff", {"profile": "acct", "site": "site-a.test", "reason": "log in"})[0] == 409
    assert call("GET", "/v1/runs/r2/stages/w?wait=0.3")[0] == 202
    assert call("GET", "/v1/runs/r2/stages/w/exec")[0] == 409                          # stage_not_ready
    assert call("DELETE", "/v1/profiles/acct")[0] == 409
    assert call("DELETE", "/v1/profiles/nobody")[0] == 404
    assert call("DELETE", "/v1/profiles/Bad")[0] == 400
    # login check and verify
    assert call("POST", "/v1/runs/r1/login-check",
                {"profile": "acct", "login_check": {"url": "http://elsewhere.test/", "logged_in": "*/in"}})[0] == 403
    assert call("POST", "/v1/runs/r1/login-check",
                {"profile": "@pipeline",
                 "login_check": {"url": "http://site-a.test/", "logged_in": "*/in"}})[0] in (200, 422, 503)
    assert call("POST", "/v1/runs/r2/login-check/verify",
                {"profile": "acct", "reported": {"logged_in": True, "url": "http://site-a.test/in"}})[0] == 409
    assert call("POST", "/v1/runs/nope/login-check/verify",
                {"profile": "acct", "reported": {"logged_in": True, "url": "x"}})[0] == 404
    # handoff without a display: refused with the cause
    assert call("POST", "/v1/runs/r1/handoff", {"profile": "acct", "site": "site-a.test", "reason": "log in"})[0] == 409
    assert call("GET", "/v1/runs/r1/handoff")[0] == 404                 # handoff_not_found
    assert call("GET", "/v1/runs/nope/handoff")[0] == 404               # run_not_found
    assert call("POST", "/v1/console/link", {})[0] == 200
    assert call("GET", "/v1/status")[0] == 200
    assert call("GET", "/v1/profiles")[0] == 200
    status, rotated = call("POST", "/v1/keys/rotate")          # r1 holds acct: resealed at its end
    assert status == 200 and "acct" in [p["profile"] for p in rotated["pending"]]
    assert call("GET", "/v1/openapi.json")[0] == 200
    assert call("GET", "/v1/health/live") == (200, {"status": "alive"})
    assert call("GET", "/v1/health/ready") == (200, {"status": "ready"})
    call("POST", "/v1/runs", {"run_id": "r3"})
    assert call("POST", "/v1/runs/r3/stages", stage_body("q"))[0] == 202
    assert call("DELETE", "/v1/runs/r3/stages/q")[0] == 200
    call("POST", "/v1/runs/r3/end", {"outcome": "cancelled"})
    assert call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
    assert call("POST", "/v1/runs/r1/stages", stage_body("late"))[0] == 409               # run_ended
    assert call("POST", "/v1/runs/r1/login-check",
                {"profile": "acct", "login_check": {"url": "http://site-a.test/", "logged_in": "*/in"}})[0] == 409
    assert call("POST", "/v1/runs/r1/handoff", {"profile": "acct", "site": "s", "reason": "r"})[0] == 409
    for path in ("/v1/runs/nope/end", "/v1/runs/nope/stages", "/v1/runs/nope/stages/s/end",
                 "/v1/runs/nope/login-check", "/v1/runs/nope/handoff"):
        body = {"outcome": "failed"} if path.endswith("end") else (
            stage_body("s") if path.endswith("stages") else
            {"profile": "acct", "login_check": {"url": "http://a.test/", "logged_in": "*"}}
            if path.endswith("check") else {"profile": "acct", "site": "s", "reason": "r"})
        assert call("POST", path, body)[0] == 404
    assert call("GET", "/v1/runs/nope/stages/s")[0] == 404
    assert call("DELETE", "/v1/runs/nope/stages/s")[0] == 404
    # r2 is next; its stage gets ready within the long-poll
    status, body = call("GET", "/v1/runs/r2/stages/w?wait=20")
    assert status == 200 and body["state"] == "ready"
    call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})
    assert call("DELETE", "/v1/profiles/acct")[0] == 200

    documented = {(method.upper(), path, int(st), code)
                  for path, ops in DOC["paths"].items() for method, op in ops.items()
                  for st, resp in op["responses"].items()
                  for code in (resp.get("x-error-codes") or [None])}
    not_seen = documented - rec.seen
    # the edge errors every route shares are shown once here (and per route in the fuzz suite)
    edge = {(mth, p, s, c) for (mth, p, s, c) in not_seen if c in ("unauthorized", "method_not_allowed",
                                                                  "internal", "invalid_json", "body_too_large",
                                                                  "token_scope")
            or (c == "invalid_request" and s == 400)}
    unexplained = sorted(x for x in not_seen - edge if x not in ELSEWHERE)
    assert unexplained == [], "\n".join(map(str, unexplained))


def test_long_poll_holds_a_waiting_answer_and_returns_on_change(daemon):
    daemon.call("POST", "/v1/runs", {"run_id": "a"})
    daemon.call("POST", "/v1/runs", {"run_id": "b"})
    assert daemon.call("POST", "/v1/runs/a/stages", stage_body("s"))[0] == 200
    assert daemon.call("POST", "/v1/runs/b/stages", stage_body("s"))[0] == 202
    t0 = time.monotonic()
    status, body = daemon.call("GET", "/v1/runs/b/stages/s?wait=1.5")
    held = time.monotonic() - t0
    assert status == 202 and body["holder_run"] == "a" and held >= 1.4
    t0 = time.monotonic()
    status, _ = daemon.call("GET", "/v1/runs/b/stages/s?wait=0")
    assert status == 202 and time.monotonic() - t0 < 1.4
    import threading
    threading.Timer(0.5, lambda: daemon.call("POST", "/v1/runs/a/end", {"outcome": "succeeded"})).start()
    t0 = time.monotonic()
    status, body = daemon.call("GET", "/v1/runs/b/stages/s?wait=30")
    assert status == 200 and body["state"] == "ready" and time.monotonic() - t0 < 20
    daemon.call("POST", "/v1/runs/b/end", {"outcome": "succeeded"})


def test_delete_of_a_waiting_stage_leaves_the_queue(daemon):
    for run in ("a", "b", "c"):
        daemon.call("POST", "/v1/runs", {"run_id": run})
    assert daemon.call("POST", "/v1/runs/a/stages", stage_body("s"))[0] == 200
    assert daemon.call("POST", "/v1/runs/b/stages", stage_body("s"))[0] == 202
    assert daemon.call("POST", "/v1/runs/c/stages", stage_body("s"))[1]["position"] == 2

    def queue():
        st = daemon.call("GET", "/v1/status")[1]
        return [q["run"] for l in st["leases"] if l["profile"] == "acct" for q in l["queue"]]

    assert queue() == ["b", "c"]
    status, body = daemon.call("DELETE", "/v1/runs/b/stages/s")
    assert (status, body) == (200, {"state": "ended", "outcome": "cancelled"})
    assert queue() == ["c"]
    assert daemon.call("GET", "/v1/runs/b/stages/s") == (200, {"state": "ended", "outcome": "cancelled"})
    assert daemon.call("DELETE", "/v1/runs/b/stages/s")[0] == 200          # again: the same end
    assert daemon.call("GET", "/v1/runs/c/stages/s")[1]["position"] == 1
    daemon.call("POST", "/v1/runs/a/end", {"outcome": "succeeded"})
    status, body = daemon.call("GET", "/v1/runs/c/stages/s?wait=20")
    assert status == 200 and body["state"] == "ready"                     # c, not b, got it
    for run in ("b", "c"):
        daemon.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})


def test_token_file_and_the_tcp_listener(daemon, tmp_path):
    daemon.stop()
    port, token_file = free_port(), tmp_path / "token"
    daemon.start("--tcp", str(port), "--token-file", str(token_file))
    assert "bearer token in" in daemon.banner
    token = token_file.read_text().strip()
    assert token and token not in daemon.banner and token not in daemon.log.read_text()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600

    def tcp(auth: str | None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/status", headers={"Authorization": auth} if auth else {})
        resp = conn.getresponse()
        out = resp.status, json.loads(resp.read())
        conn.close()
        return out

    status, body = tcp(None)
    assert status == 401 and body["error"]["code"] == "unauthorized"
    assert "401" in DOC["paths"]["/v1/status"]["get"]["responses"]
    assert tcp("Bearer wrong")[0] == 401
    status, body = tcp(f"Bearer {token}")
    assert status == 200 and sm.StatusAnswer.model_validate(body)
    assert daemon.stop() == 0
    assert not token_file.exists()          # the token dies with the guard


def test_token_file_needs_tcp_and_a_usable_folder(tmp_path):
    import subprocess
    import sys
    env = dict(os.environ, SFGUARD_HOME=str(tmp_path / "home"))
    for args, needle in ((["--token-file", str(tmp_path / "t")], "needs --tcp"),
                         (["--tcp", str(free_port()), "--token-file", str(tmp_path / "no" / "t")], "does not exist"),
                         (["--tcp", str(free_port()), "--token-file", str(tmp_path)], "is a folder")):
        proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_a_browser_that_cannot_start_is_an_answer_not_a_500(tmp_path):
    """A guard whose browser binary exits at once: a stage request and a login check both answer
    503 browser_failed naming the profile, the guard keeps serving, the lease goes back."""
    from tests.daemon.conftest import Daemon
    home = (tmp_path / "home").absolute()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "SFGUARD_BROWSER": "/bin/false", "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start()
    try:
        assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
        status, body = d.call("POST", "/v1/runs/r1/stages", stage_body("s1"))
        assert status == 503 and body["error"]["code"] == "browser_failed", body
        status, body = d.call("POST", "/v1/runs/r1/login-check",
                              {"profile": "acct", "login_check": {"url": "http://site-a.test/",
                                                                  "logged_in": "*/in"}})
        assert status == 503 and body["error"]["code"] == "browser_failed", body
        assert "acct" in body["error"]["message"]
        assert d.call("GET", "/v1/status")[0] == 200
        assert d.call("POST", "/v1/runs/r1/end", {"outcome": "failed"})[0] == 200
    finally:
        d.stop()
