"""Pipeline validation (`sfguard validate PIPELINE.yaml`): find browser mistakes before a run.

    report = validate_pipeline(path, policy_path=None, check_tools=True)   # a PipelineReport

The pipeline shape is Stageflow-like (an example: supervisor/demo/login-pipeline.yaml; the
words: docs/runner-guide.md, "Words used here"): optional `name` and `description`, and
`stages`, each with a unique `id` (models.STAGE_ID), an optional stage `file` (relative, inside
the pipeline's folder; the entry's keys override the file's), `browser` (judged by
`sfguard.supervisor.models.BrowserField`, the model the control API uses, so a file and an API
request are judged alike), `next` (a stage id, a list of ids, or `{to: ID, if: "FIELD eq|ne
VALUE"}` entries), `gate` (`{type: confirm, message, handoff}`), `verify: login_check` and
`on_verify_fail`; a stage's other fields (`prompt`, ...) are not judged here.

`validate_pipeline` never raises for a bad pipeline. Each finding is `FILE:LINE:COL: PATH:
MESSAGE` (1-based, from the YAML node marks; a stage file's problems name the stage file): YAML
syntax, duplicate and unknown keys (with a "did you mean"), wrong shapes; every invalid
`browser` field; `allow_domains` patterns the site policy blocks anyway, and a login-check page
the run's own allow list would not let through; routes and `on_verify_fail` to unknown stages,
`verify: login_check` without a login check; a login topology that skips the work stage
silently (`topology.check_login_topology`); a missing agent-browser or browser when a stage has
a browser (docs/operator-guide.md, section 4). The other modules of this room do the work:
validator.py (the file, node by node), topology.py (the login topology), yamldoc.py (YAML with
node marks, placed by sfguard.policy.yamlpos) and report.py (what is found).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from sfguard import policy
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.pipeline.report import Issue, PipelineReport, Route, StageInfo
from sfguard.supervisor.pipeline.validator import (
    MAX_PIPELINE_BYTES,
    PIPELINE_KEYS,
    STAGE_FILE_KEYS,
    STAGE_KEYS,
    Validator,
)

__all__ = ["Issue", "PipelineReport", "Route", "StageInfo", "validate_pipeline",
           "PIPELINE_KEYS", "STAGE_KEYS", "STAGE_FILE_KEYS", "MAX_PIPELINE_BYTES"]


def _default_tools() -> list[tools.Tool]:
    return [tools.find_agent_browser(), tools.find_browser()]


def validate_pipeline(path: str | Path, *, policy_path: str | Path | None = None,
                      site_policy: policy.SitePolicy | None = None, check_tools: bool = True,
                      find_tools: Callable[[], Iterable[tools.Tool]] = _default_tools) -> PipelineReport:
    """Validate the pipeline file at `path`; never raises for a bad pipeline.

    The site policy is `site_policy`, else loaded from `policy_path`, else the shipped
    `policy/sites.yaml`; an invalid policy raises `policy.PolicyError` (the caller's problem,
    not the pipeline's). `check_tools=False` skips the agent-browser / browser look-up (for
    validating on a machine that will not run the pipeline)."""
    display = str(path)
    path = Path(path)
    if site_policy is None:
        site_policy = policy.load_policy(policy_path) if policy_path else policy.load_policy()
    v = Validator(path, display, site_policy, check_tools, find_tools)
    try:
        data = path.read_bytes()
    except OSError as exc:
        v.report.issues.append(Issue(display, None, None, "(file)",
                                     f"cannot read the pipeline: {exc.strerror}", "file"))
        return v.report
    if len(data) > MAX_PIPELINE_BYTES:
        v.report.issues.append(Issue(display, None, None, "(file)",
                                     "the pipeline is larger than 1 MiB", "file"))
        return v.report
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        v.report.issues.append(Issue(display, None, None, "(file)", "not UTF-8 text", "file"))
        return v.report
    return v.run(text)
