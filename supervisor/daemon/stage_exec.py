"""The guard's side of `sfguard stage-exec`: the start-up check and the exec answer.

At start the guard checks that bubblewrap builds the stage sandbox here (as the stage user when
it runs as root, creating that user when missing) and sweeps the bridge folders a dead guard
left. The exec route (`GET /v1/runs/{run}/stages/{stage}/exec`, runner only: the control socket
is 0600 or 0660 with the API group) answers what stage-exec needs: the in-sandbox env, the
stage's two bridge sockets, the folders to hide and the user to run as.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sfguard.supervisor.browsers import agent_browser, tools
from sfguard.supervisor.daemon.runs import Run, Stage, StageState
from sfguard.supervisor.errors import Conflict
from sfguard.supervisor.gate.cdp_gate import CdpGate, GateError
from sfguard.supervisor.stage import sandbox
from sfguard.supervisor.stage.stage_bridge import BridgeHost

log = logging.getLogger("sfguard.stage_exec")

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@dataclass(frozen=True)
class Sandbox:
    """What the start-up check found: the stage user (root only), whether bubblewrap builds the
    sandbox here and why not, and the agent-browser a stage runs."""
    user: sandbox.StageUser | None
    ok: bool
    detail: str
    agent_browser_path: str | None


def prepare(stage_user_name: str, bridges: BridgeHost, api_gid: int | None) -> tuple[Sandbox, dict[str, Any]]:
    """Stage user (root only), bubblewrap check, bridge sweep. Never fatal: where the sandbox
    cannot be built, stage-exec is refused with the reason and everything else works. Returns
    the state and the start report's `sandbox` part."""
    user = None
    detail = ""
    try:
        if os.geteuid() == 0:
            user = sandbox.ensure_stage_user(stage_user_name)
        ok, detail = sandbox.probe(user)
    except sandbox.SandboxError as exc:
        ok, detail = False, str(exc)
    bridges.stage_uid = user.uid if user is not None else None
    bridges.api_gid = api_gid
    swept = bridges.sweep()
    if not ok:    # `sfguard start` prints the state in its banner; only a problem is logged
        log.warning("stage sandbox: %s", detail)
    state = Sandbox(user, ok, detail, tools.find_agent_browser().path)
    return state, {"ok": ok, "detail": detail, "bridges_swept": swept,
                   "stage_user": user.name if user else None}


#: stage-exec's fast entry: the same command as `sfguard stage-exec`, started by this guard's
#: Python in isolated mode without site-packages (about 60 ms less per stage under load than
#: the console script, whose site start-up dominates; see bench/stage_exec_bench.py), and by
#: absolute path, so it does not depend on the runner's PATH. A script of a few lines that
#: imports cli/stage_exec_cmd.py: Python compiles the script it runs on every start, an
#: imported module comes from its cached bytecode.
#: supervisor/daemon/ -> the folder holding cli/ (the checkout, or the installed sfguard package)
FAST_ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "cli", "stage_exec_entry.py")


class StageExecService:
    """Stage-exec's state and answers: built with the folders it hides, the gate and the
    bridges; `prepare()` at start records the sandbox check (until then stage-exec is refused)."""

    def __init__(self, *, home: Path, runtime: Path, gate: CdpGate, bridges: BridgeHost):
        self.home, self.runtime, self.gate, self.bridges = home, runtime, gate, bridges
        self.sandbox = Sandbox(None, False, "not checked yet", None)

    def prepare(self, stage_user_name: str, api_gid: int | None) -> dict[str, Any]:
        """The start-up check (see `prepare`); returns the start report's `sandbox` part."""
        self.sandbox, report = prepare(stage_user_name, self.bridges, api_gid)
        return report

    def exec_prefix(self, run_id: str, stage_id: str) -> list[str]:
        return [sys.executable, "-I", "-S", FAST_ENTRY, "--home", str(self.home), "--run", run_id,
                "--stage", stage_id, "--"]

    def pinned_tab(self, stage: Stage) -> str | None:
        """The tab the guard's session of the stage is bound to (its pin record), while the stage
        still has it at the gate; None otherwise."""
        full = stage.env_full or {}
        session, socket_dir = full.get("AGENT_BROWSER_SESSION"), full.get("AGENT_BROWSER_SOCKET_DIR")
        if not session or not socket_dir or not stage.gate_key:
            return None
        tab = agent_browser.pinned_target(socket_dir, session)
        try:
            owned = self.gate.stage_targets(stage.gate_key)
        except GateError:
            return None
        return tab if tab in owned else None

    def exec_answer(self, run: Run, stage: Stage) -> dict[str, Any]:
        if stage.state == StageState.ENDED:
            raise Conflict("stage_ended", f"stage {stage.stage_id!r} of run {run.run_id!r} has "
                           f"ended ({stage.outcome}); its gate and proxy are closed", "stage_id")
        if stage.state == StageState.FAILED:
            raise Conflict("stage_failed", f"stage {stage.stage_id!r} has no browser "
                           "(its request failed)", "stage_id")
        bridges = self.bridges.get(stage.gate_key or "") if stage.state == StageState.READY else None
        if stage.state != StageState.READY or bridges is None:
            raise Conflict("stage_not_ready", f"stage {stage.stage_id!r} is {stage.state}: "
                           "request it until it is ready, then run stage-exec", "stage_id")
        box = self.sandbox
        if not box.ok:
            raise Conflict("sandbox_unavailable", "this machine cannot build the stage sandbox "
                           f"({box.detail}); stage-exec refuses to run a stage unconfined")
        env = dict(stage.env or {})
        env["AGENT_BROWSER_SOCKET_DIR"] = sandbox.INSIDE_SOCKET_DIR
        env["AGENT_BROWSER_CONFIG"] = sandbox.INSIDE_CONFIG
        for var in PROXY_VARS:
            env[var] = bridges.proxy_url
        # agent-browser falls back to HTTP(S)_PROXY/ALL_PROXY and, seeing a credential, installs
        # browser-wide network controls the gate refuses (measured on 0.41.2); set empty, it keeps
        # to the gate and the anchor's own proxy.
        env["AGENT_BROWSER_PROXY"] = ""
        return {
            "tab": self.pinned_tab(stage),
            "run_id": run.run_id, "stage_id": stage.stage_id, "attempt": stage.attempt,
            "env": env,
            "bridges": bridges.describe(),
            "hide": [str(self.home), str(self.runtime), str(self.bridges.root)],
            "run_as": box.user.to_json() if box.user is not None else None,
            "agent_browser": box.agent_browser_path,
        }
