"""The pipeline's YAML files, read with their node marks, for positions at FILE:LINE:COL.

Positions come from sfguard.policy.yamlpos (the one position-aware layer, shared with the site
policy's schema); `YamlDoc.child` is the step function it walks a pydantic error location with.
"""
from __future__ import annotations

from typing import Any

import yaml

from sfguard.policy.yamlpos import loc_path, locate, mark_place

__all__ = ["YamlDoc", "error_path", "kind", "locate_in", "mark"]


class YamlDoc:
    """One YAML file: its display name, root node and a constructor for sub-nodes."""

    def __init__(self, display: str, text: str):
        self.display = display
        self._loader = yaml.SafeLoader(text)
        self.root = self._loader.get_single_node()

    def value(self, node: yaml.Node) -> Any:
        return self._loader.construct_object(node, deep=True)

    def close(self) -> None:
        self._loader.dispose()

    def child(self, node: yaml.Node, part: str | int, want_key: bool) -> yaml.Node | None:
        """One step along a pydantic error location (for `policy.yamlpos`); the last of
        duplicate keys wins, as in the value pydantic saw."""
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            found = None
            for key, k, v in self.items(node):
                if key == part:
                    found = k if want_key else v
            return found
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            return node.value[part]
        return None

    def items(self, node: yaml.MappingNode) -> list[tuple[Any, yaml.Node, yaml.Node]]:
        """(key, key node, value node) of a mapping, merge keys (`<<`) applied."""
        self._loader.flatten_mapping(node)
        out = []
        for k, v in node.value:
            try:
                key = self.value(k)
            except yaml.YAMLError:
                key = None
            out.append((key, k, v))
        return out


def mark(node: yaml.Node | None) -> tuple[int | None, int | None]:
    return mark_place(node.start_mark if node is not None else None)


def kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return "a scalar"


def locate_in(doc: YamlDoc, node: yaml.Node, path: str, loc: tuple) -> tuple[yaml.Node, str]:
    """The deepest node along `loc` (a pydantic error location) and its dotted path."""
    found, depth = locate(node, loc, doc.child)
    return found, error_path(path, loc, found, depth)


def error_path(path: str, loc: tuple, node: yaml.Node, depth: int) -> str:
    """The dotted path of a located error: as deep as the walk got, plus the key that a
    mapping lacks (a missing field is named)."""
    if depth < len(loc) and isinstance(node, yaml.MappingNode) and isinstance(loc[depth], str):
        depth += 1
    return loc_path(loc[:depth], path)
