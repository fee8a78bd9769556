"""The shape of `sites.yaml`, version 1, as strict pydantic models (step 2 of policy/schema.py).

Unknown keys are errors and nothing is coerced (``"443"`` is not a port). `KEYS` lists the keys
each mapping may hold, for "did you mean" hints. Patterns are checked later, by the builder in
policy/schema.py; these models check only shapes, types and ranges.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from sfguard.policy.engine import DEFAULT_PORTS
from sfguard.policy.pace import DEFAULT_MAX_WAIT, LIMITS, MAX_WAIT_CAP


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BlockEntry(_Strict):
    """One block rule (`pattern`), or a group of patterns sharing one reason (`patterns`)."""

    pattern: str | None = None
    patterns: list[str] | None = None
    reason: str

    @model_validator(mode="after")
    def _one_of(self) -> BlockEntry:
        if (self.pattern is None) == (self.patterns is None):
            raise ValueError("give either 'pattern' or 'patterns'")
        if not self.reason.strip():
            raise ValueError("the reason is empty")
        return self


class WriteRequestModel(_Strict):
    """A GET listed under `writes` with its options: `{request: "GET /Logout", ignore_case: true}`."""

    request: str
    ignore_case: bool = False


#: a GET listed under `writes`: text, or a mapping with its options (one branch validated, so
#: an error names the mapping's own key; the "~" tags are left out of error paths)
ListedGet = Annotated[Annotated[str, Tag("~text")] | Annotated[WriteRequestModel, Tag("~mapping")],
                      Discriminator(lambda v: "~mapping" if isinstance(v, dict) else "~text")]


class WriteEntryModel(_Strict):
    """One entry of `writes` (policy/writes.py): a floor and the exceptions for some hosts."""

    pattern: str | None = None
    patterns: list[str] | None = None
    mode: Literal["allow", "gate", "deny"] = "allow"
    reason: str
    reads: list[str] = []
    writes: list[ListedGet] = []

    @model_validator(mode="after")
    def _one_of(self) -> WriteEntryModel:
        if (self.pattern is None) == (self.patterns is None):
            raise ValueError("give either 'pattern' or 'patterns'")
        if not self.reason.strip():
            raise ValueError("the reason is empty")
        return self


class RecordingEntryModel(_Strict):
    """One entry of `recording` (policy/recording.py): how much of a site a run record keeps."""

    pattern: str | None = None
    patterns: list[str] | None = None
    level: Literal["off", "decisions", "full"]
    reason: str

    @model_validator(mode="after")
    def _one_of(self) -> RecordingEntryModel:
        if (self.pattern is None) == (self.patterns is None):
            raise ValueError("give either 'pattern' or 'patterns'")
        if not self.reason.strip():
            raise ValueError("the reason is empty")
        return self


PerMinute = Annotated[float, Field(gt=0, le=10_000_000)]


class PaceEntryModel(_Strict):
    """One entry of `pace` (policy/pace.py): limits for some hosts, per profile."""

    pattern: str | None = None
    patterns: list[str] | None = None
    reason: str
    page_loads_per_minute: PerMinute | None = None
    min_gap_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    requests_per_minute: PerMinute | None = None
    connections: Annotated[int, Field(ge=1, le=1000)] | None = None
    burst: Annotated[int, Field(ge=1, le=1000)] = 1
    over: Literal["wait", "refuse"] = "wait"
    max_wait_s: Annotated[float, Field(ge=0, le=MAX_WAIT_CAP)] = DEFAULT_MAX_WAIT

    @model_validator(mode="after")
    def _one_of(self) -> PaceEntryModel:
        if (self.pattern is None) == (self.patterns is None):
            raise ValueError("give either 'pattern' or 'patterns'")
        if not self.reason.strip():
            raise ValueError("the reason is empty")
        if all(getattr(self, k) is None for k in LIMITS):
            raise ValueError("a pace entry names no limit")
        return self


class PrivateNetworks(_Strict):
    allow: list[str] = []


Port = Annotated[int, Field(ge=1, le=65535)]


class PolicyFile(_Strict):
    """The shape of sites.yaml, version 1."""

    version: Literal[1]
    mode: Literal["enforce", "report"] = "enforce"
    ports: list[Port] = Field(default_factory=lambda: sorted(DEFAULT_PORTS), min_length=1)
    tab_quota: int = Field(default=8, ge=1, le=1000)
    allow_always: list[str] = []
    block: list[BlockEntry] = []
    quiet: list[str] = []
    private_networks: PrivateNetworks = PrivateNetworks()
    writes: list[WriteEntryModel] = []
    recording: list[RecordingEntryModel] = []
    pace: list[PaceEntryModel] = []


KEYS: dict[tuple[str, ...], list[str]] = {
    (): list(PolicyFile.model_fields),
    ("block",): list(BlockEntry.model_fields),
    ("private_networks",): list(PrivateNetworks.model_fields),
    ("writes",): list(WriteEntryModel.model_fields),
    ("writes", "writes"): list(WriteRequestModel.model_fields),
    ("recording",): list(RecordingEntryModel.model_fields),
    ("pace",): list(PaceEntryModel.model_fields),
}
