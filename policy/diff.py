"""Policy diffs: the rules that differ between two valid policy files, entry by entry.

Pure like the rest of `policy/`: `diff_policies` takes two loaded policies and their files'
text (for each entry and its line); `sfguard policy diff` (cli/policy_test_cmd.py) reads the
files and prints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import yaml

from sfguard.policy.engine import SitePolicy
from sfguard.policy.yamlpos import node_line, node_value


class RuleChangeRecord(TypedDict):
    """`RuleChange.as_dict()`: one rule of `sfguard policy diff --json`."""

    section: str
    op: str
    entry: str
    where: str
    detail: str


@dataclass(frozen=True)
class RuleChange:
    section: str         # mode, ports, tab_quota, allow_always, block, quiet, private_networks.allow
    op: str              # "+" added, "-" removed, "~" changed
    entry: str
    where: str           # FILE:LINE of the entry (the new file for + and ~, the old one for -)
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.op} {self.section}: {self.entry}" + (f"  ({self.detail})" if self.detail else "") \
            + f"  [{self.where}]"

    def as_dict(self) -> RuleChangeRecord:
        return {"section": self.section, "op": self.op, "entry": self.entry, "where": self.where,
                "detail": self.detail}


def _entries(text: str, source: str) -> dict[str, dict[str, tuple[int, str]]]:
    """section -> entry -> (line, detail) of a policy file that already validated."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    out: dict[str, dict[str, tuple[int, str]]] = {s: {} for s in (
        "mode", "ports", "tab_quota", "allow_always", "block", "quiet", "private_networks.allow")}
    if not isinstance(root, yaml.MappingNode):
        return out

    def seq(node: yaml.Node, section: str, detail: str = "") -> None:
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                out[section].setdefault(str(node_value(item)), (node_line(item), detail))
        elif isinstance(node, yaml.ScalarNode) and node_value(node) is not None:
            out[section].setdefault(str(node_value(node)), (node_line(node), detail))

    for k, v in root.value:
        key = node_value(k)
        if key in ("mode", "tab_quota"):
            out[key][str(node_value(v))] = (node_line(v), "")
        elif key in ("ports", "allow_always", "quiet"):
            seq(v, key)
        elif key == "private_networks" and isinstance(v, yaml.MappingNode):
            for k2, v2 in v.value:
                if node_value(k2) == "allow":
                    seq(v2, "private_networks.allow")
        elif key == "block" and isinstance(v, yaml.SequenceNode):
            for entry in v.value:
                if not isinstance(entry, yaml.MappingNode):
                    continue
                fields = {node_value(a): b for a, b in entry.value}
                reason = str(node_value(fields["reason"])).strip() if "reason" in fields else ""
                if "pattern" in fields:
                    seq(fields["pattern"], "block", reason)
                if "patterns" in fields:
                    seq(fields["patterns"], "block", reason)
    return out


def diff_policies(old: SitePolicy, old_text: str, new: SitePolicy, new_text: str) -> list[RuleChange]:
    """The rules that differ between two valid policies (`old_text`/`new_text`: their files'
    text, for the entries and their lines). Defaults count as written: a file without `mode`
    is in enforce mode like one that says so."""
    a_all, b_all = _entries(old_text, old.source), _entries(new_text, new.source)
    changes: list[RuleChange] = []

    def where(source: str, entries: dict[str, tuple[int, str]], key: str | None = None) -> str:
        found = entries.get(key) if key is not None else next(iter(entries.values()), None)
        return f"{source}:{found[0]}" if found else source

    for section, va, vb in (("mode", old.mode, new.mode), ("tab_quota", old.tab_quota, new.tab_quota)):
        if va != vb:
            changes.append(RuleChange(section, "~", f"{va} -> {vb}", where(new.source, b_all[section])))
    a_all["ports"] = {str(p): a_all["ports"].get(str(p), (0, "")) for p in sorted(old.ports)}
    b_all["ports"] = {str(p): b_all["ports"].get(str(p), (0, "")) for p in sorted(new.ports)}
    for section in ("ports", "allow_always", "block", "quiet", "private_networks.allow"):
        a, b = a_all[section], b_all[section]
        for entry, (line, detail) in b.items():
            at = f"{new.source}:{line}" if line else new.source
            if entry not in a:
                changes.append(RuleChange(section, "+", entry, at, detail))
            elif a[entry][1] != detail:
                changes.append(RuleChange(section, "~", entry, at,
                                          f"reason was {a[entry][1]!r}, now {detail!r}"))
        for entry, (line, detail) in a.items():
            if entry not in b:
                changes.append(RuleChange(section, "-", entry,
                                          f"{old.source}:{line}" if line else old.source, detail))
    return changes
