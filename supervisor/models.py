"""Control API models: every input is validated here, at the edge, with pydantic.

Errors are answered as {"error": {"code", "message", "field"}} (see supervisor/daemon/api.py); the
field is the dotted path of the offending input, e.g. `browser.allow_domains.2`.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from sfguard import policy

RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
STAGE_ID = RUN_ID
PROFILE_NAME = r"^[a-z0-9][a-z0-9_-]{0,63}$"
#: a person a console link is for (`sfguard console --as NAME`): what the audit names as the
#: decider (`console:NAME`); never `s-...`, which a session's public id looks like
PERSON_NAME = re.compile(r"^(?:[a-rt-z][a-z0-9._-]{0,31}|s(?:[a-z0-9._][a-z0-9._-]{0,30})?)$")
#: the reserved profile value that means "this run's pipeline-derived identity"
PIPELINE_PROFILE = "@pipeline"

RunId = Annotated[str, StringConstraints(pattern=RUN_ID)]
StageId = Annotated[str, StringConstraints(pattern=STAGE_ID)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class StrictTypes(Strict):
    """No coercion: `headed: "yes"` or `headed: 1` is an error, not true (YAML and JSON alike)."""
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False, strict=True)


#: a login-check URL pattern that starts with this is a regular expression (supervisor/browsers/login.py)
URL_REGEX_PREFIX = "re:"


def _url_pattern(pattern: str) -> str:
    """A glob (`*` wildcards) or `re:REGEX` URL pattern; a regex must compile (as in login.compile_pattern)."""
    if pattern.startswith(URL_REGEX_PREFIX):
        body = pattern[len(URL_REGEX_PREFIX):]
        if not body:
            raise ValueError(f"URL pattern {pattern!r} has an empty regular expression after 're:'")
        try:
            re.compile(body, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"URL pattern {pattern!r} is not a valid regular expression: {exc}") from None
    return pattern


UrlPattern = Annotated[str, StringConstraints(min_length=1, max_length=1024), AfterValidator(_url_pattern)]


class LoginCheck(StrictTypes):
    url: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    logged_in: UrlPattern
    logged_out: list[UrlPattern] = Field(default_factory=list, max_length=32)
    selector: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/?#]+", v):
            raise ValueError("must be an http:// or https:// address")
        return v


def _one_pattern(text: str) -> str:
    """One allow_domains entry, in its canonical spelling (`Shop.Test.:8080` -> `shop.test:8080`:
    what the proxy, the write gate, the stage answer and the logs all name). An error names its
    index: browser.allow_domains.2."""
    try:
        return policy.parse_pattern(text, allow_list=True).text
    except policy.PatternError as exc:
        raise ValueError(f"{exc.message}: {text!r}" + (f" (hint: {exc.hint})" if exc.hint else "")) from None


AllowPattern = Annotated[str, StringConstraints(min_length=1, max_length=300), AfterValidator(_one_pattern)]


def check_profile_name(v: str | None) -> str | None:
    """A profile field: a profile name, '@pipeline', or None (a throw-away browser)."""
    if v is None or v == PIPELINE_PROFILE:
        return v
    if not re.fullmatch(PROFILE_NAME, v):
        raise ValueError("profile names are 1-64 of a-z 0-9 _ - and start with a letter or "
                         "digit (never a path)")
    return v


#: a profile field of a request: a profile name or '@pipeline' (never a path)
ProfileName = Annotated[str, AfterValidator(check_profile_name)]


def _no_default(schema: dict) -> None:
    """The field's documented default is its description's: the model's own depends on the guard."""
    schema.pop("default", None)


class BudgetField(StrictTypes):
    """A stage's budget (policy/pace.py Budget): totals (then 429 until it ends), a pace that only adds."""
    page_loads: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(None, description="page loads in all")
    requests: Annotated[int, Field(ge=1, le=100_000_000)] | None = Field(None, description=(
        "requests the guard counts (plain-HTTP requests, HTTPS connections) in all"))
    active_minutes: Annotated[float, Field(gt=0, le=1440)] | None = Field(None, description="minutes from its start")
    page_loads_per_minute: Annotated[float, Field(gt=0, le=100_000)] | None = None
    requests_per_minute: Annotated[float, Field(gt=0, le=100_000)] | None = None


class BrowserField(StrictTypes):
    """A stage's `browser` field, as in the spec: profile, headed, allow_domains, login_check."""

    profile: ProfileName | None = Field(default=None, description=(
        "profile name (^[a-z0-9][a-z0-9_-]{0,63}$) or '@pipeline' for the run's "
        "pipeline-derived identity; omitted: a throw-away browser"))
    headed: bool = Field(default=True, description=(
        "true: a visible window, refused with 400 no_display where the guard has no display. "
        "Omitted: a visible window where the guard has a display (DISPLAY or WAYLAND_DISPLAY set), "
        "else headless, without an error"), json_schema_extra=_no_default)
    allow_domains: list[AllowPattern] = Field(default_factory=list, max_length=256)
    login_check: LoginCheck | None = None
    writes: Literal["allow", "gate", "deny"] = Field(default="allow", description=(
        "what the stage may change on its allowed hosts: allow (as today), gate (each write held "
        "for a person), deny (every write refused); a site policy floor can only make it stricter"))
    budget: BudgetField | None = Field(None, description=(
        "the stage's budget: totals (then 429 until the stage ends) and a pace of its own; it only "
        "adds to the site policy's pace, never loosens it"))


class CreateRun(Strict):
    run_id: RunId
    pipeline: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None


class StageRequest(Strict):
    stage_id: StageId
    attempt: int = Field(ge=1, le=10_000)
    replay_safe: bool = Field(default=True, description=(
        "false: when an earlier attempt of this stage in the run sent a write, every write of a "
        "later attempt is held for a person (a retry never sends a form twice unasked)"))
    browser: BrowserField


class StageEnd(Strict):
    outcome: Literal["succeeded", "failed", "cancelled", "timed_out"]


class RunEnd(Strict):
    outcome: Literal["succeeded", "failed", "cancelled", "abandoned"]


#: Every error code the guard answers with (ErrorBody.code). Per route, the OpenAPI document
#: lists the ones that route can give (supervisor/daemon/api.py ROUTES).
ERROR_CODES = (
    # edge: any route
    "invalid_request", "invalid_json", "body_too_large", "unauthorized", "not_found",
    "method_not_allowed", "http_error", "internal",
    # the metrics token on a route it does not open; the readiness probe
    "token_scope", "not_ready",
    # runs and stages
    "run_exists", "run_not_found", "run_ended", "stage_not_found", "stage_active", "attempt_used",
    "reviewer_only_address",
    "stage_not_waiting", "no_pipeline", "no_display", "browser_failed",
    # profiles
    "invalid_name", "profile_not_found", "profile_leased",
    # a shared store (PostgreSQL) that does not answer; the guard's own disk full
    "store_unreachable", "disk_full",
    # login check, envelope verification, handoff
    "login_check_not_allowed", "login_check_failed", "invalid_pattern", "no_login_check",
    "envelope_mismatch", "handoff_impossible", "handoff_not_found", "console_off",
    # write approvals
    "approval_not_found", "approval_decided", "screenshot_not_found",
    # stage-exec
    "stage_ended", "stage_failed", "stage_not_ready", "sandbox_unavailable",
    # key rotation: another under way, a key version not on this host, the key state refuses
    "keys_busy", "key_missing", "key_state",
)
ErrorCode = Literal[ERROR_CODES]  # type: ignore[valid-type]


class ErrorBody(Strict):
    code: ErrorCode = Field(description="a stable code; see ERROR_CODES in supervisor/models.py")
    message: str = Field(description="one sentence for a person; never a secret")
    field: str | None = Field(default=None, description=(
        "the dotted path of the offending input (browser.allow_domains.2), or null"))


class ErrorAnswer(Strict):
    error: ErrorBody


class Answer(BaseModel):
    """A 2xx answer. Clients must ignore fields they do not know (the guard may add some)."""
    model_config = ConfigDict(extra="allow")


class StageReady(Answer):
    state: Literal["ready"]
    env: dict[str, str] = Field(description=(
        "the stage's environment: AGENT_BROWSER_CDP (the CDP gate with this stage's token), "
        "AGENT_BROWSER_SESSION, AGENT_BROWSER_SOCKET_DIR, AGENT_BROWSER_PIN_TAB, "
        "AGENT_BROWSER_CONFIG, AGENT_BROWSER_IDLE_TIMEOUT_MS; identical on every poll and resume"))
    exec_prefix: list[str] = Field(description=(
        "the argv prefix a runner puts in front of the stage's command to run it confined: "
        "`PYTHON -I -S SFGUARD/cli/stage_exec_entry.py --home HOME --run RUN --stage STAGE --`, "
        "the guard's own Python (isolated, without site-packages) running the fast entry of "
        "`sfguard stage-exec` by absolute path; the same command as `sfguard stage-exec --home HOME "
        "--run RUN --stage STAGE --`, independent of the runner's PATH"))
    writes: dict[str, Literal["allow", "gate", "deny"]] = Field(default_factory=dict, description=(
        "the effective write mode per allowed host pattern (the stricter of browser.writes and "
        "the site policy), for the runner to tell the agent"))
    pace: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "the effective pace per allowed host pattern (the site policy's, tightened by the "
        "budget's rates), with the rule that set each limit; empty where nothing is paced"))
    budget: dict[str, Any] = Field(default_factory=dict, description=(
        "the stage's budget as asked, and `active_until` (UTC) when it names active_minutes"))
    approvals: list[dict[str, Any]] = Field(default_factory=list, description=(
        "this stage's writes held for a person now: id, method, host, path, created, expires "
        "(long-poll GET /v1/approvals?run=RUN&state=pending&wait=S for changes)"))


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


class StageExec(Answer):
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
        "the guard's agent-browser, used after the command to end a daemon started inside"))
    tab: str | None = Field(default=None, description="the stage's pinned tab (CDP target id), "
                            "which a daemon started inside is bound to; null once the stage closed it")


class StageWaiting(Answer):
    state: Literal["waiting"]
    holder_run: str = Field(description="the run that holds the profile ('' while starting)")
    since: str = Field(description="UTC time (ISO 8601) since the holder has it, or since queued")
    position: int | None = Field(default=None, description="1 = next in the profile's queue")
    holder_host: str | None = Field(default=None, description=(
        "shared store only: the host of the guard whose run holds the profile"))
    holder_guard: str | None = Field(default=None, description=(
        "shared store only: the id of the guard (process) whose run holds the profile"))
    reason: Literal["store_unreachable", "browser_pool_full"] | None = Field(default=None, description=(
        "why no holder is named: store_unreachable (shared store only): the database is "
        "unreachable, the guard asks again and grants the profile when it answers; "
        "browser_pool_full (a root guard): every browser user is in use by a running browser, "
        "the stage starts when one ends"))
    message: str | None = Field(default=None, description="the reason in words")


class StageEnded(Answer):
    state: Literal["ended"]
    outcome: str


class RunCreated(Answer):
    run_id: str
    state: Literal["active"]


class Ok(Answer):
    ok: bool = True


class EndAnswer(Answer):
    ok: bool = Field(description="false when teardown reported problems (listed)")
    problems: list[str] = Field(default_factory=list)


class RunEndAnswer(EndAnswer):
    outcome: str | None = None


class RunStageEvent(Answer):
    ts: str = Field(description="UTC time (ISO 8601)")
    event: str = Field(description=(
        "browser_restarted: the stage's browser stopped and the guard restarted it (its tabs are "
        "gone, its gate URL changed: GET the stage for the new env)"))
    message: str


class RunStageInfo(Answer):
    stage_id: str
    attempt: int
    state: Literal["pending", "waiting", "ready", "relaunching", "ended", "failed"]
    profile: str | None
    outcome: str | None
    holder_run: str | None
    events: list[RunStageEvent] = Field(default_factory=list, description=(
        "what happened to the stage, oldest first (empty for most stages)"))


class RunPendingApproval(Answer):
    """A write of the run held for a person (GET /v1/approvals/{id} has the whole approval)."""
    id: str
    stage_id: str | None
    method: str
    host: str
    path: str


class RunBrowserInfo(Answer):
    profile: str | None
    throwaway: bool
    headed: bool
    alive: bool
    stages: list[str]
    restarts: int
    tabs: list[str] = Field(description=(
        "scheme://host of each page open in the browser (the stages' tabs and popups, the guard's own), "
        "read from the guard's pipe"))
    closed_tabs: list[str] = Field(description=(
        "scheme://host of tabs the guard closed because nobody opened them (a restored session, a "
        "start-up page, an extension's): none should come"))
    carried: list[str] = Field(description=(
        "what the profile carried that would have run before the guard (a saved session, start-up "
        "pages, crash restore, extensions), removed or kept from loading at this browser's start"))


class RunProxyInfo(Answer):
    port: int | None
    alive: bool
    restarts: int


class RunInfo(Answer):
    """A run as the guard holds it: names and states, never a secret."""
    run_id: str
    state: Literal["active", "ending", "ended"]
    outcome: str | None
    created: str
    pipeline: bool = Field(description="the run was created with a pipeline path")
    ended: str | None = None    # when it ended
    retired: bool = Field(default=False, description="the run left the guard's memory: its record from disk")
    stages: list[RunStageInfo]
    browsers: list[RunBrowserInfo]
    proxy: RunProxyInfo | None
    problems: list[str]
    approvals: list[RunPendingApproval] = Field(default_factory=list, description=(
        "GET /v1/runs/{run_id} of a run in the guard's memory: its writes held for a person"))


class GuardInfo(Answer):
    pid: int
    since: str
    home: str
    key_provider: str
    scope: str
    store: str | None = Field(default=None, description=(
        "where profiles, leases and audit live: 'local home' or 'PostgreSQL <url without password>'"))
    store_error: str | None = Field(default=None, description=(
        "why `leases` is empty this time: the store did not answer (the shared database is "
        "unreachable or slower than 2 s); null when it answered"))
    tcp_port: int | None = Field(default=None, description="the control API's loopback TCP port (--tcp)")
    version: str | None = Field(default=None, description="the running sfguard's version")


class PolicyState(Answer):
    file: str
    mode: Literal["enforce", "report"]
    state: Literal["ok", "error"] = Field(description="error: an invalid edit was refused and the "
                                          "last good policy is in force")
    error: str | None


class QueueEntryInfo(Answer):
    run: str
    since: str


class LeaseInfo(Answer):
    profile: str
    holder_run: str | None
    since: str | None
    queue: list[QueueEntryInfo]
    holder_host: str | None = Field(default=None, description="shared store only: the holder's host")
    holder_guard: str | None = Field(default=None, description="shared store only: the holder's guard id")


class ConsoleInfo(Answer):
    url: str = Field(description="the operator console's address (log in with `sfguard console`)")


class DiskState(Answer):
    """Free space where the guard writes; `low` under 512 MiB; free_bytes null when unreadable."""
    folder: Literal["home", "runtime"]
    path: str
    free_bytes: int | None
    low: bool


class ProfileInfoAnswer(Answer):
    name: str
    scope: str
    created: str
    last_used: str | None
    size: int
    leased_by: str | None
    identity: str | None = Field(default=None, description=(
        "the workflow identity the profile was made for (`pipeline-<hash>` of a `@pipeline` "
        "profile, the same on every host); null for a named profile"))


class ProfilesAnswer(Answer):
    profiles: list[ProfileInfoAnswer]


class HandoffAnswer(Answer):
    """The gate payload a runner shows the person (sfguard.supervisor.browsers.handoff.HandoffPayload)."""
    kind: Literal["local_window", "live_view"]
    site: str
    reason: str
    url: str | None = None


class HandoffState(Answer):
    state: Literal["open", "done", "cancelled", "expired", "ended"]
    kind: Literal["live_view", "local_window"]
    site: str
    profile: str
    logged_in: bool | None = Field(None, description="done: the guard's login check after Done")
    url: str | None = Field(None, description="done: the final address of that check")


class ConsoleLinkRequest(Strict):
    ttl_s: Annotated[int, Field(ge=1, le=86400)] = 600
    person: Annotated[str, StringConstraints(pattern=PERSON_NAME.pattern)] | None = Field(None, description=(
        "whom the link is for: its session's decisions are audited as `console:NAME` (1-32 of "
        "a-z 0-9 . _ -, starting with a letter, not `s-`); without it, as `console:<session id>`"))


class ConsoleLink(Answer):
    url: str = Field(description="one-time login link to the console (good once, until it expires)")
    expires: str


class LoginCheckRequest(Strict):
    profile: ProfileName
    login_check: LoginCheck


class LoginReported(Strict):
    logged_in: bool
    url: Annotated[str, StringConstraints(max_length=4096)]


class LoginVerifyRequest(Strict):
    profile: ProfileName
    reported: LoginReported


class LoginResultAnswer(Answer):
    logged_in: bool = Field(description="computed by the guard from the final address (and selector)")
    url: str = Field(description="the final address the check page landed on; query values "
                     "hidden (`?code=…`), no user info or fragment")


class HandoffRequest(Strict):
    profile: ProfileName
    site: Annotated[str, StringConstraints(min_length=1, max_length=300)]
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    url: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = None
    kind: Literal["auto", "local_window", "live_view"] = Field(
        "auto", description="auto: a local window where the guard has a screen, else a live view "
        "in the guard's console")
    stage_id: Annotated[str, StringConstraints(pattern=STAGE_ID)] | None = Field(
        None, description="the login stage: the handoff ends when it ends; Cancel in a live view "
        "fails it")
    login_check: LoginCheck | None = Field(
        None, description="live_view: the check the guard runs when the person presses Done "
        "(default: the stage's login_check)")
    timeout_s: Annotated[int, Field(ge=10, le=3600)] | None = Field(
        None, description="the handoff ends after this many seconds (default 900): a live view's "
        "link stops working; a local window closes (the anchor goes back to headless)")

from sfguard.supervisor.field_errors import error_message, field_path  # noqa: E402,F401 (one wording, kept here)
