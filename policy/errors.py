"""Errors of the policy package.

`MalformedHost` is raised by host normalisation. `PolicyIssue` is one problem in a policy file
(or in a run's allow_domains), placed at file:line:col with the field and a hint a reviewer can
act on; `PolicyError` carries every issue found.
"""
from __future__ import annotations

from dataclasses import dataclass

from sfguard.errors import SfguardError


class MalformedHost(SfguardError):
    """A host that is not a valid, canonical host name or IP literal.

    `reason` is a short human message; it never repeats user info that was smuggled into the host.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PolicyIssue:
    """One problem found while reading a policy file or a list of patterns."""

    file: str
    line: int | None
    col: int | None
    field: str
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.col is not None:
                where += f":{self.col}"
        text = f"{where}: {self.field}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text


class PolicyError(SfguardError):
    """A policy (or a pattern list) that cannot be used; `issues` lists every problem found."""

    def __init__(self, issues: list[PolicyIssue], more: int = 0):
        self.issues = list(issues)
        self.more = more  # issues found but not kept (the list is capped)
        super().__init__(str(self))

    def __str__(self) -> str:
        lines = [str(i) for i in self.issues]
        if self.more:
            lines.append(f"... and {self.more} more")
        return "\n".join(lines)
