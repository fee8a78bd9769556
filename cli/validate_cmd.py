"""`sfguard validate PIPELINE.yaml [--policy FILE | --home DIR] [--no-tool-check]`: check a pipeline's browser
stages before a run.

Prints one line per finding, `FILE:LINE:COL: PATH: MESSAGE` (warnings say `warning:`), then a
summary on stderr. Exit 0 when there is no error (warnings allowed), 1 when there is at least
one, 2 when the pipeline cannot be read or the site policy is invalid. What is checked: see
supervisor/pipeline/spec.py.
"""
from __future__ import annotations

import argparse
import sys

from sfguard import policy
from sfguard.cli.options import add_home
from sfguard.cli.policy_source import policy_source
from sfguard.supervisor.pipeline.spec import validate_pipeline


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="check a pipeline's browser stages before a run",
        description=("Check a pipeline file: browser fields, allow_domains against the site policy, "
                     "login check patterns, the check -> login -> work routing, and that "
                     "agent-browser and a browser are installed. Exit 0 valid, 1 errors, 2 unusable input."))
    p.add_argument("pipeline", metavar="PIPELINE.yaml", help="the pipeline file")
    p.add_argument("--policy", metavar="FILE",
                   help="site policy (default: the policy of the guard home, see --home)")
    add_home(p, "guard home whose policy to check against (default $SFGUARD_HOME or "
                        "~/.stageflow/guard): the policy its running guard enforces, else its "
                        "sites.yaml, else the shipped template; the file checked is named on stderr")
    p.add_argument("--no-tool-check", action="store_true",
                   help="do not look for agent-browser and a browser on this machine")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    source = policy_source(args.policy, args.home)
    print(source.line(), file=sys.stderr)
    try:
        report = validate_pipeline(args.pipeline, policy_path=source.path,
                                   check_tools=not args.no_tool_check)
    except policy.PolicyError as exc:
        print(f"sfguard validate: error: the site policy is invalid:\n{exc}", file=sys.stderr)
        return 2
    if report.issues and report.issues[0].code == "file":
        print(f"sfguard validate: error: {report.issues[0]}", file=sys.stderr)
        return 2
    for issue in report.issues:
        print(issue)
    n_err, n_warn = len(report.errors), len(report.warnings)
    browsers = sum(1 for s in report.stages if s.has_browser)
    if n_err:
        print(f"{report.file}: {n_err} error(s), {n_warn} warning(s)", file=sys.stderr)
        return 1
    print(f"{report.file}: valid ({len(report.stages)} stages, {browsers} with a browser"
          + (f"; {n_warn} warning(s)" if n_warn else "") + ")", file=sys.stderr)
    return 0
