"""`sfguard policy test|replay|diff`: assert a policy in CI and see what a change would do.

    sfguard policy test FILE... [--policy FILE | --home DIR] [--json]
        run case files (policy/casefile.py); one line per failing case with its file:line, then
        `N passed, M failed`. Exit 0 all passed, 1 some failed, 2 unusable input.
    sfguard policy replay DECISION_LOG --policy CANDIDATE [--allow P] [--json] [--exit-code]
        re-decide every logged request under CANDIDATE (policy/replay.py); what would change,
        per host.
    sfguard policy diff OLD NEW [--log DECISION_LOG] [--allow P] [--json]
        the rules that differ (policy/diff.py), and with --log their effect on that traffic.
        Exit 0 when the policies have the same rules, 1 when they differ, 2 unusable input
        (like diff(1)).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sfguard import policy
from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home
from sfguard.cli.policy_source import PolicySource, policy_source
from sfguard.policy import casefile, diff, replay

MAX_LOG_BYTES = 512 * 1024 * 1024


def register(psub: argparse._SubParsersAction) -> None:
    t = psub.add_parser(
        "test", help="run policy test cases (exit 1 when one fails)",
        description=("Run YAML case files against a policy: each case is {host: HOST[:PORT], "
                     "allow: PATTERNS (optional, a run's allow_domains), expect: allow|deny, "
                     "reason: CODE (optional)}; a file is a list of cases or {policy: PATH, "
                     "cases: [...]}. Prints each failing case with its file:line and "
                     "'N passed, M failed'. Exit 0 all passed, 1 a case failed, 2 unusable input."))
    t.add_argument("files", nargs="+", metavar="FILE", help="case files (YAML)")
    t.add_argument("--policy", metavar="FILE",
                   help="policy to test (default: the file's own policy: entry, else the policy "
                        "of the guard home, see --home)")
    add_home(t, "guard home whose policy to test when a case file names none (default "
                        "$SFGUARD_HOME or ~/.stageflow/guard): the policy its running guard "
                        "enforces, else its sites.yaml")
    t.add_argument("--json", action="store_true", help="print one JSON object with every result")
    t.set_defaults(func=cmd_test)

    r = psub.add_parser(
        "replay", help="re-decide a decision log under a candidate policy",
        description=("Re-decide every request of a proxy decision log (--decision-log, or the "
                     "guard's proxy logs) under a candidate policy and print what would change: "
                     "allow->deny, deny->allow and reason changes, counted per host. A run's "
                     "allow_domains are the patterns its allowed_by_run lines name, plus --allow. "
                     "Refusals made at connect time (SNI, Host header, credentials) are kept. "
                     "Exit 0 (1 with --exit-code when anything changes), 2 unusable input."))
    r.add_argument("log", metavar="DECISION_LOG", help="decision log (JSON lines); - reads stdin")
    r.add_argument("--policy", metavar="FILE", required=True, help="the candidate policy")
    r.add_argument("--allow", action="append", default=[], metavar="PATTERNS",
                   help="more run allow_domains, comma-separated (may be repeated)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--exit-code", action="store_true", help="exit 1 when any decision changes")
    r.set_defaults(func=cmd_replay)

    d = psub.add_parser(
        "diff", help="the rules two policies differ in, and their effect on a decision log",
        description=("Show the rules that differ between OLD and NEW (mode, ports, tab_quota, "
                     "allow_always, block with reasons, quiet, private_networks.allow) and, with "
                     "--log, how the decisions for that logged traffic change from OLD to NEW. "
                     "Exit 0 same rules, 1 different, 2 unusable input."))
    d.add_argument("old", metavar="OLD", help="the current policy file")
    d.add_argument("new", metavar="NEW", help="the changed policy file")
    d.add_argument("--log", metavar="DECISION_LOG", help="decision log to replay under both; - reads stdin")
    d.add_argument("--allow", action="append", default=[], metavar="PATTERNS",
                   help="more run allow_domains for --log, comma-separated (may be repeated)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_diff)


# --------------------------------------------------------------------------- helpers

def _load_policy(path: str | None, what: str = "policy") -> policy.SitePolicy:
    try:
        return policy.load_policy(path)
    except policy.PolicyError as exc:
        raise CliError(f"the {what} {path or '(shipped)'} is not valid:\n{exc}\n"
                       "(run `sfguard policy validate FILE` for details)", 2) from None


def _read_text(path: str, what: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        p = Path(path)
        if p.is_dir():
            raise CliError(f"{path}: is a folder, not a {what}", 2)
        if p.stat().st_size > MAX_LOG_BYTES:
            raise CliError(f"{path}: larger than {MAX_LOG_BYTES // (1024 * 1024)} MiB", 2)
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", 2) from None
    except UnicodeDecodeError:
        raise CliError(f"{path}: not UTF-8 text", 2) from None
    except OSError as exc:
        raise CliError(f"{path}: cannot read the {what}: {exc.strerror}", 2) from None


def _allow(values: list[str]) -> list[str]:
    out = [x.strip() for v in values for x in v.split(",") if x.strip()]
    if values and not out:
        raise CliError("--allow needs at least one pattern, e.g. --allow '*.example.com'", 2)
    try:
        policy.compile_patterns(out, source="--allow")
    except policy.PolicyError as exc:
        raise CliError(f"bad --allow pattern:\n{exc}", 2) from None
    return out


# --------------------------------------------------------------------------- test

def cmd_test(args: argparse.Namespace) -> int:
    files: list[casefile.CaseFile] = []
    problems: list[str] = []
    for name in args.files:
        try:
            files.append(casefile.parse_case_file(_read_text(name, "case file"), name))
        except casefile.CaseFileError as exc:
            problems += exc.problems
    if problems:
        raise CliError("unusable case file(s):\n" + "\n".join(problems), 2)
    policies: dict[str, policy.SitePolicy] = {}
    results: list[casefile.CaseResult] = []
    home_source: PolicySource | None = None
    for cf in files:
        if args.policy:
            path = args.policy
        elif cf.policy:
            path = str(Path(cf.file).parent / cf.policy)
        else:
            if home_source is None:
                home_source = policy_source(None, args.home)
                print(home_source.line(), file=sys.stderr)
            path = home_source.path
        if path not in policies:
            policies[path] = _load_policy(path)
        results += casefile.run_cases(policies[path], cf.cases)
    if not results:
        raise CliError("no cases in " + ", ".join(args.files) + " (nothing to test)", 2)
    failed = [r for r in results if not r.ok]
    passed = len(results) - len(failed)
    if args.json:
        print(json.dumps({"passed": passed, "failed": len(failed),
                          "policies": sorted(policies), "results": [r.as_dict() for r in results]},
                         ensure_ascii=False))
    else:
        for r in failed:
            print(r.problem())
        print(f"{passed} passed, {len(failed)} failed")
    return 1 if failed else 0


# --------------------------------------------------------------------------- replay and diff

def _read_log(path: str) -> replay.DecisionLog:
    log = replay.read_decision_log(_read_text(path, "decision log").splitlines())
    if not log.requests:
        raise CliError(f"{path}: no decision records in it"
                       + (f" ({len(log.skipped)} line(s) skipped, first at line {log.skipped[0][0]}: "
                          f"{log.skipped[0][1]})" if log.skipped else ""), 2)
    return log


def _print_replay(res: replay.Replay, before: str, after: str) -> None:
    counts = res.counts()
    for ch in res.changes:
        print(f"{ch.kind:<12} {policy.join_host_port(ch.host, ch.port)}  x{ch.count}  {ch.before} -> {ch.after}")
    print(f"{res.total} request(s) replayed ({before} -> {after}): {counts['allow->deny']} allow->deny, "
          f"{counts['deny->allow']} deny->allow, {counts['reason']} reason changed, "
          f"{res.unchanged} unchanged, {res.kept} kept (refused at connect time)")
    if res.skipped:
        n, why = res.skipped[0]
        print(f"{len(res.skipped)} line(s) skipped (first: line {n}, {why})", file=sys.stderr)


def cmd_replay(args: argparse.Namespace) -> int:
    extra = _allow(args.allow)
    candidate = _load_policy(args.policy, "candidate policy")
    res = replay.replay(_read_log(args.log), candidate, extra)
    if args.json:
        print(json.dumps(res.as_dict(), ensure_ascii=False))
    else:
        _print_replay(res, "logged", args.policy)
    return 1 if args.exit_code and res.changes else 0


def cmd_diff(args: argparse.Namespace) -> int:
    extra = _allow(args.allow)
    old_p = _load_policy(args.old, "policy")
    new_p = _load_policy(args.new, "policy")
    changes = diff.diff_policies(old_p, _read_text(args.old, "policy"),
                                     new_p, _read_text(args.new, "policy"))
    res = replay.replay(_read_log(args.log), new_p, extra, baseline=old_p) if args.log else None
    if args.json:
        out: dict[str, Any] = {"rules": [c.as_dict() for c in changes]}
        if res is not None:
            out["effect"] = res.as_dict()
        print(json.dumps(out, ensure_ascii=False))
    else:
        for c in changes:
            print(str(c))
        if not changes:
            print("the policies have the same rules")
        if res is not None:
            _print_replay(res, args.old, args.new)
    return 1 if changes else 0
