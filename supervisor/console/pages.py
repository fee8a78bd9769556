"""What each console page shows, read from the guard: the overview (status and open
handoffs), the decisions (the decision log's tail, across its newest rotation, with a `policy
explain` line per proxy decision), the profiles (with their last login check) and the audit
(the chain's state and its newest records). No HTTP here: supervisor/console/server.py serves it."""
from __future__ import annotations

import contextlib
import json
import shlex
from collections import deque
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.console import approvals_page, runs_page
from sfguard.supervisor.console.view import ConsoleView
from sfguard.supervisor.protocols import ProfileError
from sfguard.supervisor.states import HandoffPhase

if TYPE_CHECKING:
    from sfguard.supervisor.console.handoff import LiveHandoff

DECISIONS_TAIL = 5000
DECISIONS_SHOWN = 200
AUDIT_SHOWN = 50


async def page_context(view: ConsoleView, handoffs: dict[str, LiveHandoff], page: str,
                       query: dict[str, str]) -> dict[str, Any]:
    if page == "overview":
        return await _overview(view, handoffs)
    if page == "decisions":
        return _decisions(view, query)
    if page == "profiles":
        return await _profiles(view)
    if page == "approvals":
        return approvals_page.context(view)
    if page == "runs":
        return await runs_page.context(view, query)
    return _audit(view)


async def _overview(view: ConsoleView, handoffs: dict[str, LiveHandoff]) -> dict[str, Any]:
    status = await view.status()
    shown = [dict(h.public(), id=h.id, run=h.run_id, stage=h.stage_id)
             for h in handoffs.values() if h.state == HandoffPhase.OPEN]
    return {"gs": status, "handoffs": shown, "approvals": approvals_page.context(view)["pending"]}


def _decisions(view: ConsoleView, query: dict[str, str]) -> dict[str, Any]:
    filters = {k: query.get(k, "").strip()[:200] for k in ("run", "stage", "host", "decision", "reason")}
    rows: deque[str] = deque(maxlen=DECISIONS_TAIL)
    path = view.decisions_log
    # the newest rotated file first (supervisor/daemon/log_rotation.py), then the live one
    for part in (path.with_name(path.name + ".1"), path):
        with contextlib.suppress(FileNotFoundError):
            with open(part, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    rows.append(line)
    out = []
    for line in reversed(rows):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if not isinstance(d, dict):
            continue
        stage = str(d.get("stage") or d.get("client") or "")
        rec = {"ts": d.get("ts"), "run": str(d.get("run") or (stage.split("/")[0] if "/" in stage else "")),
               "stage": stage, "method": d.get("method"), "host": str(d.get("host") or ""),
               "port": d.get("port"), "decision": str(d.get("decision") or ""),
               "reason": str(d.get("reason") or ""), "rule": d.get("rule"),
               "source": d.get("source") or "proxy"}
        if any(v and v.lower() not in str(rec[k]).lower() for k, v in filters.items()):
            continue
        rec["explain"] = _explain(view, rec)
        out.append(rec)
        if len(out) >= DECISIONS_SHOWN:
            break
    return {"rows": out, "filters": filters}


def _explain(view: ConsoleView, rec: dict[str, Any]) -> str | None:
    if rec["source"] != "proxy" or not rec["host"]:
        return None
    target = rec["host"] + (f":{rec['port']}" if rec["port"] not in (None, 80, 443) else "")
    argv = ["sfguard", "policy", "explain", target, "--policy", str(view.policy_path)]
    run = view.runs.get(rec["run"])
    if run is not None:
        allow = sorted({a for s in run.stages.values() for a in s.browser_req.allow_domains})
        for a in allow:
            argv += ["--allow", a]
    return shlex.join(argv)


async def _profiles(view: ConsoleView) -> dict[str, Any]:
    answer = await view.list_profiles()
    checks: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(OSError, ProfileError):   # the page shows the profiles without their last check
        for rec in view.audit.records():
            if rec.get("event") == "login_checked":
                f = rec.get("fields") or {}
                checks[str(f.get("profile"))] = {"ts": rec.get("ts"), "result": f.get("result")}
    rows = [dict(p, state="leased" if p["leased_by"] else "sealed", check=checks.get(p["name"]))
            for p in answer["profiles"]]
    return {"profiles": rows}


def _audit(view: ConsoleView) -> dict[str, Any]:
    result = view.audit.verify()
    records = view.audit.records()[-AUDIT_SHOWN:]
    shown = [{"seq": r.get("seq"), "ts": r.get("ts"), "event": r.get("event"),
              "fields": " ".join(f"{k}={v}" for k, v in sorted((r.get("fields") or {}).items()))}
             for r in reversed(records)]
    return {"verify": result, "records": shown}
