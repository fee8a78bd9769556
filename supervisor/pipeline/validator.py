"""The pipeline validator: the file's shape, each stage, browser field, route and gate, read node
by node so every finding names FILE:LINE:COL (see supervisor/pipeline/spec.py for the shape and
what is reported; `validate_pipeline` there is the entry point).
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel

from sfguard import policy
from sfguard.policy.yamlpos import mark_place, validate_at, yaml_error_mark
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.handoff import GateHandoff
from sfguard.supervisor.models import STAGE_ID, BrowserField, error_message
from sfguard.supervisor.pipeline.report import Issue, PipelineReport, Route, StageInfo
from sfguard.supervisor.pipeline.topology import check_login_topology
from sfguard.supervisor.pipeline.yamldoc import YamlDoc, error_path, kind, locate_in, mark

__all__ = ["MAX_PIPELINE_BYTES", "PIPELINE_KEYS", "STAGE_FILE_KEYS", "STAGE_KEYS", "Validator"]

MAX_PIPELINE_BYTES = 1024 * 1024
PIPELINE_KEYS = ("name", "description", "version", "stages")
STAGE_KEYS = ("id", "name", "description", "file", "prompt", "skill", "skills", "mcp", "requires",
              "browser", "next", "gate", "verify", "on_verify_fail", "io", "timeout", "retries",
              "replay_safe", "agent", "model")
#: A stage file holds a stage's fields; its id and routes belong to the pipeline.
STAGE_FILE_KEYS = tuple(k for k in STAGE_KEYS if k not in ("id", "file", "next"))
ROUTE_KEYS = ("to", "if")
VERIFY_VALUES = ("login_check",)
_STAGE_ID = re.compile(STAGE_ID)


class Validator:
    """One validation: reads the pipeline (and its stage files) node by node into a report."""

    def __init__(self, pipeline: Path, display: str, site_policy: policy.SitePolicy | None,
                 check_tools: bool, find_tools: Callable[[], Iterable[tools.Tool]]):
        self.pipeline = pipeline
        self.report = PipelineReport(display)
        self.site_policy = site_policy
        self.check_tools = check_tools
        self.find_tools = find_tools
        self.first_browser: tuple[YamlDoc, yaml.Node, str] | None = None
        self.verify_nodes: dict[str, tuple[YamlDoc, yaml.Node]] = {}

    # ---- issue helpers

    def issue(self, doc: YamlDoc, node: yaml.Node | None, path: str, message: str, code: str,
              severity: str = "error") -> None:
        line, col = mark(node)
        self.report.issues.append(Issue(doc.display, line, col, path, message, code, severity))

    def yaml_issue(self, display: str, exc: yaml.MarkedYAMLError) -> None:
        line, col = mark_place(yaml_error_mark(exc))
        problem = "; ".join(str(p) for p in (exc.context, exc.problem) if p)
        self.report.issues.append(Issue(display, line, col, "(yaml)", f"not valid YAML: {problem}", "yaml"))

    def model_issues(self, doc: YamlDoc, model: type[BaseModel], value: Any, node: yaml.Node,
                     path: str, code: str, skip: Callable[[dict], bool] = lambda err: False) -> Any:
        """Validate `value` (read at `node`) with `model`; each error becomes an issue at the
        place it points to. Returns the model, or None when the value is not valid."""
        result, errors = validate_at(model, value, node, doc.child)
        for err, enode, depth in errors:
            if not skip(err):
                self.issue(doc, enode, error_path(path, tuple(err["loc"]), enode, depth),
                           error_message(err, model), code)
        return result

    def mapping(self, doc: YamlDoc, node: yaml.Node, path: str, known: tuple[str, ...],
                what: str) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """Check `node` is a mapping with only `known` string keys and no duplicates; return
        key -> (key node, value node) of the known keys."""
        if not isinstance(node, yaml.MappingNode):
            self.issue(doc, node, path or "(top)", f"{what} must be a mapping, not {kind(node)}"
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
                first, _ = mark(out[key][0])
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
            doc = YamlDoc(self.report.file, text)
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

    def _pipeline(self, doc: YamlDoc) -> None:
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
        route_nodes: dict[Route, tuple[YamlDoc, yaml.Node, str]] = {}
        for i, node in enumerate(snode.value):
            info = self._stage(doc, node, i, route_nodes)
            if info is None:
                continue
            if info.id in seen:
                line, _ = mark(seen[info.id])
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
        check_login_topology(doc, stages, route_nodes, self.issue)
        self._check_tools()

    # ---- one stage

    def _stage(self, doc: YamlDoc, node: yaml.Node, i: int,
               route_nodes: dict[Route, tuple[YamlDoc, yaml.Node, str]]) -> StageInfo | None:
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
        fields: dict[str, tuple[YamlDoc, yaml.Node, str]] = {}
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

    def _stage_fields(self, info: StageInfo, fields: dict[str, tuple[YamlDoc, yaml.Node, str]],
                      keys: dict[str, yaml.Node], route_nodes, entry, doc: YamlDoc, path: str) -> None:
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
            if (self.check_tools and info.browser is not None and info.browser.headed
                    and "headed" in info.browser.model_fields_set and not tools.display_available()):
                self.issue(bdoc, bnode, f"{bpath}.headed", "headed: true needs a display and this "
                           "machine has none (no DISPLAY or WAYLAND_DISPLAY): a guard here refuses "
                           "this stage (no_display); use headed: false (and a live_view handoff "
                           "for a person to log in), or run the guard in a desktop session",
                           "no_display", "warning")
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

    def _stage_file(self, doc: YamlDoc, node: yaml.Node, path: str) -> YamlDoc | None:
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
            return YamlDoc(display, data.decode("utf-8"))
        except UnicodeDecodeError:
            self.issue(doc, node, path, f"stage file {rel!r} is not UTF-8 text", "stage_file")
        except yaml.MarkedYAMLError as exc:
            self.yaml_issue(display, exc)
        return None

    # ---- browser field

    def _browser(self, doc: YamlDoc, node: yaml.Node, path: str) -> BrowserField | None:
        if not isinstance(node, yaml.MappingNode):
            self.issue(doc, node, path, f"browser must be a mapping, not {kind(node)}", "browser")
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

    def _allow_domains(self, doc: YamlDoc, node: yaml.Node, path: str, domains: list) -> None:
        refused: dict[int, str] = {}
        if self.site_policy is not None:
            texts = [t if isinstance(t, str) else "" for t in domains]
            refused = dict(self.site_policy.allow_domains_refusals(texts))
        for j, text in enumerate(domains):
            enode, epath = locate_in(doc, node, path, ("allow_domains", j))
            try:
                pat = policy.parse_pattern(text, allow_list=True)
            except policy.PatternError as exc:
                self.issue(doc, enode, epath, f"{exc.message}: {text!r}"
                           + (f" (hint: {exc.hint})" if exc.hint else ""), "browser")
                continue
            if j in refused:
                self.issue(doc, enode, epath, refused[j], policy.REVIEWER_ONLY)
                continue
            if self.site_policy is None:
                continue
            host = str(pat.network.network_address) if pat.kind == "cidr" and pat.network else pat.key
            d = self.site_policy.decide(host, pat.port or 443, policy.compile_patterns([text]))
            if d.reason.endswith("blocked_by_policy"):
                severity = "warning" if d.reason.startswith("would_deny") else "error"
                self.issue(doc, enode, epath,
                           f"{text!r} is blocked by the site policy ({d.rule}): the proxy will deny "
                           f"it whatever the pipeline says [blocked_by_policy]", "blocked_by_policy",
                           severity)

    def _check_url_reachable(self, doc: YamlDoc, node: yaml.Node, path: str, b: BrowserField) -> None:
        """The check page is opened in the anchor, through the run's proxy: its host must be
        allowed by the stage's allow_domains (or the policy's allow_always)."""
        if self.site_policy is None or b.login_check is None:
            return
        parts = urlsplit(b.login_check.url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return
        allow = policy.compile_patterns(b.allow_domains)
        d = self.site_policy.decide(parts.hostname or "", port, allow)
        if not d.allowed or d.reason.startswith("would_deny"):
            enode, epath = locate_in(doc, node, path, ("login_check", "url"))
            if d.reason == policy.REVIEWER_ONLY:   # no allow_domains entry can open it
                self.issue(doc, enode, epath, f"the proxy would deny the check page ({d.reason}): "
                           f"{d.explanation}", "check_url_denied")
                return
            self.issue(doc, enode, epath,
                       f"the proxy would deny the check page ({d.reason}): add "
                       f"{policy.join_host_port(parts.hostname or '', parts.port)!r} to allow_domains",
                       "check_url_denied")

    # ---- routes and gates

    def _routes(self, doc: YamlDoc, node: yaml.Node, path: str, source: str):
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

    def _gate(self, doc: YamlDoc, node: yaml.Node, path: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            self.issue(doc, node, path, f"gate must be a mapping, not {kind(node)}", "shape")
            return
        for key, _k, v in doc.items(node):
            if key != "handoff":
                continue
            self.model_issues(doc, GateHandoff, doc.value(v), v, f"{path}.handoff", "handoff")

    # ---- tools

    def _check_tools(self) -> None:
        if not self.check_tools or self.first_browser is None:
            return
        doc, node, path = self.first_browser
        for tool in self.find_tools():
            if not tool.found:
                line, col = mark(node)
                self.report.issues.append(Issue(
                    doc.display, line, col, path,
                    f"{tool.name} is not installed on this machine ({tool.source}); browser stages "
                    f"cannot run (hint: {tool.hint})", "tool_missing"))


def _suggest(name: str, stages: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(stages), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
