"""Reading `sites.yaml`: YAML with line marks, the pydantic schema, and pattern checks.

The file is read in three steps, and every problem of every step is reported together, each at
file:line:col with the field and a hint:

1. YAML events (libyaml through PyYAML's C parser) are assembled into plain dicts, lists and
   scalars that remember where each key and item stood. Anchors, aliases and tags are refused
   (no YAML bombs, no object construction), as are duplicate keys. Scalars follow the YAML 1.2
   core schema (``yes``/``no``/``on``/``off`` stay text). Files over `MAX_POLICY_BYTES` are
   refused before parsing.
2. The structure is validated by strict pydantic models (unknown keys are errors; no type
   coercion: ``"443"`` is not a port). Error locations are mapped back to the marks of step 1
   by `policy.yamlpos`, which pipeline validation uses too.
3. Every pattern is parsed by `policy.patterns.parse_pattern` (a fast path handles plain names,
   which is what makes a million-entry block list load in seconds) straight into the rule index.

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
import re
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sfguard.policy.engine import DEFAULT_PORTS, SitePolicy
from sfguard.policy.errors import PolicyError, PolicyIssue
from sfguard.policy.patterns import PatternError, RuleSet, parse_pattern
from sfguard.policy.patterns import psl_tables as _psl_tables
from sfguard.policy.yamlpos import Loc, Mark, loc_path, mark_place, validate_at, yaml_error_mark

MAX_POLICY_BYTES = 64 * 1024 * 1024
MAX_ISSUES = 200
_COL_BITS = 20
_COL_MASK = (1 << _COL_BITS) - 1

_Loader: type[yaml.CSafeLoader | yaml.SafeLoader]
try:
    _Loader = yaml.CSafeLoader
except AttributeError:  # PyYAML without libyaml: slower, same results
    _Loader = yaml.SafeLoader


# ---------------------------------------------------------------------------------------------
# Step 1: YAML with positions

class YMap(dict[str, Any]):
    """A mapping that remembers where it, its keys and its values stood (packed positions)."""

    __slots__ = ("pos", "keypos", "valpos")
    pos: int
    keypos: dict[str, int]
    valpos: dict[str, int]


class YSeq(list[Any]):
    """A sequence that remembers where it and each item stood (packed positions)."""

    __slots__ = ("pos", "itempos")
    pos: int
    itempos: array[int]


def _pack(mark: Mark) -> int:
    return ((mark.line + 1) << _COL_BITS) | min(mark.column + 1, _COL_MASK)


def unpack(pos: int) -> tuple[int, int]:
    return pos >> _COL_BITS, pos & _COL_MASK


_INT_RE = re.compile(r"[-+]?[0-9]+|0x[0-9a-fA-F]+|0o[0-7]+")
_FLOAT_RE = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")
_SPECIAL_FIRST = set("0123456789+-.~nNtTfF")


def _resolve(value: str) -> Any:
    """A plain scalar under the YAML 1.2 core schema."""
    if not value or value[0] in _SPECIAL_FIRST:
        if value in ("", "~", "null", "Null", "NULL"):
            return None
        if value in ("true", "True", "TRUE"):
            return True
        if value in ("false", "False", "FALSE"):
            return False
        if _INT_RE.fullmatch(value):
            return int(value, 0) if value[:2] in ("0x", "0o") else int(value)
        if _FLOAT_RE.fullmatch(value):
            # YAML spells infinity and NaN ".inf" / ".nan", which Python's float() refuses
            if value.lstrip("+-")[1:].lower() in ("inf", "nan"):
                return float(value.replace(".", "", 1))
            return float(value)
    return value


class _Composer:
    def __init__(self, source: str):
        self.source = source
        self.issues: list[PolicyIssue] = []

    def fail(self, mark: Mark | None, field: str, message: str, hint: str | None = None) -> PolicyError:
        line, col = mark_place(mark)
        return PolicyError([PolicyIssue(self.source, line, col, field, message, hint)])

    def compose(self, text: str) -> Any:
        loader = _Loader(text)
        try:
            return self._run(loader)
        except yaml.MarkedYAMLError as exc:
            raise _yaml_error(exc, self.source, text) from None
        except yaml.reader.ReaderError as exc:
            char = exc.character if isinstance(exc.character, int) else ord(exc.character or "\0")
            line = text.count("\n", 0, exc.position) + 1
            col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
            raise PolicyError([PolicyIssue(
                self.source, line, col, "(yaml)",
                f"character U+{char:04X} is not allowed in YAML",
                "remove control characters from the file")]) from None
        except yaml.YAMLError as exc:
            raise PolicyError([PolicyIssue(self.source, None, None, "(yaml)", f"not valid YAML: {exc}",
                                           None)]) from None
        finally:
            loader.dispose()

    def _run(self, loader: yaml.CSafeLoader | yaml.SafeLoader) -> Any:
        # Events are told apart by class identity (faster than isinstance on millions of
        # events), which a type checker cannot narrow: an event is Any here.
        get: Callable[[], Any] = loader.get_event
        ScalarEvent, AliasEvent = yaml.ScalarEvent, yaml.AliasEvent
        MappingStartEvent, SequenceStartEvent = yaml.MappingStartEvent, yaml.SequenceStartEvent
        MappingEndEvent, SequenceEndEvent = yaml.MappingEndEvent, yaml.SequenceEndEvent
        DocumentStartEvent, StreamEndEvent = yaml.DocumentStartEvent, yaml.StreamEndEvent
        root: Any = None
        documents = 0
        # Each frame: [container, pending key or _NOKEY, field path text]
        stack: list[list[Any]] = []
        nokey = _NOKEY
        resolve = _resolve
        while True:
            ev = get()
            cls = ev.__class__
            if cls is ScalarEvent:
                if ev.anchor is not None or ev.tag is not None:
                    self._refuse_anchor_or_tag(ev)
                value = resolve(ev.value) if not ev.style and ev.implicit[0] else ev.value
                if not stack:
                    root = value
                    continue
                frame = stack[-1]
                node = frame[0]
                if node.__class__ is YSeq:
                    node.append(value)
                    mark = ev.start_mark
                    node.itempos.append(((mark.line + 1) << _COL_BITS) | min(mark.column + 1, _COL_MASK))
                elif frame[1] is nokey:
                    self._key(frame, value, ev.start_mark)
                else:
                    key = frame[1]
                    node[key] = value
                    node.valpos[key] = _pack(ev.start_mark)
                    frame[1] = nokey
            elif cls is MappingStartEvent or cls is SequenceStartEvent:
                if ev.anchor is not None or ev.tag is not None:
                    self._refuse_anchor_or_tag(ev)
                if cls is MappingStartEvent:
                    node = YMap()
                    node.keypos, node.valpos = {}, {}
                else:
                    node = YSeq()
                    node.itempos = array("q")
                node.pos = _pack(ev.start_mark)
                if stack:
                    frame = stack[-1]
                    parent = frame[0]
                    if parent.__class__ is YSeq:
                        parent.append(node)
                        parent.itempos.append(node.pos)
                    elif frame[1] is nokey:
                        raise self.fail(ev.start_mark, "(yaml)", "a key must be a plain name",
                                        "write key: value")
                    else:
                        parent[frame[1]] = node
                        parent.valpos[frame[1]] = node.pos
                        frame[1] = nokey
                else:
                    root = node
                stack.append([node, nokey])
            elif cls is MappingEndEvent or cls is SequenceEndEvent:
                stack.pop()
            elif cls is AliasEvent:
                raise self.fail(ev.start_mark, "(yaml)", "YAML aliases (*name) are not allowed",
                                "write every value out; aliases and anchors are refused")
            elif cls is DocumentStartEvent:
                documents += 1
                if documents > 1:
                    raise self.fail(ev.start_mark, "(document)", "more than one YAML document",
                                    "keep one document: remove the '---' line")
            elif cls is StreamEndEvent:
                return root

    def _key(self, frame: list[Any], key: Any, mark: Mark) -> None:
        node: YMap = frame[0]
        if not isinstance(key, str):
            raise self.fail(mark, "(key)", f"a key must be a name, not {key!r}", "write key: value")
        if key in node:
            line, col = unpack(node.keypos[key])
            self.issues.append(PolicyIssue(self.source, mark.line + 1, mark.column + 1, key,
                                           f"duplicate key '{key}' (first at line {line})",
                                           "keep one of them"))
        node.keypos[key] = _pack(mark)
        frame[1] = key

    def _refuse_anchor_or_tag(self, ev: yaml.ScalarEvent | yaml.CollectionStartEvent) -> None:
        if ev.anchor is not None:
            raise self.fail(ev.start_mark, "(yaml)", f"YAML anchors (&{ev.anchor}) are not allowed",
                            "write every value out; anchors and aliases are refused")
        raise self.fail(ev.start_mark, "(yaml)", f"YAML tags ({ev.tag}) are not allowed",
                        "remove the tag and write a plain value")


_NOKEY = object()


def _yaml_error(exc: yaml.MarkedYAMLError, source: str, text: str) -> PolicyError:
    mark = yaml_error_mark(exc)
    problem = exc.problem or "syntax error"
    context = exc.context or ""
    hint = "check the indentation and the ':' after each key"
    at = text[mark.index] if mark is not None and 0 <= mark.index < len(text) else ""
    if at == "\t":
        hint = "indent with spaces, not tabs"
    elif "flow" in context:
        hint = ('close each [ ] and { }, and quote values that start with [ or {, '
                'e.g. "[::1]:8080"')
    if "alias" in context:
        hint = 'a pattern that starts with * must be quoted: "*.example.com"'
        problem = "an unquoted * starts a YAML alias"
        mark = exc.context_mark or mark
    elif "tab" in problem:
        hint = "indent with spaces, not tabs"
    elif "special characters" in problem or "control" in problem:
        hint = "remove control characters from the file"
    if context and exc.context_mark is not None and exc.context_mark is not mark:
        context += f" (started at line {exc.context_mark.line + 1})"
    message = f"not valid YAML: {context + ': ' if context else ''}{problem}"
    line, col = mark_place(mark)
    return PolicyError([PolicyIssue(source, line, col, "(yaml)", message, hint)])


# ---------------------------------------------------------------------------------------------
# Step 2: the schema

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BlockEntry(_Strict):
    """One block rule (`pattern`), or a group of patterns sharing one reason (`patterns`)."""

    pattern: str | None = None
    patterns: list[str] | None = None
    reason: str

    @model_validator(mode="after")
    def _one_of(self) -> BlockEntry:
        if (self.pattern is None) == (self.patterns is None):
            raise ValueError("give either 'pattern' or 'patterns'")
        if not self.reason.strip():
            raise ValueError("the reason is empty")
        return self


class PrivateNetworks(_Strict):
    allow: list[str] = []


Port = Annotated[int, Field(ge=1, le=65535)]


class PolicyFile(_Strict):
    """The shape of sites.yaml, version 1."""

    version: Literal[1]
    mode: Literal["enforce", "report"] = "enforce"
    ports: list[Port] = Field(default_factory=lambda: sorted(DEFAULT_PORTS), min_length=1)
    tab_quota: int = Field(default=8, ge=1, le=1000)
    allow_always: list[str] = []
    block: list[BlockEntry] = []
    quiet: list[str] = []
    private_networks: PrivateNetworks = PrivateNetworks()


_KEYS: dict[tuple[str, ...], list[str]] = {
    (): list(PolicyFile.model_fields),
    ("block",): list(BlockEntry.model_fields),
    ("private_networks",): list(PrivateNetworks.model_fields),
}


def _field_text(loc: Loc) -> str:
    return loc_path(loc) or "(top level)"


def _child(at: tuple[Any, int], part: str | int, want_key: bool) -> tuple[Any, int] | None:
    """One step into the composed tree for `yamlpos`: (node, packed position) pairs."""
    node = at[0]
    if isinstance(node, YMap) and isinstance(part, str) and part in node:
        pos = node.keypos[part] if want_key else node.valpos.get(part, node.keypos[part])
        return node[part], pos
    if isinstance(node, YSeq) and isinstance(part, int) and 0 <= part < len(node):
        return node[part], node.itempos[part]
    return None


def _root(root: Any) -> tuple[Any, int]:
    return root, getattr(root, "pos", (1 << _COL_BITS) | 1)


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
        allowed = _KEYS.get(tuple(p for p in loc[:-1] if isinstance(p, str)), [])
        msg = f"unknown key '{key}'"
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed keys here: {', '.join(allowed)}"
    elif kind == "missing":
        msg = f"'{name}' is required"
        hint = {"version": "start the file with: version: 1",
                "reason": ('every block entry needs a reason a reviewer can read, '
                           'e.g. reason: "terms forbid automation"'),
                }.get(name)
        field = _field_text(loc)
    elif kind == "literal_error":
        hint = {"mode": "write mode: enforce (deny) or mode: report (log would_deny, allow)",
                "version": "this sfguard reads version: 1"}.get(name, None)
        msg = f"{msg}, got {err.get('input')!r}"
    elif kind in ("greater_than_equal", "less_than_equal"):
        msg = f"{msg}, got {err.get('input')!r}"
        hint = "ports are 1-65535" if "ports" in shape else None
        if name == "tab_quota":
            hint = "tab_quota is a whole number from 1 to 1000"
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
    return PolicyIssue(source, line, col, field, msg, hint)


# ---------------------------------------------------------------------------------------------
# Step 3: patterns, straight into the index

# Plain lower-case ASCII names (optionally "*."-prefixed) whose last label is not a number and
# that hold no punycode: already canonical, so they skip `parse_pattern`. Everything else takes
# the full path.
_FAST_PATTERN = re.compile(
    r"(\*\.)?((?:[a-z0-9_-]{1,63}\.)+(?!0x)(?![0-9]+\Z)[a-z0-9_-]{1,63})").fullmatch


class _Builder:
    def __init__(self, source: str, label: str):
        self.source = source
        self.issues: list[PolicyIssue] = []
        self.more = 0
        self.block = RuleSet(label)
        self.allow_always = RuleSet(label)
        self.quiet = RuleSet(label)
        self.private: list[str] = []

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
            rid = rules.reason_id(reason) if reason is not None else -1
            exact, wild, depth = rules._exact, rules._wild, rules._depth
            lines, reasons = rules._lines, rules._reason_ix
            add_line, add_reason = lines.append, reasons.append
            fast = _FAST_PATTERN
            psl_exact, psl_wild = _psl_tables()
            added = 0
            next_id = len(lines)
            slow: list[int] = []
            for i, text in enumerate(seq):
                if (text.__class__ is str and len(text) <= 253 and fast(text) is not None
                        and "xn--" not in text):
                    if text[0] != "*":
                        table, key = exact, text
                    else:
                        key = text[2:]
                        if key in psl_exact or key.partition(".")[2] in psl_wild:
                            slow.append(i)
                            continue
                        table = wild
                        labels = key.count(".") + 1
                        if labels < depth[0]:
                            depth[0] = labels
                        if labels > depth[1]:
                            depth[1] = labels
                    if key not in table:
                        table[key] = next_id
                        next_id += 1
                        add_line(positions[i] >> _COL_BITS)
                        add_reason(rid)
                        added += 1
                    continue
                slow.append(i)
            rules._count += added
            for i in slow:
                self.one(seq[i], positions[i], f"{field}[{i}]", rules, allow_list=allow_list, reason=reason)
            return
        for i, text in enumerate(seq):
            self.one(text, positions[i], f"{field}[{i}]", rules, allow_list=allow_list,
                     reason=reason, networks_only=networks_only)

    def one(self, text: Any, pos: int, field: str, rules: RuleSet | None, *, allow_list: bool,
            reason: str | None = None, networks_only: bool = False) -> None:
        if not isinstance(text, str):
            return  # the schema reports wrong types
        try:
            pattern = parse_pattern(text, allow_list=allow_list)
        except PatternError as exc:
            self.issue(pos, field, f"{exc.message}: {_short(text)}", exc.hint)
            return
        if networks_only:
            if pattern.kind not in ("ip", "cidr") or pattern.port is not None:
                self.issue(pos, field, f"only IP addresses and CIDR ranges go here: {_short(text)}",
                           "name hosts in allow_always; list address ranges here, e.g. 10.0.0.0/8")
                return
            self.private.append(pattern.key if pattern.kind == "cidr" else str(pattern.network))
            return
        if rules is not None:
            rules.add(pattern, unpack(pos)[0], reason)


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
    composer = _Composer(source)
    root = composer.compose(text)
    if root is None:
        raise PolicyError([PolicyIssue(source, 1, 1, "(file)", "the policy is empty",
                                       "start with version: 1 (see the shipped policy/sites.yaml)")])
    issues = list(composer.issues)
    model, errors = validate_at(PolicyFile, root, _root(root), _child)
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
        networks = root.get("private_networks")
        if isinstance(networks, YMap):
            build.patterns(networks.get("allow"), "private_networks.allow", None, allow_list=True,
                           networks_only=True)
    issues += build.issues
    if issues or model is None:
        issues.sort(key=lambda i: (i.line or 0, i.col or 0))
        more = build.more + max(0, len(issues) - MAX_ISSUES)
        raise PolicyError(issues[:MAX_ISSUES], more=more)

    return SitePolicy(source=source, mode=model.mode, ports=model.ports, tab_quota=model.tab_quota,
                      block=build.block, allow_always=build.allow_always, quiet=build.quiet,
                      private_networks=build.private, version=model.version)
