"""The login topology of a pipeline: check -> login -> work, as Stageflow runs joins.

Part of pipeline validation (supervisor/pipeline/validator.py calls `check_login_topology` once
every stage is read); see its docstring for what is right and what is reported.
"""
from __future__ import annotations

import re
from typing import Protocol

import yaml

from sfguard.supervisor.pipeline.report import Route, StageInfo
from sfguard.supervisor.pipeline.yamldoc import YamlDoc

__all__ = ["IssueSink", "check_login_topology"]

_COND = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(eq|ne|==|!=)\s*(\S+)\s*$")


class IssueSink(Protocol):
    """Where a finding goes (the validator's `issue`)."""

    def __call__(self, doc: YamlDoc, node: yaml.Node | None, path: str, message: str, code: str,
                 severity: str = "error") -> None: ...


def check_login_topology(doc: YamlDoc, stages: dict[str, StageInfo],
                         route_nodes: dict[Route, tuple[YamlDoc, yaml.Node, str]],
                         issue: IssueSink) -> None:
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
        login_ids = [r.target for r in gated if r.cond and _fires_when_logged_out(r.cond)]
        logins = [stages[t] for t in dict.fromkeys(login_ids) if t in stages]
        work_routes = [r for r in c.routes if r.target not in login_ids]
        for login in logins:
            l_targets = {r.target: r for r in login.routes}
            if not work_routes and login.routes:
                rdoc, rnode, rpath = route_nodes[next(r for r in gated if r.target == login.id)]
                issue(rdoc, rnode, rpath,
                      f"stage {c.id!r} routes only to the login stage {login.id!r}: when the "
                      f"profile is logged in, {login.id!r} is skipped and nothing after it "
                      f"runs; add a route {c.id} -> {next(iter(l_targets))} with no if "
                      "(topology A)", "login_topology_no_work")
            for w in work_routes:
                rdoc, rnode, rpath = route_nodes[w]
                if w.target in l_targets:
                    if w.cond:
                        issue(rdoc, rnode, rpath,
                              f"route {c.id} -> {w.target} must have no if: {w.target!r} "
                              f"is a join of {c.id!r} and the login stage {login.id!r}, and "
                              f"after a login this if is false, so Stageflow would skip "
                              f"{w.target!r} silently (topology B); only {c.id} -> "
                              f"{login.id} carries the if", "login_topology_join_gated")
                    lr = l_targets[w.target]
                    if lr.cond:
                        ldoc, lnode, lpath = route_nodes[lr]
                        issue(ldoc, lnode, lpath,
                              f"route {login.id} -> {w.target} must have no if: "
                              f"{w.target!r} is a join of {c.id!r} and {login.id!r} and is "
                              "skipped whenever an inbound if does not fire",
                              "login_topology_join_gated")
                elif w.cond:
                    issue(rdoc, rnode, rpath,
                          f"the login stage {login.id!r} does not route to {w.target!r}: "
                          f"after a human login the run ends without {w.target!r}; route "
                          f"{login.id} -> {w.target} and drop this if (topology A)",
                          "login_topology_dead_end")
                else:
                    issue(rdoc, rnode, rpath,
                          f"{w.target!r} does not wait for the login stage {login.id!r}: it "
                          f"starts right after {c.id!r}, before anyone logged in; add "
                          f"{w.target!r} to the next of {login.id!r} (topology A)",
                          "login_topology_no_wait")
            _check_login_stage(doc, c, login, issue)


def _check_login_stage(doc: YamlDoc, check: StageInfo, login: StageInfo, issue: IssueSink) -> None:
    path = f"stages[{login.index}]"
    prof = check.browser.profile if check.browser else None
    if login.browser is None:
        if not login.has_browser:
            issue(doc, login.node, path, f"the login stage {login.id!r} has no browser field: "
                  f"give it the profile {prof!r} so the operator logs in to that profile",
                  "login_stage_browser")
        return
    if login.browser.profile != prof:
        issue(doc, login.node, path, f"the login stage {login.id!r} uses profile "
              f"{login.browser.profile!r} but {check.id!r} checks {prof!r}: the login "
              "would not be seen by the check", "login_stage_browser")
    if login.gate is None:
        issue(doc, login.node, path, f"the login stage {login.id!r} has no gate: the operator "
              "gets no pause to log in and confirm", "login_stage_gate", "warning")
    if login.verify != "login_check":
        issue(doc, login.node, path, f"the login stage {login.id!r} has no 'verify: "
              "login_check': a wrong confirm would reach the work stages",
              "login_stage_verify", "warning")
    elif login.on_verify_fail != login.id:
        issue(doc, login.node, path, f"on_verify_fail of the login stage {login.id!r} should be "
              f"{login.id!r}, so the operator can try again", "login_stage_verify", "warning")


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
