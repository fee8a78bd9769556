"""Policy test cases, decision-log replay and policy diffs: what a reviewer runs in CI.

Pure like the rest of `policy/`: it reads text handed to it and answers data; the CLI
(`sfguard policy test|replay|diff`, cli/policy_test_cmd.py) reads files and prints.

Case files (YAML), either a top-level list of cases or ``{policy: PATH, cases: [...]}``::

    policy: ../sites.yaml          # optional, relative to the case file
    cases:
      - host: www.linkedin.com     # HOST or HOST:PORT (IPv6 with a port: "[2001:db8::1]:443")
        expect: deny               # allow | deny
        reason: blocked_by_policy  # optional: the reason code must be this one
      - host: example.com:8443
        allow: "*.example.com:8443"  # optional: the run's allow_domains (comma-separated or a list)
        expect: allow
        name: a run may add a port  # optional: shown with a failure

A decision is the one `sfguard policy explain` gives: the host rules, and for IP literals the
address check. In report mode a would-be denial is decision `allow` with reason
`would_deny:<code>`, exactly as the proxy logs it.
"""
from __future__ import annotations

import difflib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import yaml

from sfguard.policy.engine import Decision, SitePolicy, replace
from sfguard.policy.errors import MalformedHost, PolicyError
from sfguard.policy.hosts import parse_port, printable_host, split_host_port_raw
from sfguard.policy.patterns import RuleSet, compile_patterns

MAX_CASE_BYTES = 4 * 1024 * 1024
CASE_KEYS = ("host", "allow", "expect", "reason", "name")
EXPECT = ("allow", "deny")
#: reason codes a host-level decision can give; the others are made by the proxy at connect time
HOST_REASONS = frozenset({"malformed_host", "port_not_allowed", "blocked_by_policy",
                          "allowed_by_run", "allowed_by_policy", "not_allowed"})


class CaseFileError(Exception):
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


@dataclass(frozen=True)
class CaseResult:
    case: Case
    decision: Decision
    ok: bool

    def problem(self) -> str:
        c, d = self.case, self.decision
        want = c.expect + (f" ({c.reason})" if c.reason else "")
        got = f"{d.decision} ({d.reason}" + (f", rule {d.rule}" if d.rule else "") + ")"
        label = f" [{c.name}]" if c.name else ""
        return f"{c.file}:{c.line}: {printable_host(c.host)}{label}: expected {want}, got {got}"

    def as_dict(self) -> CaseResultRecord:
        c = self.case
        return {"file": c.file, "line": c.line, "host": c.host, "allow": list(c.allow),
                "name": c.name, "expect": c.expect, "expect_reason": c.reason, "ok": self.ok,
                "decision": self.decision.decision, "reason": self.decision.reason,
                "rule": self.decision.rule}


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

def _mark(node: yaml.Node | None) -> int:
    return node.start_mark.line + 1 if node is not None else 1


def _construct(node: yaml.Node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


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
            key = _construct(k)
            if key == "policy":
                value = _construct(v)
                if not isinstance(value, str) or not value:
                    problems.append(f"{source}:{_mark(v)}: policy: write the path of a policy file")
                else:
                    policy_path = value
            elif key == "cases":
                items_node = v
            else:
                close = difflib.get_close_matches(str(key), ("policy", "cases"), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "known keys: policy, cases"
                problems.append(f"{source}:{_mark(k)}: unknown key {key!r} ({hint})")
        if items_node is None:
            problems.append(f"{source}:{_mark(root)}: cases: missing (a list of cases)")
    cases: list[Case] = []
    if items_node is not None:
        if not isinstance(items_node, yaml.SequenceNode):
            problems.append(f"{source}:{_mark(items_node)}: cases: write a list of cases, e.g. "
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
    line = _mark(node)
    where = f"{source}:{line}: cases[{i}]"
    if not isinstance(node, yaml.MappingNode):
        problems.append(f"{where}: a case is a mapping such as {{host: example.com, expect: deny}}")
        return None
    values: dict[str, Any] = {}
    bad = False
    for k, v in node.value:
        key = _construct(k)
        if key not in CASE_KEYS:
            close = difflib.get_close_matches(str(key), CASE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(CASE_KEYS)}"
            problems.append(f"{source}:{_mark(k)}: cases[{i}].{key}: unknown key ({hint})")
            bad = True
            continue
        values[key] = _construct(v)
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
    if bad or not isinstance(host, str) or not isinstance(expect, str):
        return None
    return Case(source, line, host.strip(), expect, tuple(allow), reason, name)


def run_cases(p: SitePolicy, cases: Iterable[Case]) -> list[CaseResult]:
    out = []
    for c in cases:
        allow = compile_patterns(list(c.allow), source="allow") if c.allow else None
        d = decide_text(p, c.host, allow)
        ok = d.decision == c.expect and (c.reason is None or d.reason == c.reason)
        out.append(CaseResult(c, d, ok))
    return out


# --------------------------------------------------------------------------- decision logs

@dataclass(frozen=True)
class LoggedRequest:
    line: int
    run: str | None
    host: str
    port: int | None
    decision: str
    reason: str
    rule: str | None
    addr: str | None
    count: int = 1


@dataclass
class DecisionLog:
    requests: list[LoggedRequest] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (line, why)
    run_allow: dict[str | None, list[str]] = field(default_factory=dict)


def read_decision_log(lines: Iterable[str]) -> DecisionLog:
    """Parse decision-log JSON lines (the proxy's `--decision-log`). Lines that are not
    decisions are listed in `skipped`; aggregated quiet denials become one request per host
    (no port is logged for them: they are re-decided as `policy explain HOST` is)."""
    log = DecisionLog()
    for n, raw in enumerate(lines, 1):
        raw = raw.strip()
        if not raw:
            continue
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            log.skipped.append((n, "not JSON"))
            continue
        if not isinstance(rec, dict) or rec.get("decision") not in ("allow", "deny") \
                or not isinstance(rec.get("reason"), str):
            log.skipped.append((n, "not a decision record"))
            continue
        run = rec.get("run") if isinstance(rec.get("run"), str) else None
        if rec.get("source") == "cdp_gate":
            log.skipped.append((n, "a CDP gate refusal, not a host decision"))
            continue
        if rec["reason"] == "quiet_denials":
            hosts = rec.get("hosts")
            if not isinstance(hosts, dict):
                log.skipped.append((n, "quiet_denials without hosts"))
                continue
            for host, count in hosts.items():
                if isinstance(host, str) and host and isinstance(count, int) and count > 0:
                    log.requests.append(LoggedRequest(n, run, host, None, "deny", "quiet_denials",
                                                      None, None, count))
            continue
        host, port = rec.get("host"), rec.get("port")
        if not isinstance(host, str) or not host or (port is not None and (
                not isinstance(port, int) or isinstance(port, bool))):
            log.skipped.append((n, "no host or a bad port"))
            continue
        rule = rec.get("rule") if isinstance(rec.get("rule"), str) else None
        addr = rec.get("addr") if isinstance(rec.get("addr"), str) else None
        log.requests.append(LoggedRequest(n, run, host, port, rec["decision"], rec["reason"],
                                          rule, addr))
        # The run's own allow_domains are not logged, but every allowed_by_run line names the
        # pattern that allowed it ("SOURCE PATTERN"): replay keeps those patterns for the run.
        if rec["reason"].endswith("allowed_by_run") and rule:
            pattern = rule.rsplit(" ", 1)[-1]
            known = log.run_allow.setdefault(run, [])
            if pattern not in known:
                known.append(pattern)
    return log


class ChangeRecord(TypedDict):
    """`Change.as_dict()`."""

    host: str
    port: int | None
    change: str
    before: str
    after: str
    count: int


class SkippedRecord(TypedDict):
    line: int
    why: str


class ReplayRecord(TypedDict):
    """`Replay.as_dict()`: the shape of `sfguard policy replay --json`."""

    total: int
    unchanged: int
    kept: int
    counts: dict[str, int]
    changes: list[ChangeRecord]
    skipped: list[SkippedRecord]


@dataclass(frozen=True)
class Change:
    host: str
    port: int | None
    kind: str            # "allow->deny" | "deny->allow" | "reason"
    before: str          # reason before
    after: str           # reason after
    count: int

    def as_dict(self) -> ChangeRecord:
        return {"host": self.host, "port": self.port, "change": self.kind, "before": self.before,
                "after": self.after, "count": self.count}


@dataclass
class Replay:
    total: int = 0
    unchanged: int = 0
    kept: int = 0                      # connect-time refusals that a host policy cannot change
    changes: list[Change] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c: Counter[str] = Counter()
        for ch in self.changes:
            c[ch.kind] += ch.count
        return {"allow->deny": c["allow->deny"], "deny->allow": c["deny->allow"],
                "reason": c["reason"]}

    def as_dict(self) -> ReplayRecord:
        return {"total": self.total, "unchanged": self.unchanged, "kept": self.kept,
                "counts": self.counts(), "changes": [c.as_dict() for c in self.changes],
                "skipped": [{"line": n, "why": why} for n, why in self.skipped]}


def redecide(p: SitePolicy, req: LoggedRequest, allow: RuleSet | None) -> tuple[str, str] | None:
    """(decision, reason) of `p` for a logged request, or None when the logged answer was a
    connect-time refusal (SNI, Host header, credentials, ...) that `p` would not reach."""
    d = p.decide(req.host, req.port, allow)
    base = req.reason.removeprefix("would_deny:")
    if d.allowed and not d.would_deny:
        if req.addr:
            d = p.check_address(d, req.addr)
        elif base not in HOST_REASONS and base != "quiet_denials" and base != "private_address":
            return None
    return d.decision, d.reason


def replay(log: DecisionLog, candidate: SitePolicy, extra_allow: list[str] | None = None,
           baseline: SitePolicy | None = None) -> Replay:
    """Re-decide every logged request under `candidate` and list what changes, per host.

    The "before" side is what was logged, or, with `baseline`, what `baseline` decides (that is
    how `policy diff --log` compares two policies on the same traffic). A run's allow_domains
    are the patterns its allowed_by_run lines name, plus `extra_allow`."""
    out = Replay(skipped=list(log.skipped))
    groups: dict[tuple[str, int | None, str, str, str], int] = {}
    cache: dict[str | None, RuleSet | None] = {}
    for req in log.requests:
        out.total += req.count
        if req.run not in cache:
            patterns = list(log.run_allow.get(req.run, [])) + list(extra_allow or [])
            try:
                cache[req.run] = compile_patterns(patterns, source="allow_domains") if patterns else None
            except PolicyError:
                cache[req.run] = compile_patterns(list(extra_allow or []), source="allow_domains") \
                    if extra_allow else None
        allow = cache[req.run]
        if baseline is None:
            before = (req.decision, req.reason)
        else:
            before = redecide(baseline, req, allow) or (req.decision, req.reason)
        after = redecide(candidate, req, allow)
        if after is None:
            out.kept += req.count
            continue
        if before[0] == after[0] and _same_reason(before[1], after[1]):
            out.unchanged += req.count
            continue
        kind = "reason" if before[0] == after[0] else f"{before[0]}->{after[0]}"
        key = (req.host, req.port, kind, before[1], after[1])
        groups[key] = groups.get(key, 0) + req.count
    out.changes = [Change(h, p, k, b, a, n) for (h, p, k, b, a), n in groups.items()]
    order = {"allow->deny": 0, "deny->allow": 1, "reason": 2}
    out.changes.sort(key=lambda c: (order[c.kind], -c.count, c.host, c.port or 0))
    return out


def _same_reason(a: str, b: str) -> bool:
    # quiet denials are logged without their reason; any denial reason matches them
    return a == b or "quiet_denials" in (a, b)


# --------------------------------------------------------------------------- policy diffs

class RuleChangeRecord(TypedDict):
    """`RuleChange.as_dict()`: one rule of `sfguard policy diff --json`."""

    section: str
    op: str
    entry: str
    where: str
    detail: str


@dataclass(frozen=True)
class RuleChange:
    section: str         # mode, ports, tab_quota, allow_always, block, quiet, private_networks.allow
    op: str              # "+" added, "-" removed, "~" changed
    entry: str
    where: str           # FILE:LINE of the entry (the new file for + and ~, the old one for -)
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.op} {self.section}: {self.entry}" + (f"  ({self.detail})" if self.detail else "") \
            + f"  [{self.where}]"

    def as_dict(self) -> RuleChangeRecord:
        return {"section": self.section, "op": self.op, "entry": self.entry, "where": self.where,
                "detail": self.detail}


def _entries(text: str, source: str) -> dict[str, dict[str, tuple[int, str]]]:
    """section -> entry -> (line, detail) of a policy file that already validated."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    out: dict[str, dict[str, tuple[int, str]]] = {s: {} for s in (
        "mode", "ports", "tab_quota", "allow_always", "block", "quiet", "private_networks.allow")}
    if not isinstance(root, yaml.MappingNode):
        return out

    def seq(node: yaml.Node, section: str, detail: str = "") -> None:
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                out[section].setdefault(str(_construct(item)), (_mark(item), detail))
        elif isinstance(node, yaml.ScalarNode) and _construct(node) is not None:
            out[section].setdefault(str(_construct(node)), (_mark(node), detail))

    for k, v in root.value:
        key = _construct(k)
        if key in ("mode", "tab_quota"):
            out[key][str(_construct(v))] = (_mark(v), "")
        elif key in ("ports", "allow_always", "quiet"):
            seq(v, key)
        elif key == "private_networks" and isinstance(v, yaml.MappingNode):
            for k2, v2 in v.value:
                if _construct(k2) == "allow":
                    seq(v2, "private_networks.allow")
        elif key == "block" and isinstance(v, yaml.SequenceNode):
            for entry in v.value:
                if not isinstance(entry, yaml.MappingNode):
                    continue
                fields = {_construct(a): b for a, b in entry.value}
                reason = str(_construct(fields["reason"])).strip() if "reason" in fields else ""
                if "pattern" in fields:
                    seq(fields["pattern"], "block", reason)
                if "patterns" in fields:
                    seq(fields["patterns"], "block", reason)
    return out


def diff_policies(old: SitePolicy, old_text: str, new: SitePolicy, new_text: str) -> list[RuleChange]:
    """The rules that differ between two valid policies (`old_text`/`new_text`: their files'
    text, for the entries and their lines). Defaults count as written: a file without `mode`
    is in enforce mode like one that says so."""
    a_all, b_all = _entries(old_text, old.source), _entries(new_text, new.source)
    changes: list[RuleChange] = []

    def where(source: str, entries: dict[str, tuple[int, str]], key: str | None = None) -> str:
        found = entries.get(key) if key is not None else next(iter(entries.values()), None)
        return f"{source}:{found[0]}" if found else source

    for section, va, vb in (("mode", old.mode, new.mode), ("tab_quota", old.tab_quota, new.tab_quota)):
        if va != vb:
            changes.append(RuleChange(section, "~", f"{va} -> {vb}", where(new.source, b_all[section])))
    a_all["ports"] = {str(p): a_all["ports"].get(str(p), (0, "")) for p in sorted(old.ports)}
    b_all["ports"] = {str(p): b_all["ports"].get(str(p), (0, "")) for p in sorted(new.ports)}
    for section in ("ports", "allow_always", "block", "quiet", "private_networks.allow"):
        a, b = a_all[section], b_all[section]
        for entry, (line, detail) in b.items():
            at = f"{new.source}:{line}" if line else new.source
            if entry not in a:
                changes.append(RuleChange(section, "+", entry, at, detail))
            elif a[entry][1] != detail:
                changes.append(RuleChange(section, "~", entry, at,
                                          f"reason was {a[entry][1]!r}, now {detail!r}"))
        for entry, (line, detail) in a.items():
            if entry not in b:
                changes.append(RuleChange(section, "-", entry,
                                          f"{old.source}:{line}" if line else old.source, detail))
    return changes
