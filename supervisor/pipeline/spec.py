"""Pipeline validation (`sfguard validate PIPELINE.yaml`): find browser mistakes before a run.

The pipeline shape read here is Stageflow-like::

    name: login-example                 # optional
    description: ...                    # optional
    stages:
      - id: check                       # required, unique, ^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$
        file: stages/check.yaml         # optional stage file (relative, inside the pipeline's
                                        # folder); keys of the entry override the file's keys
        prompt: ...                     # the stage's own fields are not judged here
        browser:                        # the spec's browser field (sfguard.supervisor.daemon.models.BrowserField)
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
* every invalid `browser` field, validated by `sfguard.supervisor.daemon.models.BrowserField`, the same model
  the control API uses, so a file and an API request are judged alike; every bad
  `allow_domains` entry, every login-check URL pattern that does not compile;
* `allow_domains` patterns the site policy blocks anyway (`blocked_by_policy`), and a login
  check page that the run's own allow list would not let through the proxy;
* routes to unknown stages, `on_verify_fail` to an unknown stage, `verify: login_check`
  without a login check;
* a login-stage topology that skips the work stage silently (see `_check_login_topology`);
* a missing agent-browser or browser on this machine when any stage has a browser.

`validate_pipeline` returns a `PipelineReport`; it never raises for a bad pipeline.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel

from sfguard import policy
from sfguard.policy.yamlpos import loc_path, locate, mark_place, validate_at, yaml_error_mark
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.handoff import HandoffPayload
from sfguard.supervisor.daemon.models import STAGE_ID, BrowserField, error_message

__all__ = ["Issue", "PipelineReport", "Route", "StageInfo", "validate_pipeline",
           "PIPELINE_KEYS", "STAGE_KEYS", "STAGE_FILE_KEYS", "MAX_PIPELINE_BYTES"]

MAX_PIPELINE_BYTES = 1024 * 1024
PIPELINE_KEYS = ("name", "description", "version", "stages")
STAGE_KEYS = ("id", "name", "description", "file", "prompt", "skill", "skills", "mcp", "requires",
              "browser", "next", "gate", "verify", "on_verify_fail", "io", "timeout", "retries",
              "replay_safe", "agent", "model")
#: A stage file holds a stage's fields; its id and routes belong to the pipeline.
STAGE_FILE_KEYS = tuple(k for k in STAGE_KEYS if k not in ("id", "file", "next"))
ROUTE_KEYS = ("to", "if")
VERIFY_VALUES = ("login_check",)
_COND = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(eq|ne|==|!=)\s*(\S+)\s*$")
_STAGE_ID = re.compile(STAGE_ID)


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Issue:
    """One finding. `code` is stable (for tests and tools); str() is the line users read."""
    file: str
    line: int | None
    col: int | None
    path: str
    message: str
    code: str
    severity: str = "error"          # "error" | "warning"

    def __str__(self) -> str:
        where = self.file + (f":{self.line}" if self.line else "") + (f":{self.col}" if self.col else "")
        text = self.message if self.severity == "error" else f"warning: {self.message}"
        return f"{where}: {self.path}: {text}"


@dataclass(frozen=True)
class Route:
    source: str
    target: str
    cond: str | None


@dataclass
class StageInfo:
    """A stage as validated: its effective browser field (None when absent or invalid)."""
    id: str
    index: int
    browser: BrowserField | None = None
    has_browser: bool = False
    routes: list[Route] = field(default_factory=list)
    gate: Any = None
    verify: str | None = None
    on_verify_fail: str | None = None
    node: Any = field(default=None, repr=False, compare=False)   # the stage's YAML node


@dataclass
class PipelineReport:
    file: str
    issues: list[Issue] = field(default_factory=list)
    stages: list[StageInfo] = field(default_factory=list)

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == "error"]

    @property
    def warnings(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors


# --------------------------------------------------------------------------- YAML with marks

class _Doc:
    """One YAML file: its display name, root node and a constructor for sub-nodes."""

    def __init__(self, display: str, text: str):
        self.display = display
        self._loader = yaml.SafeLoader(text)
        self.root = self._loader.get_single_node()

    def value(self, node: yaml.Node) -> Any:
        return self._loader.construct_object(node, deep=True)

    def close(self) -> None:
        self._loader.dispose()

    def child(self, node: yaml.Node, part: str | int, want_key: bool) -> yaml.Node | None:
        """One step along a pydantic error location (for `policy.yamlpos`); the last of
        duplicate keys wins, as in the value pydantic saw."""
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            found = None
            for key, k, v in self.items(node):
                if key == part:
                    found = k if want_key else v
            return found
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            return node.value[part]
        return None

    def items(self, node: yaml.MappingNode) -> list[tuple[Any, yaml.Node, yaml.Node]]:
        """(key, key node, value node) of a mapping, merge keys (`<<`) applied."""
        self._loader.flatten_mapping(node)
        out = []
        for k, v in node.value:
            try:
                key = self.value(k)
            except yaml.YAMLError:
                key = None
            out.append((key, k, v))
        return out


def _mark(node: yaml.Node | None) -> tuple[int | None, int | None]:
    return mark_place(node.start_mark if node is not None else None)


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return "a scalar"


class _Validator:
    def __init__(self, pipeline: Path, display: str, site_policy: policy.SitePolicy | None,
                 check_tools: bool, find_tools: Callable[[], Iterable[tools.Tool]]):
        self.pipeline = pipeline
        self.report = PipelineReport(display)
        self.site_policy = site_policy
        self.check_tools = check_tools
        self.find_tools = find_tools
        self.first_browser: tuple[_Doc, yaml.Node, str] | None = None
        self.verify_nodes: dict[str, tuple[_Doc, yaml.Node]] = {}

    # ---- issue helpers

    def issue(self, doc: _Doc, node: yaml.Node | None, path: str, message: str, code: str,
              severity: str = "error") -> None:
        line, col = _mark(node)
        self.report.issues.append(Issue(doc.display, line, col, path, message, code, severity))

    def yaml_issue(self, display: str, exc: yaml.MarkedYAMLError) -> None:
        line, col = mark_place(yaml_error_mark(exc))
        problem = "; ".join(str(p) for p in (exc.context, exc.problem) if p)
        self.report.issues.append(Issue(display, line, col, "(yaml)", f"not valid YAML: {problem}", "yaml"))

    def model_issues(self, doc: _Doc, model: type[BaseModel], value: Any, node: yaml.Node,
                     path: str, code: str, skip: Callable[[dict], bool] = lambda err: False) -> Any:
        """Validate `value` (read at `node`) with `model`; each error becomes an issue at the
        place it points to. Returns the model, or None when the value is not valid."""
        result, errors = validate_at(model, value, node, doc.child)
        for err, enode, depth in errors:
            if not skip(err):
                self.issue(doc, enode, _error_path(path, tuple(err["loc"]), enode, depth),
                           error_message(err, model), code)
        return result

    def mapping(self, doc: _Doc, node: yaml.Node, path: str, known: tuple[str, ...],
                what: str) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """Check `node` is a mapping with only `known` string keys and no duplicates; return
        key -> (key node, value node) of the known keys."""
        if not isinstance(node, yaml.MappingNode):
            self.issue(doc, node, path or "(top)", f"{what} must be a mapping, not {_kind(node)}"
                       + (" (hint: the file starts with keys such as name: and stages:)"
                          if not path and what == "the pipeline" else ""), "shape")
            return None
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key, knode, vnode in doc.items(node):
            kpath = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.issue(doc, knode, path or "(top)", f"keys must be text, not {key!r}", "shape")
                continue
            if key in out:
                first, _ = _mark(out[key][0])
                self.issue(doc, knode, kpath, f"duplicate key {key!r} (first at line {first}); "
                           "YAML would silently keep only the last one", "duplicate_key")
                continue
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
                self.issue(doc, knode, kpath, f"unknown key {key!r} in {what} ({hint})", "unknown_key")
                continue
            out[key] = (knode, vnode)
        return out

    # ---- entry point

    def run(self, text: str) -> PipelineReport:
        try:
            doc = _Doc(self.report.file, text)
        except yaml.MarkedYAMLError as exc:
            self.yaml_issue(self.report.file, exc)
            return self.report
        except yaml.YAMLError as exc:
            self.report.issues.append(Issue(self.report.file, None, None, "(yaml)",
                                            f"not valid YAML: {exc}", "yaml"))
            return self.report
        try:
            self._pipeline(doc)
        finally:
            doc.close()
        self._sort()
        return self.report

    def _sort(self) -> None:
        """Findings in reading order: the pipeline file first, then each stage file, each by
        line and column (stable, so findings at one place keep the order they were found)."""
        files = [self.report.file] + sorted({i.file for i in self.report.issues} - {self.report.file})
        order = {f: n for n, f in enumerate(files)}
        self.report.issues.sort(key=lambda i: (order[i.file], i.line or 0, i.col or 0))

    def _pipeline(self, doc: _Doc) -> None:
        root = doc.root
        if root is None:
            self.issue(doc, None, "(top)", "the pipeline file is empty", "shape")
            return
        top = self.mapping(doc, root, "", PIPELINE_KEYS, "the pipeline")
        if top is None:
            return
        if "stages" not in top:
            self.issue(doc, root, "stages", "missing required key 'stages' (a list of stages)", "shape")
            return
        snode = top["stages"][1]
        if not isinstance(snode, yaml.SequenceNode) or not snode.value:
            self.issue(doc, snode, "stages", "stages must be a non-empty list (hint: write "
                       "stages: followed by lines such as - id: check)", "shape")
            return
        seen: dict[str, yaml.Node] = {}
        route_nodes: dict[Route, tuple[_Doc, yaml.Node, str]] = {}
        for i, node in enumerate(snode.value):
            info = self._stage(doc, node, i, route_nodes)
            if info is None:
                continue
            if info.id in seen:
                line, _ = _mark(seen[info.id])
                self.issue(doc, node, f"stages[{i}].id",
                           f"duplicate stage id {info.id!r} (first at line {line})", "duplicate_stage")
                continue
            seen[info.id] = node
            self.report.stages.append(info)
        stages = {s.id: s for s in self.report.stages}
        for route, (rdoc, rnode, rpath) in route_nodes.items():
            if route.target not in stages and route.target not in seen:
                self.issue(rdoc, rnode, rpath, f"route to unknown stage {route.target!r}"
                           + _suggest(route.target, stages), "unknown_stage")
        for s in self.report.stages:
            if s.on_verify_fail is not None and s.on_verify_fail not in stages:
                vdoc, node = self.verify_nodes[s.id]
                self.issue(vdoc, node, f"stages[{s.index}].on_verify_fail",
                           f"unknown stage {s.on_verify_fail!r}" + _suggest(s.on_verify_fail, stages),
                           "unknown_stage")
        self._check_login_topology(doc, stages, route_nodes)
        self._check_tools()

    # ---- one stage

    def _stage(self, doc: _Doc, node: yaml.Node, i: int,
               route_nodes: dict[Route, tuple[_Doc, yaml.Node, str]]) -> StageInfo | None:
        path = f"stages[{i}]"
        entry = self.mapping(doc, node, path, STAGE_KEYS, "a stage")
        if entry is None:
            return None
        if "id" not in entry:
            self.issue(doc, node, f"{path}.id", "missing required key 'id'", "shape")
            return None
        sid = doc.value(entry["id"][1])
        if not isinstance(sid, str) or not _STAGE_ID.fullmatch(sid):
            self.issue(doc, entry["id"][1], f"{path}.id",
                       f"stage id {sid!r} is not valid (1-128 of A-Z a-z 0-9 . _ : - , starting "
                       "with a letter or digit)", "shape")
            return None
        info = StageInfo(id=sid, index=i, node=node)

        # Effective fields: the stage file's, overridden key by key by the entry's.
        fields: dict[str, tuple[_Doc, yaml.Node, str]] = {}
        keys: dict[str, yaml.Node] = {}
        if "file" in entry:
            fdoc = self._stage_file(doc, entry["file"][1], f"{path}.file")
            if fdoc is not None:
                try:
                    if fdoc.root is not None:
                        fmap = self.mapping(fdoc, fdoc.root, "", STAGE_FILE_KEYS, "a stage file")
                        for key, (k, v) in (fmap or {}).items():
                            fields[key] = (fdoc, v, key)
                            keys[key] = k
                    self._stage_fields(info, fields, keys, route_nodes, entry, doc, path)
                finally:
                    fdoc.close()
                return info
        self._stage_fields(info, fields, keys, route_nodes, entry, doc, path)
        return info

    def _stage_fields(self, info: StageInfo, fields: dict[str, tuple[_Doc, yaml.Node, str]],
                      keys: dict[str, yaml.Node], route_nodes, entry, doc: _Doc, path: str) -> None:
        for key, (k, v) in entry.items():
            if key not in ("id", "file"):
                fields[key] = (doc, v, f"{path}.{key}")
                keys[key] = k
        if "browser" in fields:
            info.has_browser = True
            bdoc, bnode, bpath = fields["browser"]
            if self.first_browser is None:
                self.first_browser = (bdoc, keys["browser"], bpath)
            info.browser = self._browser(bdoc, bnode, bpath)
        if "next" in fields:
            ndoc, nnode, npath = fields["next"]
            for route, rnode, rpath in self._routes(ndoc, nnode, npath, info.id):
                info.routes.append(route)
                route_nodes[route] = (ndoc, rnode, rpath)
        if "gate" in fields:
            gdoc, gnode, gpath = fields["gate"]
            info.gate = gnode
            self._gate(gdoc, gnode, gpath)
        if "verify" in fields:
            vdoc, vnode, vpath = fields["verify"]
            value = vdoc.value(vnode)
            if value not in VERIFY_VALUES:
                self.issue(vdoc, vnode, vpath, f"unknown verify {value!r} (known: "
                           f"{', '.join(VERIFY_VALUES)})", "shape")
            else:
                info.verify = value
                if info.browser is not None and info.browser.login_check is None:
                    self.issue(vdoc, vnode, vpath, "verify: login_check needs browser.login_check "
                               "on this stage (the check to run again)", "verify_without_check")
                elif not info.has_browser:
                    self.issue(vdoc, vnode, vpath, "verify: login_check needs a browser field with "
                               "a login_check on this stage", "verify_without_check")
        if "on_verify_fail" in fields:
            odoc, onode, opath = fields["on_verify_fail"]
            value = odoc.value(onode)
            if not isinstance(value, str):
                self.issue(odoc, onode, opath, "on_verify_fail must be a stage id", "shape")
            else:
                info.on_verify_fail = value
                self.verify_nodes[info.id] = (odoc, onode)
                if "verify" not in fields:
                    self.issue(odoc, onode, opath, "on_verify_fail has no effect without verify",
                               "shape", "warning")

    def _stage_file(self, doc: _Doc, node: yaml.Node, path: str) -> _Doc | None:
        rel = doc.value(node)
        if not isinstance(rel, str) or not rel:
            self.issue(doc, node, path, "file must be a relative path to a stage file", "shape")
            return None
        base = self.pipeline.parent.resolve()
        target = (base / rel).resolve()
        if Path(rel).is_absolute() or (target != base and base not in target.parents):
            self.issue(doc, node, path, f"stage file {rel!r} must be a relative path inside the "
                       "pipeline's folder", "stage_file")
            return None
        display = str(Path(self.report.file).parent / rel)
        try:
            data = target.read_bytes()
        except OSError as exc:
            self.issue(doc, node, path, f"cannot read stage file {rel!r}: {exc.strerror}", "stage_file")
            return None
        if len(data) > MAX_PIPELINE_BYTES:
            self.issue(doc, node, path, f"stage file {rel!r} is larger than 1 MiB", "stage_file")
            return None
        try:
            return _Doc(display, data.decode("utf-8"))
        except UnicodeDecodeError:
            self.issue(doc, node, path, f"stage file {rel!r} is not UTF-8 text", "stage_file")
        except yaml.MarkedYAMLError as exc:
            self.yaml_issue(display, exc)
        return None

    # ---- browser field

    def _browser(self, doc: _Doc, node: yaml.Node, path: str) -> BrowserField | None:
        if not isinstance(node, yaml.MappingNode):
            self.issue(doc, node, path, f"browser must be a mapping, not {_kind(node)}", "browser")
            return None
        # Duplicate keys and merge keys first (pydantic would only see the last value).
        before = len(self.report.issues)
        self.mapping(doc, node, path, tuple(BrowserField.model_fields), "the browser field")
        dup_or_unknown = len(self.report.issues) > before
        # unknown keys are worded by the model's errors below, as the API words them
        self.report.issues[before:] = [i for i in self.report.issues[before:] if i.code != "unknown_key"]
        value = doc.value(node)
        # a bad allow_domains entry is reported below, each at its own line
        result: BrowserField | None = self.model_issues(
            doc, BrowserField, value, node, path, "browser",
            skip=lambda err: len(err["loc"]) == 2 and err["loc"][0] == "allow_domains"
            and err["type"] == "value_error")
        if dup_or_unknown:
            result = None
        domains = value.get("allow_domains") if isinstance(value, dict) else None
        if isinstance(domains, list):
            self._allow_domains(doc, node, path, domains)
        if result is not None and result.login_check is not None:
            self._check_url_reachable(doc, node, path, result)
        return result

    def _allow_domains(self, doc: _Doc, node: yaml.Node, path: str, domains: list) -> None:
        for j, text in enumerate(domains):
            enode, epath = _locate(doc, node, path, ("allow_domains", j))
            try:
                pat = policy.parse_pattern(text, allow_list=True)
            except policy.PatternError as exc:
                self.issue(doc, enode, epath, f"{exc.message}: {text!r}"
                           + (f" (hint: {exc.hint})" if exc.hint else ""), "browser")
                continue
            if self.site_policy is None:
                continue
            host = pat.key if pat.kind in ("name", "wild") else str(pat.network.network_address) \
                if pat.kind == "cidr" else pat.key
            d = self.site_policy.decide(host, pat.port or 443, policy.compile_patterns([text]))
            if d.reason.endswith("blocked_by_policy"):
                severity = "warning" if d.reason.startswith("would_deny") else "error"
                self.issue(doc, enode, epath,
                           f"{text!r} is blocked by the site policy ({d.rule}): the proxy will deny "
                           f"it whatever the pipeline says [blocked_by_policy]", "blocked_by_policy",
                           severity)

    def _check_url_reachable(self, doc: _Doc, node: yaml.Node, path: str, b: BrowserField) -> None:
        """The check page is opened in the anchor, through the run's proxy: its host must be
        allowed by the stage's allow_domains (or the policy's allow_always)."""
        if self.site_policy is None:
            return
        parts = urlsplit(b.login_check.url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return
        allow = policy.compile_patterns(b.allow_domains)
        d = self.site_policy.decide(parts.hostname or "", port, allow)
        if not d.allowed or d.reason.startswith("would_deny"):
            enode, epath = _locate(doc, node, path, ("login_check", "url"))
            self.issue(doc, enode, epath,
                       f"the proxy would deny the check page ({d.reason}): add "
                       f"{policy.join_host_port(parts.hostname or '', parts.port)!r} to allow_domains",
                       "check_url_denied")

    # ---- routes and gates

    def _routes(self, doc: _Doc, node: yaml.Node, path: str, source: str):
        if isinstance(node, yaml.ScalarNode):
            value = doc.value(node)
            if isinstance(value, str) and value:
                yield Route(source, value, None), node, path
            else:
                self.issue(doc, node, path, "next must be a stage id or a list of routes", "shape")
            return
        if not isinstance(node, yaml.SequenceNode):
            self.issue(doc, node, path, "next must be a stage id or a list of routes", "shape")
            return
        for j, item in enumerate(node.value):
            ipath = f"{path}[{j}]"
            if isinstance(item, yaml.ScalarNode):
                value = doc.value(item)
                if isinstance(value, str) and value:
                    yield Route(source, value, None), item, ipath
                else:
                    self.issue(doc, item, ipath, "a route is a stage id or {to: ID, if: CONDITION}", "shape")
                continue
            m = self.mapping(doc, item, ipath, ROUTE_KEYS, "a route")
            if m is None:
                continue
            if "to" not in m:
                self.issue(doc, item, ipath, "a route needs 'to' (the next stage id)", "shape")
                continue
            target = doc.value(m["to"][1])
            cond = doc.value(m["if"][1]) if "if" in m else None
            if not isinstance(target, str) or not target:
                self.issue(doc, m["to"][1], f"{ipath}.to", "to must be a stage id", "shape")
                continue
            if cond is not None and not (isinstance(cond, str) and cond.strip()):
                self.issue(doc, m["if"][1], f"{ipath}.if", "if must be a condition such as "
                           "'logged_in eq false'", "shape")
                continue
            yield Route(source, target, cond), item, ipath

    def _gate(self, doc: _Doc, node: yaml.Node, path: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            self.issue(doc, node, path, f"gate must be a mapping, not {_kind(node)}", "shape")
            return
        for key, _k, v in doc.items(node):
            if key != "handoff":
                continue
            self.model_issues(doc, HandoffPayload, doc.value(v), v, f"{path}.handoff", "handoff")

    # ---- login topology

    def _check_login_topology(self, doc: _Doc, stages: dict[str, StageInfo],
                              route_nodes: dict[Route, tuple[_Doc, yaml.Node, str]]) -> None:
        """The canonical check -> login -> work pattern (spec, verification 5, "Join topology").

        Stageflow runs a join (a stage with several inbound routes) whose parents all succeeded
        only if EVERY inbound `if` fired; a skipped parent does not block it. So, with check C,
        login L (C -> L carries `if: logged_in eq false`) and work W:

        * Topology A (right): C -> L (if), C -> W (no if), L -> W (no if). Logged in: L is
          skipped, W runs after C. Logged out: L runs, W waits for it (a join), then runs.
        * Topology B (wrong): C -> W also has `if: logged_in eq true`. Logged out: C and L
          succeed but the C -> W `if` did not fire, so W is skipped, and the run still reports
          success. Reported as `login_topology_join_gated`, on every `if` into such a join.
        * W not routed from L: W starts right after C, without waiting for the login
          (`login_topology_no_wait`); or, if C -> W is conditional, W never runs after a login
          (`login_topology_dead_end`).
        * C routes only to L: when logged in, L is skipped and nothing runs after the check
          (`login_topology_no_work`).
        """
        for c in stages.values():
            if c.browser is None or c.browser.login_check is None:
                continue
            gated = [r for r in c.routes if r.cond and _cond_field(r.cond) == "logged_in"]
            if not gated:
                continue
            login_ids = [r.target for r in gated if _fires_when_logged_out(r.cond)]
            logins = [stages[t] for t in dict.fromkeys(login_ids) if t in stages]
            work_routes = [r for r in c.routes if r.target not in login_ids]
            for login in logins:
                l_targets = {r.target: r for r in login.routes}
                if not work_routes and login.routes:
                    rdoc, rnode, rpath = route_nodes[next(r for r in gated if r.target == login.id)]
                    self.issue(rdoc, rnode, rpath,
                               f"stage {c.id!r} routes only to the login stage {login.id!r}: when the "
                               f"profile is logged in, {login.id!r} is skipped and nothing after it "
                               f"runs; add a route {c.id} -> {next(iter(l_targets))} with no if "
                               "(topology A)", "login_topology_no_work")
                for w in work_routes:
                    rdoc, rnode, rpath = route_nodes[w]
                    if w.target in l_targets:
                        if w.cond:
                            self.issue(rdoc, rnode, rpath,
                                       f"route {c.id} -> {w.target} must have no if: {w.target!r} "
                                       f"is a join of {c.id!r} and the login stage {login.id!r}, and "
                                       f"after a login this if is false, so Stageflow would skip "
                                       f"{w.target!r} silently (topology B); only {c.id} -> "
                                       f"{login.id} carries the if", "login_topology_join_gated")
                        lr = l_targets[w.target]
                        if lr.cond:
                            ldoc, lnode, lpath = route_nodes[lr]
                            self.issue(ldoc, lnode, lpath,
                                       f"route {login.id} -> {w.target} must have no if: "
                                       f"{w.target!r} is a join of {c.id!r} and {login.id!r} and is "
                                       "skipped whenever an inbound if does not fire",
                                       "login_topology_join_gated")
                    elif w.cond:
                        self.issue(rdoc, rnode, rpath,
                                   f"the login stage {login.id!r} does not route to {w.target!r}: "
                                   f"after a human login the run ends without {w.target!r}; route "
                                   f"{login.id} -> {w.target} and drop this if (topology A)",
                                   "login_topology_dead_end")
                    else:
                        self.issue(rdoc, rnode, rpath,
                                   f"{w.target!r} does not wait for the login stage {login.id!r}: it "
                                   f"starts right after {c.id!r}, before anyone logged in; add "
                                   f"{w.target!r} to the next of {login.id!r} (topology A)",
                                   "login_topology_no_wait")
                self._check_login_stage(doc, c, login)

    def _check_login_stage(self, doc: _Doc, check: StageInfo, login: StageInfo) -> None:
        path = f"stages[{login.index}]"
        prof = check.browser.profile if check.browser else None
        if login.browser is None:
            if not login.has_browser:
                self.issue(doc, login.node, path, f"the login stage {login.id!r} has no browser field: "
                           f"give it the profile {prof!r} so the operator logs in to that profile",
                           "login_stage_browser")
            return
        if login.browser.profile != prof:
            self.issue(doc, login.node, path, f"the login stage {login.id!r} uses profile "
                       f"{login.browser.profile!r} but {check.id!r} checks {prof!r}: the login "
                       "would not be seen by the check", "login_stage_browser")
        if login.gate is None:
            self.issue(doc, login.node, path, f"the login stage {login.id!r} has no gate: the operator "
                       "gets no pause to log in and confirm", "login_stage_gate", "warning")
        if login.verify != "login_check":
            self.issue(doc, login.node, path, f"the login stage {login.id!r} has no 'verify: "
                       "login_check': a wrong confirm would reach the work stages",
                       "login_stage_verify", "warning")
        elif login.on_verify_fail != login.id:
            self.issue(doc, login.node, path, f"on_verify_fail of the login stage {login.id!r} should be "
                       f"{login.id!r}, so the operator can try again", "login_stage_verify", "warning")

    # ---- tools

    def _check_tools(self) -> None:
        if not self.check_tools or self.first_browser is None:
            return
        doc, node, path = self.first_browser
        for tool in self.find_tools():
            if not tool.found:
                line, col = _mark(node)
                self.report.issues.append(Issue(
                    doc.display, line, col, path,
                    f"{tool.name} is not installed on this machine ({tool.source}); browser stages "
                    f"cannot run (hint: {tool.hint})", "tool_missing"))


# --------------------------------------------------------------------------- helpers

def _locate(doc: _Doc, node: yaml.Node, path: str, loc: tuple) -> tuple[yaml.Node, str]:
    """The deepest node along `loc` (a pydantic error location) and its dotted path."""
    found, depth = locate(node, loc, doc.child)
    return found, _error_path(path, loc, found, depth)


def _error_path(path: str, loc: tuple, node: yaml.Node, depth: int) -> str:
    """The dotted path of a located error: as deep as the walk got, plus the key that a
    mapping lacks (a missing field is named)."""
    if depth < len(loc) and isinstance(node, yaml.MappingNode) and isinstance(loc[depth], str):
        depth += 1
    return loc_path(loc[:depth], path)


def _suggest(name: str, stages: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(stages), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _cond_field(cond: str) -> str | None:
    m = _COND.match(cond)
    if m:
        return m.group(1).rsplit(".", 1)[-1]
    return "logged_in" if "logged_in" in cond else None


def _fires_when_logged_out(cond: str) -> bool:
    m = _COND.match(cond)
    if not m:
        return False
    op, value = m.group(2), m.group(3).strip("'\"").lower()
    return (op in ("eq", "==") and value == "false") or (op in ("ne", "!=") and value == "true")


def _default_tools() -> list[tools.Tool]:
    return [tools.find_agent_browser(), tools.find_browser()]


# --------------------------------------------------------------------------- API

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
    v = _Validator(path, display, site_policy, check_tools, find_tools)
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
