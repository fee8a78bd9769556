"""docs/runner-guide.md replayed against a real guard (`sfguard start`, Chromium, agent-browser,
the fixture login site): every ```http request block of the guide is sent, in order, to one
guard, and the answer it gets is compared with the answer block the guide shows after it.

A shown answer must match the served one in
  - the status and, for an error, `error.code`;
  - the set of keys at every level (a key the guide shows that the guard does not send fails,
    and so does a key the guard sends that the guide leaves out, e.g. `exec_prefix`);
  - the JSON type of every value (null, boolean, number, string, object, array);
  - the value of every boolean and of the keys `state`, `kind`, `outcome`, `code` and `field`.
Other values vary from run to run (ids, tokens, times, ports, paths) and are not compared.
Lists of objects must have the same length and are compared item by item.

Every served answer must also fit docs/openapi.json: the schema of its route and status, made
strict for this check (an object schema that lists properties admits no other key), so the
document names every key the guard sends. Errors must carry a code the document lists for
that route and status.

Substitution, the only one: the guide's fixture site is `127.0.0.1:8080`; the replay's site runs
on a free port, and `127.0.0.1:8080` is replaced by its address in the requests and in the
shown answers alike. Run ids, stage ids and profile names are sent as the guide shows them (the
guard is fresh).

HTML comments in the guide steer the replay; each applies to the next request block:
  <!-- replay: the person signs in through the live view and presses Done -->
      before the request, a person (a headless Chromium of the test's own, unguarded) opens
      the live-view link of the last live_view handoff answer, signs in to the fixture site
      through its frames and presses Done;
  <!-- replay: restart the guard -->
      before the request, the guard is stopped and started again on the same home;
  <!-- not replayed: REASON -->
      the block is not sent (it needs something this test cannot give, e.g. a display).
An unknown `replay:` action fails the test. Tokens and live-view links are never printed: a
mismatch is reported by key path, type and the compared values only.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from sfguard.supervisor.console.viewer import scripted_login
from sfguard.supervisor.daemon.api import ROUTES
from tests.conftest import login_site
from tests.daemon.conftest import ROOT, Daemon, start_real_guard

pytestmark = pytest.mark.browser

GUIDE = ROOT / "docs" / "runner-guide.md"
OPENAPI = ROOT / "docs" / "openapi.json"
GUIDE_SITE = "127.0.0.1:8080"
#: an http block, or a comment that steers the replay of the next request block
TOKEN = re.compile(r"<!--\s*(replay|not replayed):\s*(.*?)\s*-->|```http\n(.*?)```", re.S)
PERSON = "the person signs in through the live view and presses Done"
RESTART = "restart the guard"
ACTIONS = (PERSON, RESTART)
#: keys whose values are compared (besides every boolean): they do not vary between runs
COMPARED = {"state", "kind", "outcome", "code", "field"}
#: at most this many request blocks of the guide may be left out of the replay
MAX_NOT_REPLAYED = 3


@dataclass
class Example:
    line: int                       # the request block's line in the guide
    request: str
    answer: str
    actions: list[str] = field(default_factory=list)
    skip: str | None = None         # why it is not replayed

    def where(self) -> str:
        return f"runner-guide.md:{self.line} {self.request.partition(chr(10))[0]}"


def examples(text: str) -> list[Example]:
    out: list[Example] = []
    pending_req: tuple[int, str] | None = None
    actions: list[str] = []
    skip: str | None = None
    for mt in TOKEN.finditer(text):
        kind, note, block = mt.groups()
        line = text.count("\n", 0, mt.start()) + 1
        if block is None:
            assert pending_req is None, f"runner-guide.md:{line}: a comment between a request and its answer"
            if kind == "replay":
                assert note in ACTIONS, f"runner-guide.md:{line}: unknown replay action {note!r}"
                actions.append(note)
            else:
                skip = note
        elif pending_req is None:
            pending_req = (line, block)
        else:
            out.append(Example(pending_req[0], pending_req[1], block, actions, skip))
            pending_req, actions, skip = None, [], None
    assert pending_req is None and not actions and skip is None, "the guide ends inside an example"
    return out


def jtype(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def shape_diff(shown: Any, served: Any, where: str = "", key: str = "") -> list[str]:
    """How `served` differs from `shown` by the rules in this module's docstring (no values
    but those of booleans and the COMPARED keys are named)."""
    at = where or "(top)"
    if jtype(shown) != jtype(served):
        return [f"{at}: the guide shows {jtype(shown)}, the guard sent {jtype(served)}"]
    if isinstance(shown, dict):
        out = [f"{at}: the guide shows `{k}`, the guard does not send it" for k in sorted(shown.keys() - served.keys())]
        out += [f"{at}: the guard sends `{k}`, the guide leaves it out" for k in sorted(served.keys() - shown.keys())]
        for k in sorted(shown.keys() & served.keys()):
            out += shape_diff(shown[k], served[k], f"{where}.{k}", k)
        return out
    if isinstance(shown, list):
        if any(isinstance(x, dict) for x in shown + served) and len(shown) != len(served):
            return [f"{at}: the guide shows {len(shown)} items, the guard sent {len(served)}"]
        out = []
        for i, (a, b) in enumerate(zip(shown, served, strict=False)):
            out += shape_diff(a, b, f"{where}.{i}", key)
        return out
    if (isinstance(shown, bool) or key in COMPARED) and shown != served:
        return [f"{at}: the guide shows {shown!r}, the guard sent {served!r}"]
    return []


def template_of(method: str, path: str) -> str:
    path = path.split("?")[0]
    for r in ROUTES:
        if r.method == method and re.fullmatch(re.sub(r"\{[a-z_]+\}", "[^/]+", r.path), path):
            return r.path
    raise AssertionError(f"no route for {method} {path}")


def strict(schema: Any) -> Any:
    """A copy in which every object schema that lists properties admits no other key."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and out.get("type", "object") == "object":
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(x) for x in schema]
    return schema


def schema_problems(doc: dict, method: str, path: str, status: int, answer: Any) -> list[str]:
    """Where a served answer does not fit docs/openapi.json (paths and key names only)."""
    template = template_of(method, path)
    responses = doc["paths"][template][method.lower()]["responses"]
    if str(status) not in responses:
        return [f"status {status} is not documented for {method} {template}"]
    documented = responses[str(status)]
    out = []
    if status >= 400 and answer["error"]["code"] not in documented.get("x-error-codes", []):
        out.append(f"{status} {answer['error']['code']} is not listed for {method} {template}")
    schema = documented["content"]["application/json"]["schema"]
    branches = schema.get("oneOf", [schema])
    components = strict(doc["components"])
    failures = []
    for branch in branches:
        validator = jsonschema_rs.Draft202012Validator({**branch, "components": components})
        errors = [f"at /{'/'.join(map(str, e.instance_path))}: {e.kind.name}"
                  + (f" {sorted(e.kind.unexpected)}" if getattr(e.kind, "unexpected", None) else "")
                  for e in validator.iter_errors(answer)]
        if not errors:
            return out
        failures.append(f"{branch.get('$ref', 'schema')}: {'; '.join(errors)}")
    return out + [f"does not fit docs/openapi.json for {method} {template} {status}: " + " | ".join(failures)]


def parse_request(block: str, site: str) -> tuple[str, str, Any]:
    first, _, body = block.replace(GUIDE_SITE, site).partition("\n")
    method, path = first.split()
    return method, path, json.loads(body) if body.strip() else None


def parse_answer(block: str, site: str) -> tuple[int, Any]:
    status_line, _, body = block.replace(GUIDE_SITE, site).partition("\n")
    return int(status_line.split()[0]), json.loads(body)


@dataclass(repr=False)
class Served:
    example: Example
    method: str
    path: str
    status: int
    answer: Any     # may hold a stage token or a live-view link: never in a repr

    def __repr__(self) -> str:
        return f"<served {self.status} for {self.example.where()}>"


@pytest.fixture(scope="module")
def fixture_site():
    """The fixture login site on a free port, for this module's guard."""
    with login_site() as port:
        yield port


@pytest.fixture(scope="module")
def replay(tmp_path_factory, fixture_site) -> list[Served]:
    """The guide replayed once against one real guard: what it served for each example."""
    site = f"127.0.0.1:{fixture_site}"
    d: Daemon = start_real_guard(tmp_path_factory.mktemp("guide"), fixture_site)
    served: list[Served] = []
    live_link: str | None = None
    try:
        for ex in examples(GUIDE.read_text()):
            for action in ex.actions:
                if action == PERSON:
                    assert live_link is not None, f"{ex.where()}: no live_view handoff was answered before"
                    out = asyncio.run(scripted_login(live_link, "operator", "correct-horse"))
                    assert "logged in" in out["result"] and "NOT" not in out["result"], out["result"]
                elif action == RESTART:
                    d.stop()
                    d.start(*d.last_args)
            if ex.skip is not None:
                continue
            method, path, body = parse_request(ex.request, site)
            status, answer = d.call(method, path, body)
            if isinstance(answer, dict) and answer.get("kind") == "live_view" and "url" in answer:
                live_link = answer["url"]
            served.append(Served(ex, method, path, status, answer))
    finally:
        d.finish()
    return served


def test_the_guide_parses_and_leaves_few_examples_out():
    exs = examples(GUIDE.read_text())
    assert len(exs) >= 15
    skipped = [ex.where() for ex in exs if ex.skip is not None]
    assert len(skipped) <= MAX_NOT_REPLAYED, skipped
    assert all(ex.skip for ex in exs if ex.skip is not None), "a not-replayed mark must give its reason"


def test_every_answer_in_the_guide_is_what_the_guard_answers(replay, fixture_site):
    site = f"127.0.0.1:{fixture_site}"
    assert replay, "nothing was replayed"
    problems = []
    for s in replay:
        status, shown = parse_answer(s.example.answer, site)
        if status != s.status:
            code = s.answer.get("error", {}).get("code") if isinstance(s.answer, dict) else None
            problems.append(f"{s.example.where()}: the guide shows {status}, the guard answered "
                            f"{s.status}" + (f" {code}" if code else ""))
            continue
        problems += [f"{s.example.where()}: {p}" for p in shape_diff(shown, s.answer)]
    assert not problems, "the guide differs from the guard:\n" + "\n".join(problems)


def test_every_served_answer_fits_the_openapi_document(replay):
    doc = json.loads(OPENAPI.read_text())
    problems = []
    for s in replay:
        problems += [f"{s.example.where()}: {p}"
                     for p in schema_problems(doc, s.method, s.path, s.status, s.answer)]
    assert not problems, "served answers docs/openapi.json does not describe:\n" + "\n".join(problems)


def test_the_checks_catch_a_stale_example():
    """The rules themselves: a stale status, a key too many or too few, a changed state."""
    served = {"state": "ready", "env": {"A": "x"}, "exec_prefix": ["py"], "writes": {}}
    assert shape_diff({"state": "ready", "env": {"A": "y"}, "exec_prefix": ["q"], "writes": {}}, served) == []
    assert shape_diff({"state": "ready", "env": {"A": "y"}}, served) == [
        "(top): the guard sends `exec_prefix`, the guide leaves it out",
        "(top): the guard sends `writes`, the guide leaves it out"]
    assert shape_diff({**served, "extra": 1}, served) == ["(top): the guide shows `extra`, the guard does not send it"]
    assert shape_diff({**served, "state": "waiting"}, served) == [
        ".state: the guide shows 'waiting', the guard sent 'ready'"]
    assert shape_diff({"stages": [{"a": 1}]}, {"stages": [{"a": 1, "events": []}]}) == [
        ".stages.0: the guard sends `events`, the guide leaves it out"]
    doc = json.loads(OPENAPI.read_text())
    run = {"run_id": "r", "state": "active"}
    assert schema_problems(doc, "POST", "/v1/runs", 201, run) == []
    assert schema_problems(doc, "POST", "/v1/runs", 201, {**run, "surprise": 1}) == [
        "does not fit docs/openapi.json for POST /v1/runs 201: #/components/schemas/RunCreated: "
        "at /: additionalProperties ['surprise']"]
    assert schema_problems(doc, "POST", "/v1/runs", 418, run)
    assert schema_problems(doc, "POST", "/v1/runs", 409, {"error": {"code": "no_display", "message": "m",
                                                                    "field": None}})
    assert Path(GUIDE).is_file()
