"""Control API models: every input is validated here, at the edge, with pydantic.

Errors are answered as {"error": {"code", "message", "field"}} (see supervisor/api.py); the
field is the dotted path of the offending input, e.g. `browser.allow_domains.2`.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

import policy

RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
STAGE_ID = RUN_ID
PROFILE_NAME = r"^[a-z0-9][a-z0-9_-]{0,63}$"
#: the reserved profile value that means "this run's pipeline-derived identity"
PIPELINE_PROFILE = "@pipeline"

RunId = Annotated[str, StringConstraints(pattern=RUN_ID)]
StageId = Annotated[str, StringConstraints(pattern=STAGE_ID)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class LoginCheck(Strict):
    url: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    logged_in: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    logged_out: list[Annotated[str, StringConstraints(min_length=1, max_length=1024)]] = Field(
        default_factory=list, max_length=32)
    selector: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/?#]+", v):
            raise ValueError("must be an http:// or https:// address")
        return v


class BrowserField(Strict):
    """A stage's `browser` field, as in the spec: profile, headed, allow_domains, login_check."""

    profile: str | None = Field(default=None, description=(
        "profile name (^[a-z0-9][a-z0-9_-]{0,63}$) or '@pipeline' for the run's "
        "pipeline-derived identity; omitted: a throw-away browser"))
    headed: bool = True
    allow_domains: list[Annotated[str, StringConstraints(min_length=1, max_length=300)]] = Field(
        default_factory=list, max_length=256)
    login_check: LoginCheck | None = None

    @field_validator("profile")
    @classmethod
    def _profile_name(cls, v: str | None) -> str | None:
        if v is None or v == PIPELINE_PROFILE:
            return v
        if not re.fullmatch(PROFILE_NAME, v):
            raise ValueError("profile names are 1-64 of a-z 0-9 _ - and start with a letter or "
                             "digit (never a path)")
        return v

    @field_validator("allow_domains")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        try:
            policy.compile_patterns(v, source="allow_domains")
        except policy.PolicyError as exc:
            first = exc.issues[0]
            raise ValueError(f"{first.field}: {first.message}"
                             + (f" (hint: {first.hint})" if first.hint else "")) from None
        return v


class CreateRun(Strict):
    run_id: RunId
    pipeline: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None


class StageRequest(Strict):
    stage_id: StageId
    attempt: int = Field(ge=1, le=10_000)
    browser: BrowserField


class StageEnd(Strict):
    outcome: Literal["succeeded", "failed", "cancelled", "timed_out"]


class RunEnd(Strict):
    outcome: Literal["succeeded", "failed", "cancelled", "abandoned"]


class ErrorBody(Strict):
    code: str
    message: str
    field: str | None = None


class ErrorAnswer(Strict):
    error: ErrorBody


class StageReady(Strict):
    state: Literal["ready"]
    env: dict[str, str]
    exec_prefix: list[str] | None = Field(default=None, description=(
        "the argv prefix a runner puts in front of the stage's command to run it confined "
        "(`sfguard stage-exec --home HOME --run RUN --stage STAGE --`)"))


class StageUser(Strict):
    user: str
    uid: int
    gid: int


class StageBridgeSockets(Strict):
    dir: str
    gate_socket: str
    gate_port: int
    proxy_socket: str
    proxy_port: int


class StageExec(Strict):
    """What `sfguard stage-exec` needs to build a stage's sandbox (runner only)."""
    run_id: str
    stage_id: str
    attempt: int
    env: dict[str, str] = Field(description=(
        "the stage env inside the sandbox: the gate URL (bridged on the same port), a private "
        "agent-browser socket dir and config, and HTTP(S)_PROXY/ALL_PROXY (both cases) at the "
        "in-sandbox proxy bridge with a proxy credential of this stage's own"))
    bridges: StageBridgeSockets
    hide: list[str] = Field(description="guard folders covered with an empty tmpfs inside")
    run_as: StageUser | None = Field(default=None, description=(
        "the unprivileged user a root runner drops the stage to; null when the guard is not root"))
    agent_browser: str | None = Field(default=None, description=(
        "the guard's agent-browser, used after the command to close the tab of a daemon the "
        "stage started inside"))


class StageWaiting(Strict):
    state: Literal["waiting"]
    holder_run: str
    since: str
    position: int | None = None


class StageEnded(Strict):
    state: Literal["ended"]
    outcome: str


class RunCreated(Strict):
    run_id: str
    state: str


class Ok(Strict):
    ok: bool = True


class LoginCheckRequest(Strict):
    profile: str
    login_check: LoginCheck

    _profile = field_validator("profile")(BrowserField._profile_name.__func__)


class LoginReported(Strict):
    logged_in: bool
    url: Annotated[str, StringConstraints(max_length=4096)]


class LoginVerifyRequest(Strict):
    profile: str
    reported: LoginReported

    _profile = field_validator("profile")(BrowserField._profile_name.__func__)


class LoginResultAnswer(Strict):
    logged_in: bool
    url: str


class HandoffRequest(Strict):
    profile: str
    site: Annotated[str, StringConstraints(min_length=1, max_length=300)]
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    url: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = None

    _profile = field_validator("profile")(BrowserField._profile_name.__func__)
