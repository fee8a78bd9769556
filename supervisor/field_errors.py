"""One wording for a field error, used by the API (supervisor/daemon/api.py) and by `sfguard
validate` (supervisor/pipeline/), so a pipeline file and an API request are refused alike, at the
same field path, with the same hint."""
from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel


def _submodel(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model that holds the field at `loc` (a pydantic error location)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        info = current.model_fields.get(part)
        if info is None:
            return None
        current = _model_in(info.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def field_path(loc: tuple) -> str:
    """The dotted path of a field (`browser.allow_domains.2`), as API errors name it."""
    return ".".join(str(p) for p in loc if p not in ("function-after", "function-before"))


def error_message(err: Mapping[str, Any], model: type[BaseModel]) -> str:
    """A readable message, with a hint where one helps, for one pydantic error of `model`."""
    kind, loc, value = err.get("type"), tuple(err.get("loc", ())), err.get("input")
    name = loc[-1] if loc else ""
    if kind == "extra_forbidden":
        holder = _submodel(model, loc[:-1])
        known = tuple(holder.model_fields) if holder else ()
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else (f"known keys: {', '.join(known)}" if known else "")
        return f"unknown key {name!r}" + (f" ({hint})" if hint else "")
    if kind == "missing":
        return f"missing required key {name!r}"
    if kind == "list_type":
        if isinstance(value, str):
            return f"must be a list, not a single text (hint: write a list: [{value}])"
        return f"must be a list, not {_shown(value)} (hint: write a list: [example.com])"
    if kind == "bool_type":
        return f"must be true or false, not {_shown(value)} (hint: write true or false without quotes)"
    if kind == "string_type":
        quote = " (hint: put it in quotes)" if isinstance(value, (int, float, bool)) else ""
        return f"must be text, not {_shown(value)}{quote}"
    if kind in ("int_type", "int_parsing"):
        return f"must be a whole number, not {_shown(value)}"
    if kind in ("model_type", "dict_type"):
        holder = _submodel(model, loc)
        keys = f" with keys {', '.join(holder.model_fields)}" if holder else ""
        return f"must be a mapping{keys}, not {_shown(value)}"
    if kind == "literal_error":
        return str(err.get("msg", "invalid")).replace("Input should be", "must be")
    msg = str(err.get("msg", "invalid"))
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg.replace("String should have", "must have").replace("List should have", "must have")
