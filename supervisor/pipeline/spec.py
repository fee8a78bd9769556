"""Pipeline validation (`sfguard validate PIPELINE.yaml`): find browser mistakes before a run.

The pipeline shape read here is Stageflow-like::

    name: login-example                 # optional
    description: ...                    # optional
    stages:
      - id: check                       # required, unique, ^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$
        file: stages/check.yaml         # optional stage file (relative, inside the pipeline's
                                        # folder); keys of the entry override the file's keys
        prompt: ...                     # the stage's own fields are not judged here
        browser:                        # the spec's browser field (sfguard.supervisor.models.BrowserField)
          profile: fixture
          headed: true
          allow_domains: ["127.0.0.1:8080"]
          login_check: {url: ..., logged_in: ..., logged_out: [...], selector: ...}
        next:                           # routes: a stage id, a list of ids, or a list of
          - to: login                   # {to: ID, if: "FIELD eq|ne VALUE"}
            if: logged_in eq false
          - to: work
        gate: {type: confirm, message: ..., handoff: {kind: local_window, site: ..., reason: ...}}
        verify: login_check             # after-phase: re-run the stage's login check
        on_verify_fail: login           # where a failed verify sends the run (the same stage)

What is reported (each as `FILE:LINE:COL: PATH: MESSAGE`, line and column 1-based, from the
YAML node marks; a stage file's problems name the stage file):

* YAML syntax errors, duplicate keys, unknown keys (with a "did you mean"), wrong shapes;
* every invalid `browser` field, validated by `sfguard.supervisor.models.BrowserField`, the same model
  the control API uses, so a file and an API request are judged alike; every bad
  `allow_domains` entry, every login-check URL pattern that does not compile;
* `allow_domains` patterns the site policy blocks anyway (`blocked_by_policy`), and a login
  check page that the run's own allow list would not let through the proxy;
* routes to unknown stages, `on_verify_fail` to an unknown stage, `verify: login_check`
  without a login check;
* a login-stage topology that skips the work stage silently (see `check_login_topology`);
* a missing agent-browser or browser on this machine when any stage has a browser.

`validate_pipeline` returns a `PipelineReport`; it never raises for a bad pipeline. The work is
done by the other modules of this room: validator.py (the file, node by node), topology.py (the
login topology), yamldoc.py (YAML files with node marks, placed by sfguard.policy.yamlpos) and
report.py (what is found).
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
