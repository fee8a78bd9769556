"""The policy reader's YAML tree: plain dicts, lists and scalars that remember where they stood.

YAML events (libyaml through PyYAML's C parser) are assembled into `YMap` (a dict), `YSeq` (a
list) and plain scalars; each map remembers the packed position (`unpack`: line, column) of
itself, its keys and its values, each sequence that of itself and every item. Anchors, aliases
and tags are refused (no YAML bombs, no object construction), as are duplicate keys (reported
as issues) and more than one document. Scalars follow the YAML 1.2 core schema
(``yes``/``no``/``on``/``off`` stay text). Every problem is a `PolicyError` at file:line:col.

Events are assembled by hand rather than by PyYAML's composer and constructor: it is what makes
a million-entry block list load in seconds. `child` and `at_root` let `policy.yamlpos` walk the
tree to place schema errors.
"""
from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from typing import Any

import yaml

from sfguard.policy.errors import PolicyError, PolicyIssue
from sfguard.policy.yamlpos import Mark, mark_place, yaml_error_mark

#: Positions are packed into one int: line << COL_BITS | column (both 1-based).
COL_BITS = 20
COL_MASK = (1 << COL_BITS) - 1

_Loader: type[yaml.CSafeLoader | yaml.SafeLoader]
try:
    _Loader = yaml.CSafeLoader
except AttributeError:  # PyYAML without libyaml: slower, same results
    _Loader = yaml.SafeLoader


class YMap(dict[str, Any]):
    """A mapping that remembers where it, its keys and its values stood (packed positions)."""

    __slots__ = ("pos", "keypos", "valpos")
    pos: int
    keypos: dict[str, int]
    valpos: dict[str, int]


class YSeq(list[Any]):
    """A sequence that remembers where it and each item stood (packed positions)."""

    __slots__ = ("pos", "itempos")
    pos: int
    itempos: array[int]


def _pack(mark: Mark) -> int:
    return ((mark.line + 1) << COL_BITS) | min(mark.column + 1, COL_MASK)


def unpack(pos: int) -> tuple[int, int]:
    return pos >> COL_BITS, pos & COL_MASK


_INT_RE = re.compile(r"[-+]?[0-9]+|0x[0-9a-fA-F]+|0o[0-7]+")
_FLOAT_RE = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")
_SPECIAL_FIRST = set("0123456789+-.~nNtTfF")


def _resolve(value: str) -> Any:
    """A plain scalar under the YAML 1.2 core schema."""
    if not value or value[0] in _SPECIAL_FIRST:
        if value in ("", "~", "null", "Null", "NULL"):
            return None
        if value in ("true", "True", "TRUE"):
            return True
        if value in ("false", "False", "FALSE"):
            return False
        if _INT_RE.fullmatch(value):
            return int(value, 0) if value[:2] in ("0x", "0o") else int(value)
        if _FLOAT_RE.fullmatch(value):
            # YAML spells infinity and NaN ".inf" / ".nan", which Python's float() refuses
            if value.lstrip("+-")[1:].lower() in ("inf", "nan"):
                return float(value.replace(".", "", 1))
            return float(value)
    return value


class Composer:
    def __init__(self, source: str):
        self.source = source
        self.issues: list[PolicyIssue] = []

    def fail(self, mark: Mark | None, field: str, message: str, hint: str | None = None) -> PolicyError:
        line, col = mark_place(mark)
        return PolicyError([PolicyIssue(self.source, line, col, field, message, hint)])

    def compose(self, text: str) -> Any:
        loader = _Loader(text)
        try:
            return self._run(loader)
        except yaml.MarkedYAMLError as exc:
            raise _yaml_error(exc, self.source, text) from None
        except yaml.reader.ReaderError as exc:
            char = exc.character if isinstance(exc.character, int) else ord(exc.character or "\0")
            line = text.count("\n", 0, exc.position) + 1
            col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
            raise PolicyError([PolicyIssue(
                self.source, line, col, "(yaml)",
                f"character U+{char:04X} is not allowed in YAML",
                "remove control characters from the file")]) from None
        except yaml.YAMLError as exc:
            raise PolicyError([PolicyIssue(self.source, None, None, "(yaml)", f"not valid YAML: {exc}",
                                           None)]) from None
        finally:
            loader.dispose()

    def _run(self, loader: yaml.CSafeLoader | yaml.SafeLoader) -> Any:
        # Events are told apart by class identity (faster than isinstance on millions of
        # events), which a type checker cannot narrow: an event is Any here.
        get: Callable[[], Any] = loader.get_event
        ScalarEvent, AliasEvent = yaml.ScalarEvent, yaml.AliasEvent
        MappingStartEvent, SequenceStartEvent = yaml.MappingStartEvent, yaml.SequenceStartEvent
        MappingEndEvent, SequenceEndEvent = yaml.MappingEndEvent, yaml.SequenceEndEvent
        DocumentStartEvent, StreamEndEvent = yaml.DocumentStartEvent, yaml.StreamEndEvent
        root: Any = None
        documents = 0
        # Each frame: [container, pending key or _NOKEY, field path text]
        stack: list[list[Any]] = []
        nokey = _NOKEY
        resolve = _resolve
        while True:
            ev = get()
            cls = ev.__class__
            if cls is ScalarEvent:
                if ev.anchor is not None or ev.tag is not None:
                    self._refuse_anchor_or_tag(ev)
                value = resolve(ev.value) if not ev.style and ev.implicit[0] else ev.value
                if not stack:
                    root = value
                    continue
                frame = stack[-1]
                node = frame[0]
                if node.__class__ is YSeq:
                    node.append(value)
                    mark = ev.start_mark
                    node.itempos.append(((mark.line + 1) << COL_BITS) | min(mark.column + 1, COL_MASK))
                elif frame[1] is nokey:
                    self._key(frame, value, ev.start_mark)
                else:
                    key = frame[1]
                    node[key] = value
                    node.valpos[key] = _pack(ev.start_mark)
                    frame[1] = nokey
            elif cls is MappingStartEvent or cls is SequenceStartEvent:
                if ev.anchor is not None or ev.tag is not None:
                    self._refuse_anchor_or_tag(ev)
                if cls is MappingStartEvent:
                    node = YMap()
                    node.keypos, node.valpos = {}, {}
                else:
                    node = YSeq()
                    node.itempos = array("q")
                node.pos = _pack(ev.start_mark)
                if stack:
                    frame = stack[-1]
                    parent = frame[0]
                    if parent.__class__ is YSeq:
                        parent.append(node)
                        parent.itempos.append(node.pos)
                    elif frame[1] is nokey:
                        raise self.fail(ev.start_mark, "(yaml)", "a key must be a plain name",
                                        "write key: value")
                    else:
                        parent[frame[1]] = node
                        parent.valpos[frame[1]] = node.pos
                        frame[1] = nokey
                else:
                    root = node
                stack.append([node, nokey])
            elif cls is MappingEndEvent or cls is SequenceEndEvent:
                stack.pop()
            elif cls is AliasEvent:
                raise self.fail(ev.start_mark, "(yaml)", "YAML aliases (*name) are not allowed",
                                "write every value out; aliases and anchors are refused")
            elif cls is DocumentStartEvent:
                documents += 1
                if documents > 1:
                    raise self.fail(ev.start_mark, "(document)", "more than one YAML document",
                                    "keep one document: remove the '---' line")
            elif cls is StreamEndEvent:
                return root

    def _key(self, frame: list[Any], key: Any, mark: Mark) -> None:
        node: YMap = frame[0]
        if not isinstance(key, str):
            raise self.fail(mark, "(key)", f"a key must be a name, not {key!r}", "write key: value")
        if key in node:
            line, col = unpack(node.keypos[key])
            self.issues.append(PolicyIssue(self.source, mark.line + 1, mark.column + 1, key,
                                           f"duplicate key '{key}' (first at line {line})",
                                           "keep one of them"))
        node.keypos[key] = _pack(mark)
        frame[1] = key

    def _refuse_anchor_or_tag(self, ev: yaml.ScalarEvent | yaml.CollectionStartEvent) -> None:
        if ev.anchor is not None:
            raise self.fail(ev.start_mark, "(yaml)", f"YAML anchors (&{ev.anchor}) are not allowed",
                            "write every value out; anchors and aliases are refused")
        raise self.fail(ev.start_mark, "(yaml)", f"YAML tags ({ev.tag}) are not allowed",
                        "remove the tag and write a plain value")


_NOKEY = object()


def _yaml_error(exc: yaml.MarkedYAMLError, source: str, text: str) -> PolicyError:
    mark = yaml_error_mark(exc)
    problem = exc.problem or "syntax error"
    context = exc.context or ""
    hint = "check the indentation and the ':' after each key"
    at = text[mark.index] if mark is not None and 0 <= mark.index < len(text) else ""
    if at == "\t":
        hint = "indent with spaces, not tabs"
    elif "flow" in context:
        hint = ('close each [ ] and { }, and quote values that start with [ or {, '
                'e.g. "[::1]:8080"')
    if "alias" in context:
        hint = 'a pattern that starts with * must be quoted: "*.example.com"'
        problem = "an unquoted * starts a YAML alias"
        mark = exc.context_mark or mark
    elif "tab" in problem:
        hint = "indent with spaces, not tabs"
    elif "special characters" in problem or "control" in problem:
        hint = "remove control characters from the file"
    if context and exc.context_mark is not None and exc.context_mark is not mark:
        context += f" (started at line {exc.context_mark.line + 1})"
    message = f"not valid YAML: {context + ': ' if context else ''}{problem}"
    line, col = mark_place(mark)
    return PolicyError([PolicyIssue(source, line, col, "(yaml)", message, hint)])



def child(at: tuple[Any, int], part: str | int, want_key: bool) -> tuple[Any, int] | None:
    """One step into the composed tree for `yamlpos`: (node, packed position) pairs."""
    node = at[0]
    if isinstance(node, YMap) and isinstance(part, str) and part in node:
        pos = node.keypos[part] if want_key else node.valpos.get(part, node.keypos[part])
        return node[part], pos
    if isinstance(node, YSeq) and isinstance(part, int) and 0 <= part < len(node):
        return node[part], node.itempos[part]
    return None


def at_root(root: Any) -> tuple[Any, int]:
    """The root of a composed tree as a `yamlpos` place: (node, packed position)."""
    return root, getattr(root, "pos", (1 << COL_BITS) | 1)

