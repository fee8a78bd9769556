"""What pipeline validation finds: `PipelineReport` with its `Issue`s and the validated stages."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sfguard.supervisor.models import BrowserField

__all__ = ["Issue", "PipelineReport", "Route", "StageInfo"]


@dataclass(frozen=True)
class Issue:
    """One finding. `code` is stable (for tests and tools); str() is the line users read."""
    file: str
    line: int | None
    col: int | None
    path: str
    message: str
    code: str
    severity: str = "error"          # "error" | "warning"

    def __str__(self) -> str:
        where = self.file + (f":{self.line}" if self.line else "") + (f":{self.col}" if self.col else "")
        text = self.message if self.severity == "error" else f"warning: {self.message}"
        return f"{where}: {self.path}: {text}"


@dataclass(frozen=True)
class Route:
    source: str
    target: str
    cond: str | None


@dataclass
class StageInfo:
    """A stage as validated: its effective browser field (None when absent or invalid)."""
    id: str
    index: int
    browser: BrowserField | None = None
    has_browser: bool = False
    routes: list[Route] = field(default_factory=list)
    gate: Any = None
    verify: str | None = None
    on_verify_fail: str | None = None
    node: Any = field(default=None, repr=False, compare=False)   # the stage's YAML node


@dataclass
class PipelineReport:
    file: str
    issues: list[Issue] = field(default_factory=list)
    stages: list[StageInfo] = field(default_factory=list)

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == "error"]

    @property
    def warnings(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors
