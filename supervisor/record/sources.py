"""Where a run record's entries come from (supervisor/record/recorder.py keeps them): the stage
lifecycle, the CDP gate's commands, the guard's view of each stage tab, the write gate and the
approvals store, the audit chain's records of a run, and the run proxy's decision lines.

Each source is the guard's: the relay reports a command before it reaches the browser (and a
refused one that never does), the guard's own pipe session sees where a tab went, the proxy
and the write gate say what they decided. Levels apply per site (`RecordCore.level`): below
`full` no command, address or screenshot of the site is kept, and `off` keeps nothing of it.
"""
from __future__ import annotations

import asyncio
import calendar
import logging
import time
from typing import Any

from sfguard.supervisor.gate.cdp_pipe import CdpCallError, PipeClosed
from sfguard.supervisor.gate.cdp_policy import safe_method_name
from sfguard.supervisor.record import files, summary
from sfguard.supervisor.record.core import RecordCore
from sfguard.supervisor.record.runrec import RunRec, StageRec, site
from sfguard.supervisor.record.tabs import TabWatcher

log = logging.getLogger("sfguard.record")

#: audit events that name a run, as record entries
AUDIT_KINDS = {"login_checked": "login_check", "handoff_opened": "handoff", "handoff_viewed": "handoff",
               "handoff_confirmed": "handoff", "handoff_closed": "handoff", "profile_leased": "lease",
               "profile_released": "lease", "profile_cleaned": "browser", "console_run_ended": "console",
               "console_stage_cancelled": "console", "console_browser_restarted": "console",
               "console_stage_watched": "console", "console_signed_in": "console"}
#: the fields of those records an entry shows (never a secret: the audit chain refuses them)
AUDIT_FIELDS = ("profile", "stage", "host", "logged_in", "result", "outcome", "by", "mode", "person", "removed")
#: seconds within which a proxy decision or a navigation is linked to the command that asked
LINK_S = 30.0


def _epoch(ts: Any) -> float | None:
    """Unix seconds of `YYYY-MM-DDTHH:MM:SS[.mmm]Z`."""
    if not isinstance(ts, str) or not ts.endswith("Z"):
        return None
    try:
        whole, _, frac = ts[:-1].partition(".")
        return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + (int(frac[:3] or 0) / 1000)
    except ValueError:
        return None


class Sources(RecordCore):
    """The recorder's inputs (supervisor/record/recorder.py: the whole)."""

    # -- the stage lifecycle (supervisor/daemon/stages.py, teardown.py) ----------------------
    def stage(self, run_id: str, stage_id: str, attempt: int, event: str, **fields: Any) -> None:
        run = self.runs.get(run_id)
        if run is None:
            return
        st = run.stages.get(stage_id)
        if st is not None and st.attempt == attempt and (
                event == "requested" or (event in ("waiting", "failed") and st.last_event == event)):
            return                  # asked again (a resume, a waiting stage looked at again)
        if st is None or st.attempt != attempt:
            st = run.stages[stage_id] = StageRec(attempt)
        st.last_event = event
        st.ready = event == "ready"
        profile = fields.get("profile")
        if event == "requested" and (stage_id not in run.index["stages"] or profile not in run.index["profiles"]):
            run.index["stages"] = sorted(set(run.index["stages"]) | {stage_id})
            run.index["profiles"] = sorted(set(run.index["profiles"]) | ({profile} if profile else set()))
            self.spawn(self._rewrite_index(run))
        self.entry(run_id, f"stage_{event}", decision=True, stage=stage_id, attempt=attempt, **fields)

    async def _rewrite_index(self, run: RunRec) -> None:
        index = dict(run.index)

        def write() -> None:
            with run.index_lock:
                if not run.sealed:        # a run that ended meanwhile keeps its sealed index
                    files.write_index(run.writer.folder, index, False)
        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            log.warning("run %s: its record's index was not rewritten: %s", run.run_id, exc)

    async def browser(self, run_id: str, pipe: Any, profile: str | None) -> None:
        """A browser of the run gets stages: the guard's view of its stage tabs starts."""
        run = self.runs.get(run_id)
        if run is None or id(pipe) in run.watchers or self.settings.level != "full":
            return
        watcher = TabWatcher(pipe, lambda tid: self.owner(run_id, pipe, tid) is not None,
                             lambda what, tid, d: self.tab_event(run_id, pipe, what, tid, d))
        run.watchers[id(pipe)], run.profile_of[id(pipe)] = watcher, profile
        try:
            await watcher.start()
        except (PipeClosed, CdpCallError, TimeoutError) as exc:   # the stage goes on; its tabs unseen
            log.warning("run %s: the record cannot watch a browser's tabs: %s", run_id, type(exc).__name__)

    def owner(self, run_id: str, pipe: Any, target: str) -> tuple[str, int] | None:
        """(stage, attempt) whose tab `target` of this browser is, per the gate."""
        key = self.gate.stage_of_target(pipe, target) if self.gate is not None else None
        parts = key.split("/") if isinstance(key, str) else []
        if len(parts) != 3 or parts[0] != run_id or parts[1].startswith("~") or not parts[2].isdigit():
            return None
        return parts[1], int(parts[2])

    # -- the CDP gate: every command of a stage ---------------------------------------------
    def command(self, stage_key: str, msg: dict, target: str | None, pipe: Any, outcome: str | None) -> None:
        """The gate's observer: called in the relay before the command goes on, so it only
        notes what it needs now (the tab as it is, the time) and writes the entry next."""
        if not stage_key.startswith(tuple(self.runs)) or self.loop is None:
            return
        info: dict[str, Any] = (pipe.targets.get(target) or {}) if target else {}
        self.loop.call_soon(self._command, stage_key, msg, target, pipe, outcome, info.get("url"),
                            info.get("type"), time.monotonic())

    def _command(self, stage_key: str, msg: dict, target: str | None, pipe: Any, outcome: str | None,
                 tab_url: Any, tab_type: Any, t: float) -> None:
        parts = stage_key.split("/")
        run = self.runs.get(parts[0]) if len(parts) == 3 and not parts[1].startswith("~") else None
        st = run.stages.get(parts[1]) if run is not None else None
        if run is None or st is None:
            return
        method = safe_method_name(msg.get("method"))
        params: dict[str, Any] = msg["params"] if isinstance(msg.get("params"), dict) else {}
        sites = [_site(tab_url)]
        if method in summary.URL_METHODS:
            sites.append(_site(params.get("url", "about:blank")))
        level = self.level(*sites)
        refused = outcome is not None and outcome != "write_held"
        if level == "off" or (level == "decisions" and not refused):
            self._mark(run, sites, level)
            return
        st.pipe, st.last_t = pipe, t
        if target and tab_type == "page":
            st.last_tab = target
            watcher = run.watchers.get(id(pipe))
            if watcher is not None:
                watcher.ensure(target)
        st.busy += 1
        base: dict[str, Any] = {"stage": parts[1], "attempt": st.attempt, "method": method,
                                "tab": summary.short_id(target), "phase": None if st.ready else "setup",
                                "refused": outcome if refused else None,
                                "answer": "write_held" if outcome == "write_held" else None}
        if method == "Input.insertText" and not refused and level == "full":
            text = params.get("text")
            self.spawn(self._typed(run, st, target, text if isinstance(text, str) else "", t, base))
            return
        seq = self.entry(run.run_id, "command", decision=refused, t=t, **base,
                         **(summary.command(method, params) if level == "full" else {}))
        st.last_cmd = seq or st.last_cmd
        if seq is not None and summary.causes_requests(method, params):
            run.navs.append((t, sites[-1][0], seq, parts[1]))

    async def _typed(self, run: RunRec, st: StageRec, target: str | None, text: str, t: float,
                     base: dict[str, Any]) -> None:
        watcher = run.watchers.get(id(st.pipe))
        field = await watcher.focused(target) if watcher is not None and target else None
        seq = self.entry(run.run_id, "command", decision=False, t=t, **base, **summary.typed(text, field))
        st.last_cmd = seq or st.last_cmd

    def _mark(self, run: RunRec, sites: list[tuple[str | None, int | None]], level: str) -> None:
        """Say once per site that the record keeps less of it (an `off` site is not named)."""
        for host, port in sites:
            if host and self.level((host, port)) == level and (host, level) not in run.marks:
                run.marks.add((host, level))
                self.entry(run.run_id, "level", decision=True, level=level,
                           host=host if level != "off" else None)

    # -- the guard's view of a tab (supervisor/record/tabs.py) ----------------------------
    def tab_event(self, run_id: str, pipe: Any, what: str, tab: str, d: dict[str, Any]) -> None:
        run = self.runs.get(run_id)
        who = self.owner(run_id, pipe, tab) if run is not None else None
        if run is None or who is None:
            return
        url = d.get("url")
        level = self.level(_site(url))
        if level != "full":
            self._mark(run, [_site(url)], level)
            return
        stage_id, attempt = who
        st = run.stages.get(stage_id)
        if what == "navigated":      # what the stage did last (an open, a click, a key) made it go
            self.entry(run_id, "navigated", decision=False, stage=stage_id, attempt=attempt, tab=tab[:8],
                       url=summary.address(url), failed=d.get("failed") or None, same_document=d.get("same_document"),
                       links={"command": st.last_cmd if st else None})
        elif what == "loaded":
            seq = self.entry(run_id, "loaded", decision=False, stage=stage_id, attempt=attempt, tab=tab[:8],
                             url=summary.address(url))
            if st is not None:
                st.pipe = st.pipe or pipe
                self.shoot(run_id, stage_id, tab, "navigation", seq, quiet=True)

    # -- the write gate and the approvals store ---------------------------------------------
    def write_decision(self, rec: dict[str, object]) -> None:
        """A write the gate let go or refused by itself (held ones: `approval`)."""
        verdict = str(rec.get("decision") or "")
        run = self.runs.get(str(rec.get("run")))
        if run is None or verdict not in ("write_allowed", "write_refused"):
            return
        host = str(rec.get("host") or "")
        raw_port = rec.get("port")
        port = raw_port if isinstance(raw_port, int) else None
        level = self.level((host, port))
        if level == "off":
            return
        stage_id = rec["stage"] if isinstance(rec.get("stage"), str) else None
        st = run.stages.get(str(stage_id)) if stage_id else None
        seq = self.entry(run.run_id, "write", decision=True, stage=stage_id, attempt=rec.get("attempt"),
                         verdict=verdict[6:], method=rec.get("method"), host=host, port=port,
                         path=rec.get("path") if level == "full" else None, reason=rec.get("reason"),
                         rule=rec.get("rule"), links={"command": st.last_cmd if st else None})
        if verdict == "write_refused" and st is not None:
            self.shoot(run.run_id, str(stage_id), st.last_tab, "write_refused", seq)

    def approval(self, event: str, ap: Any) -> None:
        h = ap.held
        run = self.runs.get(h.run_id)
        level = self.level((h.host, h.port)) if run is not None else "off"
        if run is None or level == "off":
            return
        full = level == "full"
        st = run.stages.get(h.stage_id) if h.stage_id else None
        fields = {"stage": h.stage_id, "attempt": h.attempt, "approval": ap.id, "method": h.method,
                  "host": h.host, "port": h.port, "path": h.path if full else None, "why": h.why, "rule": h.rule}
        if event == "write_held":
            name = None
            if full and h.screenshot and not run.capped:
                run.shots += 1
                name = f"{run.shots:05d}.png"
                self.spawn(_keep(run, name, h.screenshot))
            run.held[ap.id] = self.entry(
                run.run_id, "write", decision=True, verdict="held", page=summary.address(h.tab_url) if full else None,
                links={"shot": name, "command": st.last_cmd if st else None}, **fields) or 0
            return
        self.entry(run.run_id, "write", decision=True, verdict=event.removeprefix("write_"), by=ap.by,
                   note=ap.reason[:200] or None, links={"held": run.held.get(ap.id)}, **fields)

    # -- the audit chain: login checks, handoffs, console actions ----------------------------
    def audit_event(self, event: str, fields: dict[str, Any]) -> None:
        """An audit record (from any thread): those that name a run of this guard."""
        if event not in AUDIT_KINDS or fields.get("run") not in self.runs or self.loop is None:
            return
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here:
            self._audit_entry(event, dict(fields))
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._audit_entry, event, dict(fields))

    def _audit_entry(self, event: str, fields: dict[str, Any]) -> None:
        run = self.runs.get(fields.get("run", ""))
        host = fields.get("host")
        if run is None or (host and self.level((host, None)) == "off"):
            return
        seq = self.entry(run.run_id, AUDIT_KINDS[event], decision=True, event=event,
                         **{k: fields[k] for k in AUDIT_FIELDS if k in fields})
        if not event.startswith("handoff_") or event == "handoff_viewed":
            return
        profile = fields.get("profile")
        stage_id = fields.get("stage") or next(
            (sid for sid, st in sorted(run.stages.items(), key=lambda kv: -(kv[1].last_cmd or 0))
             if st.pipe is not None and run.profile_of.get(id(st.pipe)) == profile), None)
        st = run.stages.get(stage_id) if stage_id else None
        if event == "handoff_opened":
            if st is not None:    # the stage's tab as the login starts (never the login's own tab)
                self.shoot(run.run_id, stage_id, st.last_tab, "handoff_start", seq, handoff=True)
            run.paused.add(str(profile))      # a person logs in: no picture of that browser
        else:
            run.paused.discard(str(profile))
            if st is not None:
                self.shoot(run.run_id, stage_id, st.last_tab, "handoff_end", seq)

    # -- the run proxy's decisions (supervisor/record/tail.py) ----------------------------
    def proxy_line(self, d: dict[str, Any]) -> None:
        run = self.runs.get(d["run"]) if isinstance(d.get("run"), str) else None
        if run is None or str(d.get("client") or "").startswith("writes:") or d.get("source"):
            return
        host, port = d.get("host"), d.get("port") if isinstance(d.get("port"), int) else None
        if d.get("reason") == "quiet_denials":
            self.entry(run.run_id, "proxy", decision=True, verdict="deny", reason="quiet_denials",
                       count=d.get("count"))
            return
        level = self.level((host if isinstance(host, str) else None, port))
        if level == "off":
            return
        epoch = _epoch(d.get("ts"))
        t = time.monotonic() - max(0.0, time.time() - epoch) if epoch is not None else None
        when = t if t is not None else time.monotonic()
        nav = next((n for n in reversed(run.navs) if n[1] == host and 0 <= when - n[0] < LINK_S), None)
        self.entry(run.run_id, "proxy", decision=True, t=t, ts=d.get("ts") if epoch else None,
                   stage=nav[3] if nav else None, verdict=d.get("decision"), reason=d.get("reason"),
                   rule=d.get("rule"), method=d.get("method"), host=host, port=port,
                   links={"command": nav[2] if nav else None})


_site = site


async def _keep(run: RunRec, name: str, data: bytes) -> None:
    try:
        await asyncio.to_thread(run.writer.add_shot, name, data)
    except OSError as exc:
        log.warning("run %s: a held write's picture could not be kept: %s", run.run_id, exc)
