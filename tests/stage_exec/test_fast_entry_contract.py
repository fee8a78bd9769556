"""stage-exec's fast entry speaks to the guard without the API models (their imports would cost
every confined stage its start-up time). This test holds the two equal: the route it asks is a
route of the API's table, and every key it reads from the answer is a field of the answer's
model, nested keys included. A renamed field or route fails here, not in a stage."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from pydantic import BaseModel

from sfguard.supervisor import models as m
from sfguard.supervisor.daemon.api import ROUTES

SOURCE = Path(__file__).resolve().parents[2] / "cli" / "stage_exec_cmd.py"


def _tree() -> ast.Module:
    return ast.parse(SOURCE.read_text())


def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _chain(node: ast.AST) -> list[str] | None:
    """`answer["a"]["b"]`, `answer.get("a")`, `(answer.get("a") or {}).get("b")`: the keys read
    from the name `answer`, outermost last; None for anything else."""
    if isinstance(node, ast.Name):
        return [] if node.id == "answer" else None
    if isinstance(node, ast.Subscript):
        inner, key = _chain(node.value), _key(node.slice)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
          and node.args):
        inner, key = _chain(node.func.value), _key(node.args[0])
    elif isinstance(node, ast.BoolOp):   # (answer.get("env") or {})
        inner, key = _chain(node.values[0]), None
        return inner
    else:
        return None
    return None if inner is None or key is None else [*inner, key]


def reads() -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for node in ast.walk(_tree()):
        chain = _chain(node)
        if chain:
            out.add(tuple(chain))
    return out


def _field_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    ann = model.model_fields[name].annotation
    for candidate in (ann, *getattr(ann, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def test_the_route_it_asks_is_the_apis():
    paths = [n.values for n in ast.walk(_tree()) if isinstance(n, ast.JoinedStr)]
    asked = set()
    for parts in paths:
        text = "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in parts)
        found = re.match(r"GET (/v1/\S+) HTTP/1\.0", text)
        if found:
            asked.add(found.group(1))
    templates = {re.sub(r"\{[a-z_]+\}", "{}", r.path): r for r in ROUTES if r.method == "GET"}
    assert asked == {"/v1/runs/{}/stages/{}/exec"}, asked
    route = templates["/v1/runs/{}/stages/{}/exec"]
    assert dict(route.answers)[200] is m.StageExec


def test_every_key_it_reads_is_a_field_of_the_answer():
    # on a 200 the answer is StageExec; on an error the edge's {"error": {"code", "message"}}
    seen = reads()
    assert ("bridges", "gate_socket") in seen and ("run_as", "uid") in seen, seen   # the walk works
    for chain in sorted(seen):
        if chain[0] == "error":
            assert set(chain[1:]) <= {"code", "message"}, chain
            continue
        model: type[BaseModel] | None = m.StageExec
        for i, key in enumerate(chain):
            if model is None:        # a plain dict field (env): its keys are the stage's env
                assert chain[:i] == ("env",), chain
                break
            assert key in model.model_fields, f"stage-exec reads {'.'.join(chain)}: not a field of {model.__name__}"
            model = _field_model(model, key)
