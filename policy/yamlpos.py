"""Position-aware validation of YAML: the one place where a PyYAML error or a pydantic error
location becomes a place (line, column, dotted field) in the file.

Two readers use it over their own trees: the policy reader (policy/schema.py, a tree of
`YMap`/`YSeq` built from YAML events, aliases refused) and pipeline validation
(supervisor/pipeline/spec.py, PyYAML nodes, merge keys allowed). Each passes a `child` function that
steps one part of an error location into its tree; the walk, the field text and the mapping of
pydantic errors to tree places are here, once. `node_line` and `node_value` read PyYAML nodes
(the case files and policy diffs).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Node = TypeVar("Node")
#: A pydantic error location: keys and list indexes, outermost first.
Loc: TypeAlias = tuple[str | int, ...]
#: child(node, part, want_key): the node under `part` (a key or index), its key rather than its
#: value when `want_key`; None when `node` has no such part.
Child: TypeAlias = Callable[[Node, str | int, bool], Node | None]
M = TypeVar("M", bound=BaseModel)


class Mark(Protocol):
    """A place in a YAML text, 0-based (PyYAML's `Mark` and libyaml's both have these)."""

    @property
    def line(self) -> int: ...

    @property
    def column(self) -> int: ...


def loc_path(loc: Loc, prefix: str = "") -> str:
    """A pydantic location as a field path: ``block[2].patterns[0]``, after `prefix`."""
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


def locate(root: Node, loc: Loc, child: Child[Node], *, at_key: bool = False) -> tuple[Node, int]:
    """Walk `loc` down from `root`; returns the deepest node found and how many parts of `loc`
    it took to get there. With `at_key`, the last part gives its key (for an unknown key)."""
    node = root
    for i, part in enumerate(loc):
        nxt = child(node, part, at_key and i == len(loc) - 1)
        if nxt is None:
            return node, i
        node = nxt
    return node, len(loc)


def validate_at(model: type[M], value: Any, root: Node,
                child: Child[Node]) -> tuple[M | None, list[tuple[dict[str, Any], Node, int]]]:
    """Validate `value` (read from the tree at `root`) with `model`. Returns the model (None on
    errors) and each error (pydantic's error details, as a plain dict) with the node it points
    at and how deep the walk got."""
    try:
        return model.model_validate(value), []
    except ValidationError as exc:
        placed: list[tuple[dict[str, Any], Node, int]] = []
        for err in exc.errors(include_url=False):
            # a tagged union's tag ("~text") names no place in the file: left out of the path
            err["loc"] = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("~")))
            node, depth = locate(root, tuple(err["loc"]), child,
                                 at_key=err["type"] == "extra_forbidden")
            placed.append((dict(err), node, depth))
        return None, placed


def yaml_error_mark(exc: yaml.MarkedYAMLError) -> yaml.Mark | None:
    """The mark a PyYAML `MarkedYAMLError` points at (the problem, else its context)."""
    return exc.problem_mark or exc.context_mark


def mark_place(mark: Mark | None) -> tuple[int | None, int | None]:
    """A PyYAML mark as 1-based (line, column); (None, None) without a mark."""
    if mark is None:
        return None, None
    return mark.line + 1, mark.column + 1


def node_line(node: yaml.Node | None) -> int:
    """The 1-based line a PyYAML node starts on (1 without a node)."""
    return node.start_mark.line + 1 if node is not None else 1


def node_value(node: yaml.Node) -> Any:
    """The plain value of a PyYAML node (safe constructors only)."""
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()
