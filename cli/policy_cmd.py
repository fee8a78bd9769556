"""`sfguard policy validate|explain`: check a site policy and explain its decisions.

    sfguard policy validate [--policy FILE | FILE] [--home DIR] [--strict] [--json]
        exit 0 with a one-line summary when FILE (default: the policy the guard of the home
        enforces, see cli/policy_source.py; the file checked is named on stderr) is valid, after
        any warnings (duplicate entries, allow_always entries a block rule shadows), each as
        "warning: file:line:col: field: message (hint: ...)"; exit 1 with every error when it
        is not valid, or with --strict when there are warnings; 2 when it cannot be read.
    sfguard policy explain HOST[:PORT]... | - [--allow PATTERNS] [--policy FILE | --home DIR] [--json] [--exit-code]
        for each host (`-`: one per line from stdin): the normalised host and port, the
        decision, the reason code and the rule that decided. A host without a port is explained
        once when every policy port gets the same decision, else once per port. Exit 0 when
        every host was explained (denials included; with --exit-code: 1 when any host is
        denied), 2 for bad arguments or an invalid policy.
        With --method M [--path P] [--writes MODE]: also whether that request is a write on an
        allowed host and what the write gate does with it (sent, held for a person, refused),
        with the writes rule and line that decided (policy/writes.py). An allowed host's pace
        (policy/pace.py): each entry that applies, its limits and its rule.
    sfguard policy test|replay|diff: see cli/policy_test_cmd.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from sfguard import policy
from sfguard.cli.errors import CliError
from sfguard.cli.options import POLICY_HOME_HELP, add_home
from sfguard.cli.policy_source import policy_source
from sfguard.policy import pace
from sfguard.policy.hosts import parse_port, printable_host, split_host_port_raw
from sfguard.policy.writes import WRITE_MODES, WriteVerdict, effective


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("policy", help="validate the site policy and explain its decisions",
                            description="Validate the site policy and explain its decisions.")
    psub = parser.add_subparsers(dest="policy_command", metavar="SUBCOMMAND")
    psub.required = True

    val = psub.add_parser("validate", help="check a policy file",
                          description="Check a policy file; exit 0 when valid, 1 with every error when not.")
    val.add_argument("file", nargs="?", metavar="FILE",
                     help="policy file (default: the policy of the guard home, see --home); "
                          "same as --policy FILE")
    val.add_argument("--policy", dest="policy_file", metavar="FILE",
                     help="policy file (default: the policy of the guard home, see --home)")
    add_home(val, POLICY_HOME_HELP)
    val.add_argument("--strict", action="store_true",
                     help="treat warnings (duplicate entries, shadowed allow_always) as errors")
    val.add_argument("--json", action="store_true",
                     help="print one JSON object: {file, valid, errors: [{file, line, col, field, message, "
                          "hint}], warnings, summary}")
    val.set_defaults(func=cmd_validate)

    exp = psub.add_parser(
        "explain", help="explain the decision for hosts",
        description=("Explain the policy's decision for each HOST[:PORT]: the normalised host, the "
                     "decision, the reason code and the rule (file:line) that decided. Address checks "
                     "that need DNS are made by the proxy."))
    exp.add_argument("hosts", nargs="+", metavar="HOST[:PORT]",
                     help="a host, optionally with a port; IPv6 with a port as [2001:db8::1]:443; "
                          "- reads hosts from stdin, one per line")
    exp.add_argument("--allow", action="append", default=[], metavar="PATTERNS",
                     help="a run's allow_domains, comma-separated (may be repeated)")
    exp.add_argument("--policy", metavar="FILE",
                     help="policy file (default: the policy of the guard home, see --home)")
    add_home(exp, POLICY_HOME_HELP)
    exp.add_argument("--method", type=str.upper, metavar="METHOD",
                     help="also judge a request with this method as a write or a read (the "
                          "policy's writes section; see --path and --writes)")
    exp.add_argument("--path", default="/", metavar="PATH",
                     help="the request's path for --method (default /; the query is ignored)")
    exp.add_argument("--writes", choices=WRITE_MODES, default="allow",
                     help="the stage's browser.writes for --method (default allow)")
    exp.add_argument("--json", action="store_true", help="one JSON object per host per line")
    exp.add_argument("--exit-code", action="store_true",
                     help="exit 1 when any host is denied (report mode: would be denied)")
    exp.set_defaults(func=cmd_explain)

    from sfguard.cli import policy_test_cmd
    policy_test_cmd.register(psub)


def _summary(p: policy.SitePolicy) -> str:
    ports = ", ".join(str(x) for x in sorted(p.ports))
    return (f"{p.source}: valid (version {p.version}, mode {p.mode}; ports {ports}; "
            f"{len(p.allow_always)} allow_always, {len(p.block)} block, {len(p.quiet)} quiet, "
            f"{len(p.private_networks)} private_networks.allow, {len(p.writes)} writes, {len(p.pace)} pace; "
            f"tab_quota {p.tab_quota})")


def cmd_validate(args: argparse.Namespace) -> int:
    from sfguard.policy.lint import lint_policy  # noqa: PLC0415 (only validate needs it)

    if args.file and args.policy_file and args.file != args.policy_file:
        print("sfguard policy validate: error: give the policy file once (FILE or --policy FILE)",
              file=sys.stderr)
        return 2
    source = policy_source(args.policy_file or args.file, args.home)
    path = source.path
    print(source.line(), file=sys.stderr)
    try:
        p, warnings = lint_policy(path)
    except policy.PolicyError as exc:
        if args.json:
            print(json.dumps({"file": path, "valid": False,
                              "errors": [dataclasses.asdict(i) for i in exc.issues],
                              "more": exc.more}))
            return 2 if _unreadable(exc) else 1
        if _unreadable(exc):
            print(f"sfguard policy validate: error: {exc.issues[0]}", file=sys.stderr)
            return 2
        for issue in exc.issues:
            print(issue)
        count = len(exc.issues) + exc.more
        if exc.more:
            print(f"... and {exc.more} more")
        print(f"{count} error{'s' if count != 1 else ''}: the policy is not valid", file=sys.stderr)
        return 1
    strict = getattr(args, "strict", False)
    n = len(warnings)
    if args.json:
        print(json.dumps({"file": p.source, "valid": not (strict and n), "errors":
                          [dataclasses.asdict(i) for i in warnings] if strict else [],
                          "warnings": [] if strict else [dataclasses.asdict(i) for i in warnings],
                          "more": 0, "summary": p.summary() | {"version": p.version}}))
        return 1 if strict and n else 0
    kind = "error" if strict else "warning"
    for issue in warnings:
        print(f"{kind}: {issue}")
    if strict and n:
        print(f"{n} error{'s' if n != 1 else ''} (--strict: warnings count as errors): "
              "the policy is not accepted", file=sys.stderr)
        return 1
    print(_summary(p) + (f"; {n} warning{'s' if n != 1 else ''}" if n else ""))
    return 0


def _unreadable(exc: policy.PolicyError) -> bool:
    """The file could not be read at all (missing, a folder, unreadable): a usage error (2),
    not a policy that failed its check (1)."""
    return len(exc.issues) == 1 and exc.issues[0].field == "(file)" and \
        exc.issues[0].message.startswith("cannot read")


def _split_allow(values: list[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        parts = [part.strip() for part in value.split(",")]
        out += [part for part in parts if part]
        if not any(parts):
            raise CliError("--allow needs at least one pattern, e.g. --allow '*.example.com'")
    return out


def cmd_explain(args: argparse.Namespace) -> int:
    source = policy_source(args.policy, args.home)
    try:
        p = policy.load_policy(source.path)
    except policy.PolicyError as exc:
        raise CliError("the policy is not valid:\n" + str(exc) +
                       "\n(run `sfguard policy validate` for details)") from None
    allow = None
    patterns = _split_allow(args.allow)
    if patterns or args.allow:
        try:
            allow = policy.compile_patterns(patterns, source="--allow")
        except policy.PolicyError as exc:
            raise CliError("bad --allow pattern:\n" + str(exc)) from None

    hosts = list(args.hosts)
    if "-" in hosts:
        if hosts != ["-"]:
            raise CliError("give hosts as arguments or - (one per line on stdin), not both")
        hosts = [line.strip() for line in sys.stdin if line.strip() and not line.lstrip().startswith("#")]
        if not hosts:
            raise CliError("no hosts on stdin (one HOST[:PORT] per line)")
    denied = False
    first = True
    print(source.line(), file=sys.stderr)
    for text in hosts:
        for decision in explain_ports(p, text, allow):
            denied = denied or not decision.allowed or decision.would_deny
            write = _write_verdict(p, decision, args) if args.method else None
            paced = pace.explain(p.pace, decision.normalized_host, decision.port) \
                if decision.allowed and decision.normalized_host else []
            if args.json:
                extra = {"write": write.as_dict()} if write is not None else {}
                print(json.dumps({**decision.as_dict(), "policy": p.source, "pace": paced, **extra},
                                 ensure_ascii=False))
            else:
                if not first:
                    print()
                print(_human(p, decision, text))
                for entry in paced:
                    print(f"  pace:       {entry['text']}\n  pace rule:  {entry['rule']} ({entry['reason']})")
                if paced:
                    print("  pace note:  counted per profile (the account), across runs, stages and guard "
                          "hosts; requests are plain-HTTP requests and HTTPS connections (docs/policy.md)")
                if write is not None:
                    print(_human_write(write, args))
            first = False
    return 1 if args.exit_code and denied else 0


def explain_ports(p: policy.SitePolicy, text: str,
                  allow: policy.RuleSet | None) -> list[policy.Decision]:
    """The decisions for one HOST[:PORT] argument. With a port (or a malformed argument): one.
    Without: the decision for each of the policy's ports; one decision (port not given) when
    they all agree, else one per port, so that a port-specific rule is never hidden."""
    decision = explain_one(p, text, allow)
    if decision.port is not None or decision.normalized_host is None or len(p.ports) < 2:
        return [decision]
    per_port = [explain_one(p, policy.join_host_port(decision.normalized_host, port), allow)
                for port in sorted(p.ports)]
    if len({(d.decision, d.reason, d.rule) for d in per_port}) == 1:
        return [decision] if _same(decision, per_port[0]) else per_port
    return per_port


def _same(a: policy.Decision, b: policy.Decision) -> bool:
    return (a.decision, a.reason, a.rule) == (b.decision, b.reason, b.rule)


def explain_one(p: policy.SitePolicy, text: str, allow: policy.RuleSet | None) -> policy.Decision:
    """The decision for one HOST[:PORT] argument, with the address check for IP literals (the
    only addresses known without DNS)."""
    try:
        raw_host, raw_port = split_host_port_raw(text)
        port = parse_port(raw_port) if raw_port is not None else None
    except policy.MalformedHost as exc:
        # Explain the whole argument as a (malformed) host, with the reason about its port.
        decision = p.decide(text, None, allow)
        return policy.engine.replace(
            decision, explanation=f"'{printable_host(text)}' is not a valid HOST[:PORT]: {exc.reason}.")
    decision = p.decide(raw_host, port, allow)
    if decision.allowed and decision.normalized_host:
        host = decision.normalized_host
        if ":" in host or host.replace(".", "").isdigit():
            decision = p.check_address(decision, host)
    return decision


def _human(p: policy.SitePolicy, d: policy.Decision, asked: str) -> str:
    ports = ", ".join(map(str, sorted(p.ports)))
    port = str(d.port) if d.port is not None else f"not given (checked as for ports {ports})"
    lines = [
        printable_host(asked),
        f"  normalised: {d.normalized_host if d.normalized_host is not None else '(malformed)'}",
        f"  port:       {port}",
        f"  decision:   {d.decision.upper()} ({d.reason})",
        f"  rule:       {d.rule or '(none: ' + _no_rule(d) + ')'}",
        f"  why:        {d.explanation}",
    ]
    if d.quiet:
        lines.append("  note:       a quiet host: its denials are counted, not logged one by one")
    if d.allowed:  # report mode's would_deny too: the address check is enforced in every mode
        if d.allowed_by_ip:
            lines.append(f"  note:       allowed by an IP pattern: connections go only to addresses in {d.network}")
        else:
            lines.append("  note:       the proxy still checks the addresses it resolves to "
                         "(private, loopback and link-local addresses are refused unless "
                         "private_networks.allow lists them)")
    if p.mode == "report":
        lines.append("  note:       the policy is in report mode: hosts outside the allow and block "
                     "lists pass and are logged as would_deny; every other check still denies")
    return "\n".join(lines)


def _write_verdict(p: policy.SitePolicy, d: policy.Decision,
                   args: argparse.Namespace) -> WriteVerdict | None:
    """The write gate's verdict for --method/--path on an allowed host (None when denied: a
    denied host sees no request at all)."""
    if not d.allowed or d.normalized_host is None:
        return None
    path = args.path.split("?", 1)[0] or "/"
    if not path.startswith("/"):
        raise CliError(f"--path starts with /, not {path[:60]!r}")
    site = p.writes.judge(d.normalized_host, args.method, path, port=d.port)
    return effective(args.writes, site)


def _human_write(v: WriteVerdict, args: argparse.Namespace) -> str:
    what = "WRITE" if v.write else "READ"
    outcome = {"allow": "sent", "gate": "HELD for a person", "deny": "REFUSED"}[v.mode] if v.write else "sent"
    return "\n".join([
        f"  request:    {args.method} {args.path} (stage browser.writes: {args.writes})",
        f"  write gate: {what}, {outcome} ({v.reason})",
        f"  write rule: {v.rule or '(none: no writes entry decided)'}",
        f"  write why:  {v.explanation}"])


def _no_rule(d: policy.Decision) -> str:
    code = d.reason.split(":", 1)[-1]
    return {
        "malformed_host": "the host itself is refused",
        "port_not_allowed": "the port is not in the policy's ports",
        "not_allowed": "no rule allows it",
        "private_address": "the address check",
        "reviewer_only_address": "a run cannot open this address; private_networks.allow can",
    }.get(code, "built-in check")
