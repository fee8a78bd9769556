"""The attach and gate step of a stage: its browser gets the stage's write gates, its record's
view and pacing, the proxy lets it reach the stage's hosts, and the stage gets its session
through the CDP gate (a gate token, an agent-browser session with its tab pinned) and its
stage-exec bridges. `policy_changed` re-wires every live browser's write gates."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sfguard.policy.writes import WriteRules
from sfguard.supervisor.daemon.pacing import PageLoads, browser_budgets, pace_key, pace_view, stage_budget
from sfguard.supervisor.daemon.runs import Browser, Run, RunState, Stage, StageState
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, PipeClosed
from sfguard.supervisor.writes.modes import guard_writes, rewire_writes, stage_write_modes
from sfguard.supervisor.writes.websockets import guard_websockets

if TYPE_CHECKING:
    from sfguard.policy.engine import SitePolicy
    from sfguard.policy.watch import PolicyWatcher
    from sfguard.supervisor.daemon.crash import RunRecords
    from sfguard.supervisor.daemon.stage_sessions import StageSessions
    from sfguard.supervisor.gate.cdp_gate import CdpGate
    from sfguard.supervisor.record.recorder import Recorder
    from sfguard.supervisor.stage.stage_bridge import BridgeHost
    from sfguard.supervisor.writes.held import WriteApprover

    WriteRecorder = Callable[[str, dict[str, object]], None]

log = logging.getLogger("sfguard.guard")

#: The whole stage env (docs/design.md 4.3): nothing else reaches a stage.
STAGE_ENV_KEYS = ("AGENT_BROWSER_CDP", "AGENT_BROWSER_SESSION", "AGENT_BROWSER_SOCKET_DIR",
                  "AGENT_BROWSER_PIN_TAB", "AGENT_BROWSER_CONFIG", "AGENT_BROWSER_IDLE_TIMEOUT_MS")


class StageAttach:
    """Attaches a stage to its browser, over the guard's parts."""

    def __init__(self, *, runs: dict[str, Run], records: RunRecords, policy_watch: PolicyWatcher, gate: CdpGate,
                 sessions: StageSessions, bridges: BridgeHost, write_approver: WriteApprover,
                 write_gate_timeout: float, write_record: WriteRecorder, recorder: Recorder, page_loads: PageLoads):
        self.runs, self.records, self.policy_watch, self.gate = runs, records, policy_watch, gate
        self.sessions, self.bridges, self.recorder, self.page_loads = sessions, bridges, recorder, page_loads
        self.write_approver, self.write_gate_timeout, self.write_record = (
            write_approver, write_gate_timeout, write_record)

    @property
    def site_policy(self) -> SitePolicy:
        """The policy in force (the last good one)."""
        return self.policy_watch.policy

    def write_rules(self) -> WriteRules:
        """The live site policy's writes section (read at each request: hot reload)."""
        return self.site_policy.writes

    def write_owner(self, browser: Browser):
        """frame id -> the stage id whose tab it is, on this browser (the gate knows)."""
        def owner(frame_id: object) -> str | None:
            key = self.gate.stage_of_target(browser.anchor.pipe, frame_id) if browser.anchor else None
            parts = key.split("/") if key else []
            return parts[1] if len(parts) == 3 and not parts[1].startswith("~") else None
        return owner

    def policy_changed(self) -> None:
        """A reloaded site policy: write floors and exceptions in force for every live browser."""
        rewire_writes([r for r in self.runs.values() if r.state == RunState.ACTIVE], self.site_policy,
                      self.write_approver, self.write_gate_timeout, self.write_record, self.write_rules)

    async def attach(self, run: Run, browser: Browser, stage: Stage) -> None:
        assert run.proxy is not None and run.workdir is not None and browser.anchor is not None
        browser.stages.add(stage.stage_id)
        stage.browser_key = browser.key
        stage.write_modes = stage_write_modes(self.site_policy, stage.browser_req.writes,
                                              list(stage.browser_req.allow_domains))
        stage.started = time.time()        # its budget's active minutes count from here
        stage.pace, stage.budget = pace_view(self.site_policy, stage)
        # the browser's rules first (its write gate, its extension's rules), then its proxy lets
        # it reach the stage's hosts: nothing leaves a browser before the guard's rules are in
        # force (a new browser's proxy client is held until this set_allow)
        guard_writes(run, browser, stage, self.write_approver, self.write_gate_timeout, self.write_record,
                     self.write_rules, self.write_owner(browser))
        # the record's own view of the browser's stage tabs, before the stage's session opens one
        await self.recorder.browser(run.run_id, browser.anchor.pipe, browser.profile.name if browser.profile else None)
        await guard_websockets(browser.anchor)   # before the stage gets the browser
        self.page_loads.watch(run, browser)      # its HTTPS page loads counted (daemon/pacing.py)
        await run.proxy.set_allow(browser.client, run.browser_allow(browser), browser_budgets(run, browser))
        gate_key = f"{run.run_id}/{stage.stage_id}/{stage.attempt}"
        # downloads: a browser user's own folder (in its HOME), else the run's
        anchor, quota = browser.anchor, self.site_policy.tab_quota
        artifacts = anchor.downloads or run.workdir / "artifacts"
        # The stage's session (a gate token, an agent-browser session through it with the
        # stage's tab pinned and the unauthenticated stream server off): a shared anchor's
        # spare, started ahead, when there is one; else one started now. A shared anchor then
        # starts the spare for its next stage (supervisor/daemon/stage_sessions.py).
        started = await self.sessions.take(anchor, gate_key, quota) if browser.profile else None
        # The next stage's session starts beside this stage's own. On 2 cores the two share
        # the CPU: measured in one sitting (supervisor_bench, 5 rounds, load ~4), beside it the
        # first stage was 1.92x a bare launch and a second stage requested at once ready in
        # 40 ms; after it, 1.23x and 791 ms. Started after it, a spare is also still starting
        # when a short run ends, and the run's end waits for it: the test suite took minutes
        # longer (docs/agent-browser-notes.md, "First stage").
        if browser.profile is not None:
            def save_unless_ended() -> None:
                if run.state != RunState.ENDED:
                    self.records.save(run)
            self.sessions.prestart(run.run_id, anchor, artifacts_dir=artifacts, tab_quota=quota,
                                on_ready=save_unless_ended)
        if started is None:
            # the browser's start-up tab, while no stage has had it: agent-browser attaches to
            # it instead of creating a first tab of its own (docs/agent-browser-notes.md)
            started = await self.sessions.start(gate_key, anchor, artifacts_dir=artifacts,
                                              tab_quota=quota, own_tab=anchor.take_blank_tab())
        if anchor.headed and started.tab:   # a person at the screen sees the stage's tab
            with contextlib.suppress(PipeClosed, CdpCallError, TimeoutError):
                await anchor.pipe.call("Target.activateTarget", {"targetId": started.tab}, timeout=5)
        # The stage's bridges for `sfguard stage-exec` (closed at stage end, like the token).
        bridged = False
        try:
            await self.bridges.open(gate_key, started.url, run.proxy, stage.browser_req.allow_domains,
                                    stage.browser_req.writes, pace=(pace_key(run, browser), stage_budget(stage)))
            bridged = True
        finally:
            if not bridged:
                await self.sessions.end(started)
        if stage.state == StageState.ENDED:
            # ended (POST .../end) while its browser was being made: nothing of it may stay open
            browser.stages.discard(stage.stage_id)
            await self.bridges.close(gate_key, run.proxy)
            await self.sessions.end(started)
            if browser.profile is not None and browser.client in run.proxy.clients:
                await run.proxy.set_allow(browser.client, run.browser_allow(browser),
                                          browser_budgets(run, browser))
            log.info("stage %s/%s ended before it was ready", run.run_id, stage.stage_id,
                     extra={"run": run.run_id, "stage": stage.stage_id})
            return
        stage.gate_key = gate_key
        # The stage gets exactly the docs/design.md 4.3 variables; the guard started the session, and
        # closes it later, with the same ones (plus PATH/HOME...): both sides carry one env.
        stage.env = {k: started.env_full[k] for k in STAGE_ENV_KEYS}
        stage.env_full = dict(started.env_full)
        stage.processes = list(started.processes)
        stage.move(StageState.READY)
        stage.waiting = None
