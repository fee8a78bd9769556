"""Recording levels per site: how much of a run the guard keeps in its record (issue 48).

The `recording` section of sites.yaml (read by policy/schema.py into `RecordingRules`)::

    recording:
      - patterns: ["*.bank.example"]     # or pattern: HOST, host patterns as in block
        level: decisions                 # off | decisions | full
        reason: "statements on screen"

  full       (the default) commands, navigations, screenshots and decisions are kept;
  decisions  only the guard's decisions about the site (refusals, proxy and write decisions,
             approvals) and the stage's lifecycle; no command, address or screenshot;
  off        nothing of the site is kept in the record (the decision log and the audit chain
             still have the guard's decisions).

Every entry whose host pattern matches applies: the strictest level wins. The guard's own level
(`sfguard start --record`) is a ceiling over all of them (`stricter`). Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sfguard.policy.index import RuleSet

#: the levels, strictest first
LEVELS: tuple[str, ...] = ("off", "decisions", "full")


def stricter(a: str, b: str) -> str:
    """The stricter of two levels (an unknown level counts as off: fail closed)."""
    rank = {level: i for i, level in enumerate(LEVELS)}
    return a if rank.get(a, 0) <= rank.get(b, 0) else b


@dataclass(frozen=True)
class RecordingEntry:
    patterns: tuple[str, ...]
    hosts: RuleSet
    level: str
    reason: str
    line: int
    label: str = "sites.yaml"

    def rule(self) -> str:
        return f"{self.label}:{self.line} recording {', '.join(self.patterns)}"


class RecordingRules:
    """The `recording` section: a level per site; empty: every site is recorded in full."""

    def __init__(self, entries: Iterable[RecordingEntry] = ()) -> None:
        self.entries: tuple[RecordingEntry, ...] = tuple(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def level(self, host: str, port: int | None = None) -> str:
        """The level for a normalised host (`full` when no entry names it)."""
        out = "full"
        if not host or not self.entries:
            return out
        is_ip = host.replace(".", "").isdigit() or ":" in host
        for entry in self.entries:
            if entry.hosts.match(host.strip("[]"), is_ip, port) is not None:
                out = stricter(out, entry.level)
        return out
