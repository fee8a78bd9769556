"""Reading `sites.yaml`: YAML with line marks, the pydantic schema, and pattern checks.

The file is read in three steps, and every problem of every step is reported together, each at
file:line:col with the field and a hint:

1. YAML events (libyaml through PyYAML's C parser) are assembled into plain dicts, lists and
   scalars that remember where each key and item stood (`policy.yamltree`). Anchors, aliases
   and tags are refused (no YAML bombs, no object construction), as are duplicate keys. Scalars
   follow the YAML 1.2 core schema (``yes``/``no``/``on``/``off`` stay text). Files over
   `MAX_POLICY_BYTES` are refused before parsing.
2. The structure is validated by strict pydantic models (`policy.file_model`: unknown keys are
   errors; no type coercion: ``"443"`` is not a port). Error locations are mapped back to the
   marks of step 1 by `policy.yamlpos`, which pipeline validation uses too.
3. Every pattern is parsed by `policy.patterns.parse_pattern` straight into the rule index
   (`policy.index`; plain canonical names skip the parser through `RuleSet.add_plain_names`,
   which is what makes a million-entry block list load in seconds).

For big block lists the grouped form is much faster to read than one mapping per entry (YAML
events dominate), and it is the natural shape of a feed::

    block:
      - reason: "Known phishing hosts (feed 2024-06-01)"
        patterns:
          - bad-1.example
          - bad-2.example
"""
from __future__ import annotations

import difflib
import gc
import os
from pathlib import Path
from typing import Any

from sfguard.policy.engine import SitePolicy
from sfguard.policy.errors import PolicyError, PolicyIssue
from sfguard.policy.file_model import KEYS, PaceEntryModel, PolicyFile
from sfguard.policy.index import RuleSet
from sfguard.policy.pace import LIMITS, MAX_WAIT_CAP, PaceEntry, PaceRules
from sfguard.policy.patterns import Pattern, PatternError, parse_pattern
from sfguard.policy.recording import RecordingEntry, RecordingRules
from sfguard.policy.writes import WriteEntry, WriteRules, parse_request_pattern
from sfguard.policy.yamlpos import Loc, loc_path, validate_at
from sfguard.policy.yamltree import COL_BITS, Composer, YMap, YSeq, at_root, child, unpack

MAX_POLICY_BYTES = 64 * 1024 * 1024
MAX_ISSUES = 200
# Step 2: the schema (policy/file_model.py)

def _field_text(loc: Loc) -> str:
    return loc_path(loc) or "(top level)"


_PACE_HINTS = {
    "page_loads_per_minute": "a number of page loads a minute above 0, e.g. page_loads_per_minute: 20",
    "requests_per_minute": "a number of requests a minute above 0, e.g. requests_per_minute: 120",
    "min_gap_s": "seconds between two page loads, above 0 and at most 3600, e.g. min_gap_s: 2",
    "connections": "connections open at once, a whole number from 1 to 1000",
    "burst": "how many may go at once before the pace applies, a whole number from 1 to 1000",
    "max_wait_s": (f"0 to {MAX_WAIT_CAP:g} seconds: a request waits a few seconds (the browser slows "
                   "down) and is then refused with 429; write over: refuse to refuse at once"),
}


def _schema_issue(err: dict[str, Any], at: tuple[Any, int], source: str) -> PolicyIssue:
    loc = tuple(err["loc"])
    kind = err["type"]
    field = _field_text(loc)
    line, col = unpack(at[1])
    msg, hint = err["msg"], None
    name = next((p for p in reversed(loc) if isinstance(p, str)), "")
    shape = tuple(p for p in loc[:-1] if isinstance(p, str))
    if kind == "extra_forbidden":
        key = str(loc[-1]) if loc else "?"
        allowed = KEYS.get(tuple(p for p in loc[:-1] if isinstance(p, str)), [])
        msg = f"unknown key '{key}'"
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed keys here: {', '.join(allowed)}"
    elif kind == "missing":
        msg = f"'{name}' is required"
        hint = {"version": "start the file with: version: 1",
                "level": "write the recording level: off, decisions or full",
                "reason": ('every writes entry needs a reason a reviewer can read, '
                           'e.g. reason: "payments need a person"' if "writes" in shape else
                           'every recording entry needs a reason a reviewer can read, '
                           'e.g. reason: "statements on screen"' if "recording" in shape else
                           'every pace entry needs a reason a reviewer (and the agent that is '
                           'slowed down) can read, e.g. reason: "the site locks fast accounts"'
                           if "pace" in shape else
                           'every block entry needs a reason a reviewer can read, '
                           'e.g. reason: "terms forbid automation"'),
                }.get(name)
        field = _field_text(loc)
    elif kind == "literal_error":
        hint = {"mode": ("write mode: allow, gate or deny" if "writes" in shape else
                         "write mode: enforce (deny) or mode: report (log would_deny, allow)"),
                "level": "recording level: off, decisions or full",
                "version": "this sfguard reads version: 1",
                "over": "over: wait (hold a request up to max_wait_s, then 429) or over: refuse (429 at once)",
                }.get(name, None)
        msg = f"{msg}, got {err.get('input')!r}"
    elif kind in ("greater_than", "greater_than_equal", "less_than_equal"):
        msg = f"{msg}, got {err.get('input')!r}"
        hint = "ports are 1-65535" if "ports" in shape else _PACE_HINTS.get(name) if "pace" in shape else None
        if name == "tab_quota":
            hint = "tab_quota is a whole number from 1 to 1000"
    elif kind in ("float_type", "float_parsing"):
        hint = "write a number without quotes" + (f": {_PACE_HINTS[name]}" if name in _PACE_HINTS else "")
        msg = f"{msg}, got {err.get('input')!r}"[:200]
    elif kind == "string_type":
        hint = 'write text; quote values YAML reads otherwise, e.g. "*.example.com" or "[::1]:8080"'
        msg = f"{msg}, got {err.get('input')!r}"[:200]
    elif kind in ("int_type", "int_parsing"):
        hint = "write a whole number without quotes"
        msg = f"{msg}, got {err.get('input')!r}"[:200]
    elif kind == "list_type":
        hint = "write a list, one '- item' per line"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        msg = f"expected key: value pairs, got {type(err.get('input')).__name__}"
        msg = msg.replace("YSeq", "a list").replace("YMap", "a mapping").replace(" str", " text")
        hint = "write key: value pairs here" if loc else "the file must be a mapping, starting with version: 1"
    elif kind == "too_short":
        hint = "list at least one port, e.g. ports: [80, 443]" if name == "ports" else None
    elif kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", msg))
        hint = ('write pattern: HOST for one rule, or patterns: [HOST, ...] for a group'
                if "pattern" in msg else 'write a reason, e.g. reason: "terms forbid automation"')
        if "no limit" in msg:
            hint = f"give at least one of {', '.join(LIMITS)}, e.g. page_loads_per_minute: 20"
    return PolicyIssue(source, line, col, field, msg, hint)


# ---------------------------------------------------------------------------------------------
# Step 3: patterns, straight into the index

class _Builder:
    def __init__(self, source: str, label: str):
        self.source = source
        self.issues: list[PolicyIssue] = []
        self.more = 0
        self.block = RuleSet(label)
        self.allow_always = RuleSet(label)
        self.quiet = RuleSet(label)
        self.private: list[str] = []
        self.private_lines: list[int] = []
        self.writes: list[WriteEntry] = []
        self.recording: list[RecordingEntry] = []
        self.pace: list[PaceEntry] = []

    def issue(self, pos: int, field: str, message: str, hint: str | None) -> None:
        if len(self.issues) >= MAX_ISSUES:
            self.more += 1
            return
        line, col = unpack(pos)
        self.issues.append(PolicyIssue(self.source, line, col, field, message, hint))

    def patterns(self, seq: Any, field: str, rules: RuleSet | None, *, allow_list: bool,
                 reason: str | None = None, networks_only: bool = False) -> None:
        if not isinstance(seq, YSeq):
            return
        positions = seq.itempos
        if rules is not None and not networks_only:
            # The bulk path: canonical plain names go straight into the index.
            for i in rules.add_plain_names(seq, positions, COL_BITS, reason):
                self.one(seq[i], positions[i], f"{field}[{i}]", rules, allow_list=allow_list, reason=reason)
            return
        for i, text in enumerate(seq):
            self.one(text, positions[i], f"{field}[{i}]", rules, allow_list=allow_list,
                     reason=reason, networks_only=networks_only)

    def write_entry(self, entry: YMap, i: int, label: str) -> None:
        """One entry of `writes`: its host patterns into a RuleSet of its own, its request
        patterns parsed (the schema has checked the shape and reports wrong types)."""
        reason = entry.get("reason")
        reason = reason.strip() if isinstance(reason, str) else ""
        mode = entry.get("mode", "allow")
        hosts = RuleSet(label)
        before = len(self.issues)
        texts = self.entry_hosts(entry, f"writes[{i}]", hosts, reason)
        found: dict[str, list[Any]] = {"reads": [], "writes": []}
        for kind in found:
            seq = entry.get(kind)
            if not isinstance(seq, YSeq):
                continue
            for j, item in enumerate(seq):
                pos = seq.itempos[j]
                text, ignore_case = item, False
                if isinstance(item, YMap):     # {request: "GET /x", ignore_case: true}
                    text, ignore_case = item.get("request"), item.get("ignore_case") is True
                try:
                    found[kind].append(parse_request_pattern(text, kind, unpack(pos)[0], ignore_case=ignore_case))
                except PatternError as exc:
                    if isinstance(text, str):
                        self.issue(pos, f"writes[{i}].{kind}[{j}]", exc.message, exc.hint)
        if len(self.issues) == before and texts and reason and mode in ("allow", "gate", "deny"):
            self.writes.append(WriteEntry(tuple(texts), hosts, mode, reason,
                                          unpack(entry.pos)[0], tuple(found["reads"]),
                                          tuple(found["writes"]), label))

    def recording_entry(self, entry: YMap, i: int, label: str) -> None:
        """One entry of `recording`: its host patterns into a RuleSet of its own."""
        reason = entry.get("reason")
        reason = reason.strip() if isinstance(reason, str) else ""
        level = entry.get("level")
        hosts = RuleSet(label)
        before = len(self.issues)
        texts = self.entry_hosts(entry, f"recording[{i}]", hosts, reason)
        if len(self.issues) == before and texts and reason and level in ("off", "decisions", "full"):
            self.recording.append(RecordingEntry(tuple(texts), hosts, str(level), reason,
                                                 unpack(entry.pos)[0], label))

    def entry_hosts(self, entry: YMap, where: str, hosts: RuleSet, reason: str) -> list[str]:
        """The host patterns of a `writes`, `recording` or `pace` entry into `hosts`; their canonical texts
        (`PAY.Corp.test.` -> `pay.corp.test`: what the gates, the stage answer and logs name)."""
        texts: list[str] = []
        if "pattern" in entry:
            found = self.one(entry["pattern"], entry.valpos.get("pattern", entry.pos), f"{where}.pattern",
                             hosts, allow_list=False, reason=reason)
            texts += [found.text] if found is not None else []
        if isinstance(entry.get("patterns"), YSeq):
            for j, text in enumerate(entry["patterns"]):
                found = self.one(text, entry["patterns"].itempos[j], f"{where}.patterns[{j}]",
                                 hosts, allow_list=False, reason=reason)
                texts += [found.text] if found is not None else []
        return texts

    def pace_entry(self, entry: YMap, model: PaceEntryModel | None, i: int, label: str) -> None:
        """One entry of `pace`: its host patterns into a RuleSet of its own (the schema has
        checked the limits; `model` is None when it found a problem anywhere in the file)."""
        reason = entry.get("reason")
        reason = reason.strip() if isinstance(reason, str) else ""
        hosts = RuleSet(label)
        before = len(self.issues)
        texts = self.entry_hosts(entry, f"pace[{i}]", hosts, reason)
        if model is None or len(self.issues) != before or not texts:
            return
        self.pace.append(PaceEntry(
            tuple(texts), hosts, reason, unpack(entry.pos)[0], label,
            page_loads_per_minute=model.page_loads_per_minute, min_gap_s=model.min_gap_s,
            requests_per_minute=model.requests_per_minute, connections=model.connections,
            burst=model.burst, over=model.over, max_wait_s=model.max_wait_s))

    def one(self, text: Any, pos: int, field: str, rules: RuleSet | None, *, allow_list: bool,
            reason: str | None = None, networks_only: bool = False) -> Pattern | None:
        """One host pattern into `rules` (or the private networks); the parsed pattern, or None
        when it is not usable (the issue is recorded)."""
        if not isinstance(text, str):
            return None  # the schema reports wrong types
        try:
            pattern = parse_pattern(text, allow_list=allow_list)
        except PatternError as exc:
            self.issue(pos, field, f"{exc.message}: {_short(text)}", exc.hint)
            return None
        if networks_only:
            if pattern.kind not in ("ip", "cidr") or pattern.port is not None:
                self.issue(pos, field, f"only IP addresses and CIDR ranges go here: {_short(text)}",
                           "name hosts in allow_always; list address ranges here, e.g. 10.0.0.0/8")
                return None
            self.private.append(pattern.key if pattern.kind == "cidr" else str(pattern.network))
            self.private_lines.append(unpack(pos)[0])
            return pattern
        if rules is not None:
            rules.add(pattern, unpack(pos)[0], reason)
        return pattern


def _short(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:120] + "...")


# ---------------------------------------------------------------------------------------------
# Entry points

def default_policy_path() -> Path:
    """The policy shipped with sfguard: policy/sites.yaml."""
    return Path(__file__).resolve().parent / "sites.yaml"


def load_policy(path: str | os.PathLike[str] | None = None) -> SitePolicy:
    """Read and validate a policy file (default: the shipped one). Raises PolicyError."""
    file = Path(path) if path is not None else default_policy_path()
    source = str(file)
    try:
        size = file.stat().st_size
        if size > MAX_POLICY_BYTES:
            raise PolicyError([PolicyIssue(
                source, None, None, "(file)",
                f"the file is {size} bytes, over the {MAX_POLICY_BYTES // (1024 * 1024)} MiB limit",
                "split the block list or remove entries")])
        # Read in chunks: the cap holds even if the file grows after the stat (or is a pipe),
        # and no cap-sized buffer is allocated up front.
        chunks: list[bytes] = []
        total = 0
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 20):
                total += len(chunk)
                if total > MAX_POLICY_BYTES:
                    raise PolicyError([PolicyIssue(
                        source, None, None, "(file)",
                        f"the file is over the {MAX_POLICY_BYTES // (1024 * 1024)} MiB limit",
                        "split the block list or remove entries")])
                chunks.append(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise PolicyError([PolicyIssue(source, None, None, "(file)", f"cannot read the file: {exc.strerror or exc}",
                                       "check the path")]) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise PolicyError([PolicyIssue(source, line, col, "(file)", "the file is not UTF-8 text",
                                       "save it as UTF-8")]) from None
    return parse_policy(text, source)


def parse_policy(text: str, source: str = "sites.yaml") -> SitePolicy:
    """Validate policy text; `source` names it in errors and rules. Raises PolicyError."""
    if len(text) > MAX_POLICY_BYTES:
        raise PolicyError([PolicyIssue(source, None, None, "(file)",
                                       f"the policy is over the {MAX_POLICY_BYTES // (1024 * 1024)} MiB limit",
                                       "split the block list or remove entries")])
    # A big policy allocates millions of small objects at once; the cyclic garbage collector
    # would scan them again and again while they are built (it doubles the load time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse(text, source)
    finally:
        if gc_was_enabled:
            gc.enable()


def _parse(text: str, source: str) -> SitePolicy:
    composer = Composer(source)
    root = composer.compose(text)
    if root is None:
        raise PolicyError([PolicyIssue(source, 1, 1, "(file)", "the policy is empty",
                                       "start with version: 1 (see the shipped policy/sites.yaml)")])
    issues = list(composer.issues)
    model, errors = validate_at(PolicyFile, root, at_root(root), child)
    issues += [_schema_issue(err, at, source) for err, at, _ in errors]

    label = source.replace("\\", "/").rsplit("/", 1)[-1] or source
    build = _Builder(source, label)
    if isinstance(root, YMap):
        build.patterns(root.get("allow_always"), "allow_always", build.allow_always, allow_list=True)
        build.patterns(root.get("quiet"), "quiet", build.quiet, allow_list=False)
        block = root.get("block")
        if isinstance(block, YSeq):
            for i, entry in enumerate(block):
                if not isinstance(entry, YMap):
                    continue
                reason = entry.get("reason")
                reason = reason.strip() if isinstance(reason, str) else None
                if "pattern" in entry:
                    build.one(entry["pattern"], entry.valpos.get("pattern", entry.pos),
                              f"block[{i}].pattern", build.block, allow_list=False, reason=reason)
                if "patterns" in entry:
                    build.patterns(entry["patterns"], f"block[{i}].patterns", build.block,
                                   allow_list=False, reason=reason)
        writes = root.get("writes")
        if isinstance(writes, YSeq):
            for i, entry in enumerate(writes):
                if isinstance(entry, YMap):
                    build.write_entry(entry, i, label)
        recording = root.get("recording")
        if isinstance(recording, YSeq):
            for i, entry in enumerate(recording):
                if isinstance(entry, YMap):
                    build.recording_entry(entry, i, label)

        pace = root.get("pace")
        if isinstance(pace, YSeq):
            for i, entry in enumerate(pace):
                if isinstance(entry, YMap):
                    build.pace_entry(entry, model.pace[i] if model is not None else None, i, label)
        networks = root.get("private_networks")
        if isinstance(networks, YMap):
            build.patterns(networks.get("allow"), "private_networks.allow", None, allow_list=True,
                           networks_only=True)
    issues += build.issues
    if issues or model is None:
        issues.sort(key=lambda i: (i.line or 0, i.col or 0))
        more = build.more + max(0, len(issues) - MAX_ISSUES)
        raise PolicyError(issues[:MAX_ISSUES], more=more)

    site_policy = SitePolicy(source=source, mode=model.mode, ports=model.ports, tab_quota=model.tab_quota,
                             block=build.block, allow_always=build.allow_always, quiet=build.quiet,
                             private_networks=build.private, version=model.version,
                             private_lines=build.private_lines, writes=WriteRules(build.writes),
                             pace=PaceRules(build.pace))
    site_policy.recording = RecordingRules(build.recording)
    return site_policy
