"""Policy test cases: what a reviewer runs in CI (with `policy.replay` and `policy.diff`).

Pure like the rest of `policy/`: it reads text handed to it and answers data; the CLI
(`sfguard policy test`, cli/policy_test_cmd.py) reads files and prints.

    cf = parse_case_file(text, source)          # CaseFileError: each problem with its line
    results = run_cases(site_policy, cf.cases)  # a CaseResult per case

A case file (YAML) is a list of cases or `{policy: PATH, cases: [...]}` (PATH relative to the
case file). A case: `host` (HOST or HOST:PORT; IPv6 with a port in brackets), `expect` (allow |
deny), and optionally `reason` (the exact reason code), `allow` (the run's allow_domains,
comma-separated or a list) and `name` (shown with a failure); for the write gate `method`,
`path` (default /, query ignored), `writes` (the stage's browser.writes, default allow) and
`expect_write` (read | allow | gate | deny); for the pace section `expect_pace` (the strictest
limits that apply, e.g. `{page_loads_per_minute: 20, requests_per_minute: 120}`, or `none`).
A decision is the one `sfguard policy explain` gives: the host rules, and for IP literals the
address check. In report mode a would-be denial is decision `allow` with reason
`would_deny:<code>`, exactly as the proxy logs it. With examples: docs/policy.md, "Testing a
policy in CI".
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypedDict

import yaml

from sfguard.errors import SfguardError
from sfguard.policy.engine import Decision, SitePolicy, replace
from sfguard.policy.errors import MalformedHost, PolicyError
from sfguard.policy.hosts import parse_port, printable_host, split_host_port_raw
from sfguard.policy.index import RuleSet, compile_patterns
from sfguard.policy.pace import LIMITS
from sfguard.policy.writes import WRITE_MODES, WriteVerdict, effective
from sfguard.policy.yamlpos import node_line, node_value

MAX_CASE_BYTES = 4 * 1024 * 1024
CASE_KEYS = ("host", "allow", "expect", "reason", "name", "method", "path", "writes", "expect_write",
             "expect_pace")
EXPECT = ("allow", "deny")
EXPECT_WRITE = ("read", *WRITE_MODES)
class CaseFileError(SfguardError):
    """A case file that cannot be used: `problems` are lines `FILE[:LINE]: MESSAGE`."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Case:
    file: str
    line: int
    host: str
    expect: str
    allow: tuple[str, ...] = ()
    reason: str | None = None
    name: str | None = None
    method: str | None = None      # with expect_write: the write gate's verdict is checked
    path: str = "/"
    writes: str = "allow"
    expect_write: str | None = None
    expect_pace: dict[str, float] | None = None    # {} for `none`: no pace applies


@dataclass(frozen=True)
class CaseFile:
    file: str
    policy: str | None       # the `policy:` entry, as written (relative to the case file)
    cases: tuple[Case, ...]


class CaseResultRecord(TypedDict):
    """`CaseResult.as_dict()`: one result of `sfguard policy test --json`."""

    file: str
    line: int
    host: str
    allow: list[str]
    name: str | None
    expect: str
    expect_reason: str | None
    ok: bool
    decision: str
    reason: str
    rule: str | None
    expect_write: str | None
    write: dict[str, object] | None
    expect_pace: dict[str, float] | None
    pace: dict[str, float]


@dataclass(frozen=True)
class CaseResult:
    case: Case
    decision: Decision
    ok: bool
    write: WriteVerdict | None = None
    pace: dict[str, float] | None = None     # the strictest limits for the host (expect_pace)

    def problem(self) -> str:
        c, d = self.case, self.decision
        want = c.expect + (f" ({c.reason})" if c.reason else "")
        got = f"{d.decision} ({d.reason}" + (f", rule {d.rule}" if d.rule else "") + ")"
        if c.expect_write is not None:
            want += f", {c.method} {c.path} {c.expect_write}"
            w = self.write
            got += f", {c.method} {c.path} " + (
                "not sent (host denied)" if w is None else
                f"{write_outcome(w)} ({w.reason}" + (f", rule {w.rule}" if w.rule else "") + ")")
        if c.expect_pace is not None:
            want += f", pace {_pace_text(c.expect_pace)}"
            got += f", pace {_pace_text(self.pace or {})}"
        label = f" [{c.name}]" if c.name else ""
        return f"{c.file}:{c.line}: {printable_host(c.host)}{label}: expected {want}, got {got}"

    def as_dict(self) -> CaseResultRecord:
        c = self.case
        return {"file": c.file, "line": c.line, "host": c.host, "allow": list(c.allow),
                "name": c.name, "expect": c.expect, "expect_reason": c.reason, "ok": self.ok,
                "decision": self.decision.decision, "reason": self.decision.reason,
                "rule": self.decision.rule, "expect_write": self.case.expect_write,
                "write": self.write.as_dict() if self.write is not None else None,
                "expect_pace": c.expect_pace, "pace": self.pace or {}}


def _pace_text(limits: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(limits.items())) or "none"


def write_outcome(v: WriteVerdict) -> str:
    """`read`, or the write's mode: what a case's expect_write names."""
    return v.mode if v.write else "read"


# --------------------------------------------------------------------------- decisions

def decide_text(p: SitePolicy, text: str, allow: RuleSet | None) -> Decision:
    """The decision for one HOST[:PORT] as typed, with the address check for IP literals (the
    only addresses known without DNS)."""
    try:
        raw_host, raw_port = split_host_port_raw(text)
        port = parse_port(raw_port) if raw_port is not None else None
    except MalformedHost as exc:
        d = p.decide(text, None, allow)
        return replace(d, explanation=f"'{printable_host(text)}' is not a valid HOST[:PORT]: {exc.reason}.")
    d = p.decide(raw_host, port, allow)
    if d.allowed and not d.would_deny and d.normalized_host:
        host = d.normalized_host
        if ":" in host or host.replace(".", "").isdigit():
            d = p.check_address(d, host)
    return d


def split_patterns(value: Any) -> list[str]:
    """allow as written in a case: a comma-separated string or a list of strings."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return [x.strip() for x in items if isinstance(x, str) and x.strip()]


# --------------------------------------------------------------------------- case files

def parse_case_file(text: str, source: str) -> CaseFile:
    """Read a case file; raise CaseFileError listing every problem with its line."""
    if len(text) > MAX_CASE_BYTES:
        raise CaseFileError([f"{source}: the file is over {MAX_CASE_BYTES // (1024 * 1024)} MiB"])
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        raise CaseFileError([f"{where}: not valid YAML: {exc.problem or exc.context}"]) from None
    except yaml.YAMLError as exc:
        raise CaseFileError([f"{source}: not valid YAML: {exc}"]) from None
    problems: list[str] = []
    policy_path: str | None = None
    if root is None:
        raise CaseFileError([f"{source}: the file is empty (write a list of cases: "
                             "- {host: example.com, expect: deny})"])
    items_node: yaml.Node | None = root
    if isinstance(root, yaml.MappingNode):
        items_node = None
        for k, v in root.value:
            key = node_value(k)
            if key == "policy":
                value = node_value(v)
                if not isinstance(value, str) or not value:
                    problems.append(f"{source}:{node_line(v)}: policy: write the path of a policy file")
                else:
                    policy_path = value
            elif key == "cases":
                items_node = v
            else:
                close = difflib.get_close_matches(str(key), ("policy", "cases"), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "known keys: policy, cases"
                problems.append(f"{source}:{node_line(k)}: unknown key {key!r} ({hint})")
        if items_node is None:
            problems.append(f"{source}:{node_line(root)}: cases: missing (a list of cases)")
    cases: list[Case] = []
    if items_node is not None:
        if not isinstance(items_node, yaml.SequenceNode):
            problems.append(f"{source}:{node_line(items_node)}: cases: write a list of cases, e.g. "
                            "- {host: example.com, expect: deny}")
        else:
            for i, node in enumerate(items_node.value):
                case = _case(node, i, source, problems)
                if case is not None:
                    cases.append(case)
    if problems:
        raise CaseFileError(sorted(problems, key=_line_of))
    return CaseFile(source, policy_path, tuple(cases))


def _line_of(problem: str) -> int:
    """The line number in a `FILE:LINE: ...` problem (for sorting)."""
    head = problem.split(": ", 1)[0]
    tail = head.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _case(node: yaml.Node, i: int, source: str, problems: list[str]) -> Case | None:
    line = node_line(node)
    where = f"{source}:{line}: cases[{i}]"
    if not isinstance(node, yaml.MappingNode):
        problems.append(f"{where}: a case is a mapping such as {{host: example.com, expect: deny}}")
        return None
    values: dict[str, Any] = {}
    bad = False
    for k, v in node.value:
        key = node_value(k)
        if key not in CASE_KEYS:
            close = difflib.get_close_matches(str(key), CASE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(CASE_KEYS)}"
            problems.append(f"{source}:{node_line(k)}: cases[{i}].{key}: unknown key ({hint})")
            bad = True
            continue
        values[key] = node_value(v)
    host, expect = values.get("host"), values.get("expect")
    if not isinstance(host, str) or not host.strip():
        hint = f" (quote it: host: \"{host}\")" if isinstance(host, (int, float)) else ""
        problems.append(f"{where}.host: required, a HOST or HOST:PORT text{hint}")
        bad = True
    if expect not in EXPECT:
        problems.append(f"{where}.expect: required, allow or deny (got {expect!r})")
        bad = True
    reason = values.get("reason")
    if reason is not None and (not isinstance(reason, str) or not reason):
        problems.append(f"{where}.reason: a reason code such as blocked_by_policy")
        bad = True
    name = values.get("name")
    if name is not None and not isinstance(name, str):
        name = str(name)
    allow_raw = values.get("allow")
    if allow_raw is None:
        allow_raw = []
    if not isinstance(allow_raw, (str, list)) or (
            isinstance(allow_raw, list) and not all(isinstance(x, str) for x in allow_raw)):
        problems.append(f"{where}.allow: patterns as text ('*.example.com, a.org') or a list of text")
        bad = True
        allow: list[str] = []
    else:
        allow = split_patterns(allow_raw)
        try:
            compile_patterns(allow, source="allow")
        except PolicyError as exc:
            for issue in exc.issues:
                problems.append(f"{where}.allow: {issue.message}" + (f" (hint: {issue.hint})" if issue.hint else ""))
            bad = True
    method, path = values.get("method"), values.get("path", "/")
    writes, expect_write = values.get("writes", "allow"), values.get("expect_write")
    if (method is None) != (expect_write is None):
        problems.append(f"{where}: method and expect_write go together (the write gate's verdict "
                        "for that request)")
        bad = True
    if method is not None and (not isinstance(method, str) or not method.isalpha()):
        problems.append(f"{where}.method: an HTTP method such as POST (got {method!r})")
        bad = True
    if not isinstance(path, str) or not path.startswith("/"):
        problems.append(f"{where}.path: a path starting with / (got {path!r})")
        bad = True
    if writes not in WRITE_MODES:
        problems.append(f"{where}.writes: the stage's browser.writes, one of {', '.join(WRITE_MODES)} "
                        f"(got {writes!r})")
        bad = True
    if expect_write is not None and expect_write not in EXPECT_WRITE:
        problems.append(f"{where}.expect_write: one of {', '.join(EXPECT_WRITE)} (got {expect_write!r})")
        bad = True
    pace_ok, expect_pace = _expect_pace(values.get("expect_pace", ...), where, problems)
    if bad or not pace_ok or not isinstance(host, str) or not isinstance(expect, str):
        return None
    return Case(source, line, host.strip(), expect, tuple(allow), reason, name,
                method.upper() if isinstance(method, str) else None, str(path).split("?", 1)[0],
                str(writes), expect_write, expect_pace)


def _expect_pace(value: Any, where: str, problems: list[str]) -> tuple[bool, dict[str, float] | None]:
    """A case's expect_pace: (usable, value): absent (None), `none` ({}), or {LIMIT: number, ...}."""
    if value is ...:
        return True, None
    if value == "none":
        return True, {}
    if isinstance(value, dict) and value and all(
            k in LIMITS and type(v) in (int, float) and v > 0 for k, v in value.items()):
        return True, {str(k): float(v) for k, v in value.items()}
    problems.append(f"{where}.expect_pace: none, or limits such as {{requests_per_minute: 60}} "
                    f"({', '.join(LIMITS)}; got {value!r})"[:300])
    return False, None


def run_cases(p: SitePolicy, cases: Iterable[Case]) -> list[CaseResult]:
    out = []
    for c in cases:
        allow = compile_patterns(list(c.allow), source="allow") if c.allow else None
        d = decide_text(p, c.host, allow)
        ok = d.decision == c.expect and (c.reason is None or d.reason == c.reason)
        write = None
        if c.method is not None and d.allowed and d.normalized_host is not None:
            write = effective(c.writes, p.writes.judge(d.normalized_host, c.method, c.path, port=d.port))
        if c.expect_write is not None:
            ok = ok and write is not None and write_outcome(write) == c.expect_write
        limits = None
        if c.expect_pace is not None:
            found = p.pace.strictest(d.normalized_host, d.port) if d.allowed and d.normalized_host else {}
            limits = {k: float(v) for k, (v, _rule) in found.items()}
            ok = ok and limits == c.expect_pace
        out.append(CaseResult(c, d, ok, write, limits))
    return out
