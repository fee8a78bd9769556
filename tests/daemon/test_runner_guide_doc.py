"""docs/runner-guide.md stays true to the API: every request in it is a documented route with a
body the API accepts, and every answer shown is documented for that route (status, error code,
answer model)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from sfguard.supervisor.daemon.api import ROUTES, openapi_document

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "runner-guide.md"
BLOCK = re.compile(r"```http\n(.*?)```", re.S)


def route_for(method: str, path: str):
    path = path.split("?")[0]
    for r in ROUTES:
        if r.method == method and re.fullmatch(re.sub(r"\{[a-z_]+\}", "[^/]+", r.path), path):
            return r
    raise AssertionError(f"the guide uses an undocumented route: {method} {path}")


def test_every_request_and_answer_in_the_guide_is_documented():
    doc = openapi_document()
    blocks = BLOCK.findall(GUIDE.read_text())
    assert len(blocks) >= 30
    pairs = 0
    for req, ans in zip(blocks[0::2], blocks[1::2], strict=False):
        first, _, body = req.partition("\n")
        method, path = first.split()
        route = route_for(method, path)
        if route.body is not None:
            route.body.model_validate(json.loads(body))
        else:
            assert not body.strip()
        status_line, _, answer = ans.partition("\n")
        status = int(status_line.split()[0])
        answer = json.loads(answer)
        op = doc["paths"][route.path][method.lower()]
        assert str(status) in op["responses"], (method, path, status)
        if status >= 400:
            assert answer["error"]["code"] in op["responses"][str(status)]["x-error-codes"]
        else:
            models = dict(route.answers)[status]
            models = models if isinstance(models, tuple) else (models,)
            assert any(_fits(mdl, answer) for mdl in models), (method, path, answer)
        pairs += 1
    assert pairs == len(blocks) // 2


def _fits(model, answer) -> bool:
    try:
        model.model_validate(answer)
        return True
    except Exception:  # noqa: BLE001 - a non-fitting model is the answer here
        return False
