"""The guard daemon: runs, stages, anchors, per-run proxies, leases, teardown and sweep.

One `Guard` per home. It answers the control API (supervisor/daemon/api.py calls the `api_*`
coroutines) and owns every browser it starts:

  run ──┬─ one guard proxy (a `sfguard proxy` child process, its own port and clients file)
        ├─ one anchor per profile (leased, unsealed, launched through the proxy)
        │    └─ one tab + one CDP-gate token per stage
        └─ one throw-away browser per profile-less stage

Teardown has one path per level: `_end_stage(stage, outcome)` and `_end_run(run, outcome)`.
Every step runs even when an earlier one failed; failures are collected and reported.
A run record without secrets (`runs/<id>.json`) lists what the run started, so that
`sweep()` can clean up after a crash of the daemon.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfguard import policy
from sfguard.supervisor import redaction
from sfguard.supervisor.browsers import agent_browser, browser_user, tools
from sfguard.supervisor.browsers.handoff import HandoffImpossible, LocalWindowHandoff
from sfguard.supervisor.browsers.host import Anchor, AnchorError, AnchorSpec, LocalBrowserHost
from sfguard.supervisor.browsers.login import LoginCheckError, LoginResult, check_login
from sfguard.supervisor.console import handoff as live
from sfguard.supervisor.daemon import models
from sfguard.supervisor.daemon.api import ApiError
from sfguard.supervisor.daemon.stage_sessions import StageSessions
from sfguard.supervisor.daemon.sweep import ProcRecord, end_child, scan_orphans, terminate_recorded
from sfguard.supervisor.gate.cdp_gate import CdpGate, GateError
from sfguard.supervisor.home import atomic_write, ensure_home, private_dir, revoke_traverse, runtime_dir, runtime_path
from sfguard.supervisor.profiles import store_ops
from sfguard.supervisor.profiles.lease import current_process, process_alive
from sfguard.supervisor.profiles.local_store import pipeline_profile_name
from sfguard.supervisor.profiles.store_ops import StoreCalls, StoreSlow
from sfguard.supervisor.profiles.stores import open_stores
from sfguard.supervisor.protocols import (
    LOCAL_SCOPE,
    ProcessIdentity,
    ProfileError,
    ProfileKey,
    StoreUnavailable,
    Waiting,
)
from sfguard.supervisor.stage import sandbox, stage_exec
from sfguard.supervisor.stage.stage_bridge import BridgeHost

log = logging.getLogger("sfguard.guard")

PROXY_START_TIMEOUT = 20.0
#: Bound of one login check (its own tab; never affects the anchor or other stages).
LOGIN_CHECK_TIMEOUT = 30.0
#: The whole stage env (docs/design.md 4.3): nothing else reaches a stage.
STAGE_ENV_KEYS = ("AGENT_BROWSER_CDP", "AGENT_BROWSER_SESSION", "AGENT_BROWSER_SOCKET_DIR",
                  "AGENT_BROWSER_PIN_TAB", "AGENT_BROWSER_CONFIG", "AGENT_BROWSER_IDLE_TIMEOUT_MS")
WATCH_INTERVAL = 0.25
#: `status` waits this long for the store's part (leases, queues); then answers without it
STATUS_STORE_WAIT = 2.0
#: a stage answer that may still change; long-poll re-checks it every LONG_POLL_STEP seconds
WAITING_STATES = ("pending", "waiting", "relaunching")
LONG_POLL_STEP = 0.1


def _now_iso(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts if ts is not None else time.time()))


def _holder_where(host: str | None, guard: str | None) -> dict:
    """Where a holder runs, for shared stores (local leases name only the run)."""
    return {"holder_host": host, "holder_guard": guard} if guard else {}


def _short_id() -> str:
    return secrets.token_hex(4)


class GuardAlreadyRunning(Exception):
    pass


# --------------------------------------------------------------------------- per-run proxy

class RunProxy:
    """The guard proxy child of one run (`python -m sfguard.supervisor.daemon.proxy_child`).

    Clients (one per browser, each with its own credentials and allowlist) are sent over the
    child's stdin and acknowledged once live, so an allowlist change is in force before the
    daemon answers; tokens are never in argv, files or logs. If the child dies it is restarted
    on the same port with the same clients, so browsers only ever see connection errors."""

    ACK_TIMEOUT = 10.0

    def __init__(self, run_id: str | None, policy_path: Path, decision_log: Path,
                 resolve: dict[str, str] | None = None):
        self.run_id = run_id
        self.policy_path = policy_path
        self.decision_log = decision_log
        self.resolve = dict(resolve or {})
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.record: ProcRecord | None = None
        self.clients: dict[str, tuple[str, list[str]]] = {}  # name -> (token, allow patterns)
        self.restarts = 0
        self._seq = 0
        self._acks: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def _push(self) -> None:
        """Send the whole client set and wait until the proxy has it live."""
        if self.proc is None or self.proc.returncode is not None:
            return  # the watchdog restarts it with the current set
        async with self._lock:
            self._seq += 1
            fut = asyncio.get_running_loop().create_future()
            self._acks[self._seq] = fut
            msg = {"id": self._seq, "clients": [
                {"name": n, "token": t, "allow": a, "run": self.run_id}
                for n, (t, a) in sorted(self.clients.items())]}
            try:
                self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
                await self.proc.stdin.drain()
                await asyncio.wait_for(fut, self.ACK_TIMEOUT)
            except (TimeoutError, ConnectionError) as exc:
                raise RuntimeError(f"the run's guard proxy did not take the new allowlist ({type(exc).__name__})") from None
            finally:
                self._acks.pop(self._seq, None)

    async def add_client(self, allow: list[str]) -> str:
        name = f"b-{_short_id()}"
        token = secrets.token_urlsafe(24)
        redaction.register_secret(token)
        self.clients[name] = (token, sorted(set(allow)))
        await self._push()
        return name

    async def set_allow(self, name: str, allow: list[str]) -> None:
        token, old = self.clients[name]
        new = sorted(set(allow))
        if new != old:
            self.clients[name] = (token, new)
            await self._push()

    async def remove_client(self, name: str) -> None:
        if self.clients.pop(name, None) is not None:
            await self._push()

    def url_for(self, name: str) -> str:
        return f"http://{name}:{self.clients[name][0]}@127.0.0.1:{self.port}"

    async def start(self) -> None:
        argv = [sys.executable, "-m", "sfguard.supervisor.daemon.proxy_child", "--listen-port", str(self.port),
                "--policy", str(self.policy_path), "--decision-log", str(self.decision_log)]
        for host, ip in self.resolve.items():
            argv += ["--resolve", f"{host}={ip}"]
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "HOME", "LANG", "TMPDIR", "SFGUARD_HOME", "PYTHONPATH")}
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=None, env=env, start_new_session=True)
        self.record = ProcRecord.of(self.proc.pid, "proxy")
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), PROXY_START_TIMEOUT)
        except TimeoutError:
            line = b""
        text = line.decode(errors="replace").strip()
        if not text.startswith("ready http://127.0.0.1:"):
            await self.stop()
            raise RuntimeError("the run's guard proxy did not start")
        self.port = int(text.rsplit(":", 1)[1])
        self._reader = asyncio.get_running_loop().create_task(self._read_acks(self.proc))
        if self.clients:
            await self._push()

    async def _read_acks(self, proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(Exception):
            while line := await proc.stdout.readline():
                msg = json.loads(line)
                fut = self._acks.get(msg.get("ack"))
                if fut is not None and not fut.done():
                    fut.set_result(True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and (
            self.record is None or self.record.alive())

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if proc is None:
            return
        await end_child(proc, 5)


# --------------------------------------------------------------------------- state

@dataclass
class Browser:
    """An anchor (profile) or a throw-away browser, with its proxy client."""
    key: str                                  # profile name, or "tmp-<stage>" for throw-aways
    profile: ProfileKey | None
    headed: bool
    client: str
    anchor: Anchor | None = None
    stages: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restarts: int = 0
    closing: bool = False          # being closed: the watchdog must not restart it


@dataclass
class Stage:
    run_id: str
    stage_id: str
    attempt: int
    browser_req: models.BrowserField
    headed: bool
    state: str = "pending"                    # waiting | ready | ended | failed
    browser_key: str | None = None
    gate_key: str | None = None
    env_full: dict[str, str] | None = None    # with inherited vars; used to close the session
    env: dict[str, str] | None = None         # what the stage gets
    waiting: Waiting | None = None
    store_wait: str | None = None             # why it waits when no holder is known (store away)
    outcome: str | None = None
    error: ApiError | None = None
    processes: list[ProcRecord] = field(default_factory=list)  # the stage session's daemon
    events: list[dict] = field(default_factory=list)  # what happened to it (browser restarts)

    def answer(self) -> tuple[int, dict]:
        if self.state == "ready":
            return 200, {"state": "ready", "env": self.env}
        if self.state == "waiting" and self.waiting is not None:
            w = self.waiting
            since = w.holder_since if w.holder_since is not None else w.queued_since
            return 202, {"state": "waiting", "holder_run": w.holder_run or "", "since": _now_iso(since),
                         "position": w.position, **_holder_where(w.holder_host, w.holder_guard)}
        if self.state == "waiting" and self.store_wait is not None:
            return 202, {"state": "waiting", "holder_run": "", "since": _now_iso(), "position": None,
                         "reason": "store_unreachable", "message": self.store_wait}
        if self.state in ("pending", "waiting", "relaunching"):
            return 202, {"state": "waiting", "holder_run": "", "since": _now_iso(), "position": None}
        if self.state == "failed" and self.error is not None:
            raise self.error
        return 200, {"state": "ended", "outcome": self.outcome or ""}


@dataclass
class Run:
    run_id: str
    pipeline: str | None
    created: float
    state: str = "active"
    outcome: str | None = None
    stages: dict[str, Stage] = field(default_factory=dict)
    browsers: dict[str, Browser] = field(default_factory=dict)
    proxy: RunProxy | None = None
    workdir: Path | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    problems: list[str] = field(default_factory=list)
    login_results: dict[str, LoginResult] = field(default_factory=dict)  # profile -> last check

    def public(self) -> dict:
        """The run as API answers and run state show it: names and states, no secrets."""
        return {
            "run_id": self.run_id, "state": self.state, "outcome": self.outcome,
            "created": _now_iso(self.created), "pipeline": bool(self.pipeline),
            "stages": [{"stage_id": s.stage_id, "attempt": s.attempt, "state": s.state,
                        "profile": s.browser_req.profile, "outcome": s.outcome,
                        "holder_run": s.waiting.holder_run if s.state == "waiting" and s.waiting else None,
                        "events": list(s.events)}
                       for s in self.stages.values()],
            "browsers": [{"profile": b.profile.name if b.profile else None, "throwaway": b.profile is None,
                          "headed": b.headed, "alive": b.anchor is not None, "stages": sorted(b.stages),
                          "restarts": b.restarts} for b in self.browsers.values()],
            "proxy": None if self.proxy is None else {"port": self.proxy.port, "alive": self.proxy.alive(),
                                                       "restarts": self.proxy.restarts},
            "problems": list(self.problems),
        }


# --------------------------------------------------------------------------- the guard

class Guard:
    def __init__(self, home: Path, policy_path: Path | None = None, *,
                 resolve: dict[str, str] | None = None, scope: str = LOCAL_SCOPE,
                 store: str | None = None):
        self.home = ensure_home(home)
        # named here, created by start (a guard that is refused before it starts, or only
        # sweeps, leaves no empty folder in /dev/shm)
        self.runtime = runtime_path(self.home)
        self.scope = scope
        self.policy_path = Path(policy_path or policy.default_policy_path()).absolute()
        self.policy_watch = policy.PolicyWatcher(self.policy_path)  # raises PolicyError if invalid
        self.resolve = dict(resolve or {})
        # the local home, or a shared PostgreSQL (`--store` / $SFGUARD_STORE): supervisor/profiles/stores.py
        self.stores = open_stores(self.home, self.runtime, store)
        self.keys, self.store = self.stores.keys, self.stores.store
        self.lease, self.audit = self.stores.lease, self.stores.audit
        # seam calls run off the event loop (supervisor/profiles/store_ops.py)
        self.calls = StoreCalls(getattr(self.stores.backend, "pool_size", 1))
        self.host = LocalBrowserHost()
        self.browser_tool = tools.find_browser()
        self.gate = CdpGate(on_refusal=self._on_refusal)
        self.runs: dict[str, Run] = {}
        self.runs_dir = private_dir(self.home / "runs")
        self.logs_dir = private_dir(self.home / "logs")
        self.config_path = self.runtime / "ab-config.json"
        self.socket_dir = self.runtime / "ab"
        # stage sessions, and one started ahead per shared anchor (supervisor/daemon/stage_sessions.py)
        self.sessions = StageSessions(self.gate, self.host, self.socket_dir, self.config_path,
                                      STAGE_ENV_KEYS)
        self._lock_fd: int | None = None
        self._watch: asyncio.Task | None = None
        self._refusals: dict[str, int] = {}
        self._spare: RunProxy | None = None      # a started proxy child not yet given to a run
        self._spare_task: asyncio.Task | None = None
        self._stopping = False
        self.started = time.time()
        # stage-exec (layer 3): per-stage bridges, the stage user and the sandbox check
        self.bridges = BridgeHost(self.runtime)
        self.stage_user_name = "sfguard-stage"
        self.stage_user = None
        self.api_gid: int | None = None
        self.sandbox_ok, self.sandbox_detail = False, "not checked yet"
        # layer 2: under root, browsers run as this unprivileged user (supervisor/browsers/browser_user.py)
        self.browser_user_name = browser_user.DEFAULT_BROWSER_USER
        self.browser_user: browser_user.BrowserUser | None = None
        # the operator console (supervisor/console), set by `sfguard start` unless --no-console
        self.console = None

    # -- lifecycle -------------------------------------------------------------------------
    def acquire_instance_lock(self) -> None:
        fd = os.open(self.home / "guard.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GuardAlreadyRunning(
                f"another sfguard is already running on {self.home} (one guard per home)") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    async def start(self) -> dict:
        self.acquire_instance_lock()
        try:
            return await self._start()
        except BaseException:
            # a start that fails half-way leaves nothing: no gate, spare proxy, bridge folder
            # or runtime folder (this guard holds the lock, so they are its own)
            with contextlib.suppress(Exception):
                await self.stop()
            raise

    async def _start(self) -> dict:
        runtime_dir(self.home)
        private_dir(self.socket_dir)
        browser_user.setup(self)   # before the sweep: it ends that user's orphans too
        report = sweep(self)
        # damaged state is reported, never silently reset
        audit = self.audit.verify()
        if not audit.ok:
            log.error("the audit log does not verify: %s; it is kept as it is "
                      "(see `sfguard audit verify`)", audit)
            report["audit"] = str(audit)
        for info in self.store.list(self.scope):
            try:
                self.store.verify(info.key)
            except ProfileError as exc:
                log.error("profile %s: the sealed file is refused (%s); it is kept, and runs "
                          "that ask for it get an error", info.key.name, exc)
                report.setdefault("damaged_profiles", []).append(info.key.name)
        agent_browser.write_pinned_config(self.config_path)
        report["sandbox"] = stage_exec.prepare(self)
        await self.gate.start()
        self._watch = asyncio.get_running_loop().create_task(self._watchdog())
        self._refill_spare()
        return report

    async def stop(self) -> None:
        """Tear every run down as `abandoned`, then stop the gate."""
        if self._watch:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        self._stopping = True
        await live.close_all(self)
        for run in list(self.runs.values()):
            if run.state == "active":
                await self._end_run(run, "abandoned")
        await self.sessions.drop_all()
        if self._spare_task is not None:
            with contextlib.suppress(Exception):
                await self._spare_task
        if self._spare is not None:
            await self._spare.stop()
            self._spare = None
        await self.bridges.close_all()
        await self.gate.stop()
        self._flush_refusals()
        self.calls.close()
        release_runtime(self)
        revoke_traverse(self.runtime)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.stores.close()

    @property
    def site_policy(self) -> policy.SitePolicy:
        """The policy in force: the last good one (an invalid edit is reported, not applied).
        The run proxies watch the same file themselves."""
        return self.policy_watch.policy

    @property
    def policy_error(self) -> str | None:
        err = self.policy_watch.error
        return str(err).replace("\n", "; ") if err is not None else None

    def _check_policy(self) -> None:
        before = self.policy_watch.error
        if self.policy_watch.check():
            digest = hashlib.sha256(self.policy_path.read_bytes()).hexdigest()
            self.calls.submit("the audit record of a policy reload", self.audit.record,
                              "policy_reloaded", mode=self.site_policy.mode, policy_sha256=digest)
            log.info("site policy reloaded from %s", self.policy_path)
        elif self.policy_watch.error is not None and self.policy_watch.error is not before:
            log.error("site policy edit refused, the last good policy stays in force: %s",
                      self.policy_error)

    def host_tool_report(self) -> tuple[str, str]:
        ab = tools.find_agent_browser()
        fmt = lambda t: f"{t.version} at {t.path}" if t.found else f"MISSING ({t.source}; {t.hint})"
        return fmt(ab), fmt(self.browser_tool)

    # -- helpers -----------------------------------------------------------------------------
    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise ApiError(404, "run_not_found", f"no run {run_id!r} on this guard", "run_id")
        return run

    def _active_run(self, run_id: str) -> Run:
        run = self._run(run_id)
        if run.state != "active":
            raise ApiError(409, "run_ended", f"run {run_id!r} has ended ({run.outcome})", "run_id")
        return run

    def _profile_key(self, run: Run, name: str) -> ProfileKey:
        if name == models.PIPELINE_PROFILE:
            if not run.pipeline:
                raise ApiError(400, "no_pipeline", "profile '@pipeline' needs a run created with "
                               "a pipeline path", "browser.profile")
            name = pipeline_profile_name(run.pipeline)
        return ProfileKey(self.scope, name)

    def _save_record(self, run: Run) -> None:
        """The crash record: what to clean if this daemon dies. No secrets."""
        procs: list[dict] = []
        paths: list[str] = [str(run.workdir)] if run.workdir else []
        unsealed: list[str] = []
        for b in run.browsers.values():
            if b.anchor is not None:
                procs += [p.to_json() for p in b.anchor.processes]
                if b.anchor.temp_profile:
                    paths.append(str(b.anchor.profile_dir))
            if b.profile is not None:
                unsealed.append(b.profile.name)
        spare_sessions: list[str] = []
        for b in run.browsers.values():
            if b.anchor is not None:   # a session started ahead for the anchor's next stage
                spare_procs, spare_sessions_b = self.sessions.spare_records(b.anchor)
                procs += [p.to_json() for p in spare_procs]
                spare_sessions += spare_sessions_b
        for st in run.stages.values():
            if st.state == "ready":
                procs += [p.to_json() for p in st.processes]
        if run.proxy and run.proxy.record:
            procs.append(run.proxy.record.to_json())
        rec = {"run_id": run.run_id, "daemon": {"pid": os.getpid(), "start_time": current_process().start_time},
               "scope": self.scope, "processes": procs, "paths": paths, "profiles": sorted(set(unsealed)),
               "sessions": [s.env["AGENT_BROWSER_SESSION"] for s in run.stages.values()
                            if s.env and s.state == "ready"] + spare_sessions}
        atomic_write(self.runs_dir / f"{run.run_id}.json", json.dumps(rec).encode())

    def _on_refusal(self, stage_key: str, method: str, reason: str) -> None:
        self._refusals[method] = self._refusals.get(method, 0) + 1
        line = {"ts": _now_iso(), "stage": stage_key, "method": method, "decision": "deny",
                "reason": reason, "source": "cdp_gate"}
        with open(self.logs_dir / "decisions.log", "a", opener=lambda p, f: os.open(p, f, 0o600)) as fh:
            fh.write(json.dumps(line) + "\n")

    def _flush_refusals(self) -> None:
        if self._refusals:
            total = sum(self._refusals.values())
            self.calls.submit("the audit record of aggregated denials", self.audit.record,
                              "denials_aggregated", count=total, reason="cdp_gate")
            self._refusals.clear()

    def _effective_headed(self, req: models.BrowserField) -> bool:
        if not req.headed:
            return False
        if tools.display_available():
            return True
        if "headed" in req.model_fields_set:
            where = ("; the guard runs inside a container, where a visible window is not possible"
                     if tools.in_container() else "")
            raise ApiError(400, "no_display", "headed: true needs a display, but neither DISPLAY nor "
                           f"WAYLAND_DISPLAY is set{where}; set headed: false for this stage or run "
                           "the guard in a desktop session", "browser.headed")
        return False  # default headed, but no display: headless

    # -- API: runs ---------------------------------------------------------------------------
    async def api_create_run(self, body: models.CreateRun) -> tuple[int, Any]:
        if body.run_id in self.runs:
            raise ApiError(409, "run_exists", f"run {body.run_id!r} already exists", "run_id")
        run = Run(body.run_id, body.pipeline, time.time())
        self.runs[run.run_id] = run
        log.info("run %s created", run.run_id)
        return 201, {"run_id": run.run_id, "state": run.state}

    async def api_get_run(self, run_id: str) -> tuple[int, Any]:
        return 200, self._run(run_id).public()

    async def api_end_run(self, run_id: str, body: models.RunEnd) -> tuple[int, Any]:
        run = self._run(run_id)
        if run.state != "active":
            return 200, {"ok": True, "outcome": run.outcome, "problems": run.problems}
        await self._end_run(run, body.outcome)
        return 200, {"ok": not run.problems, "outcome": run.outcome, "problems": run.problems}

    # -- API: stages -------------------------------------------------------------------------
    async def api_request_stage(self, run_id: str, body: models.StageRequest) -> tuple[int, Any]:
        run = self._active_run(run_id)
        existing = run.stages.get(body.stage_id)
        if existing is not None and existing.state not in ("ended",):
            if existing.attempt == body.attempt and existing.browser_req == body.browser:
                return self._stage_answer(run, existing)  # resume: the identical answer
            raise ApiError(409, "stage_active", f"stage {body.stage_id!r} is active with attempt "
                           f"{existing.attempt}; end it first", "stage_id")
        if existing is not None and body.attempt <= existing.attempt:
            raise ApiError(409, "attempt_used", f"attempt {body.attempt} of stage {body.stage_id!r} "
                           "has ended; use a new attempt number", "attempt")
        headed = self._effective_headed(body.browser)
        if body.browser.profile is not None:
            self._profile_key(run, body.browser.profile)  # validate now (400 on bad input)
        stage = Stage(run_id, body.stage_id, body.attempt, body.browser, headed)
        run.stages[body.stage_id] = stage
        await self._advance(run, stage)
        return self._stage_answer(run, stage)

    async def api_get_stage(self, run_id: str, stage_id: str, wait: float = 0.0) -> tuple[int, Any]:
        run = self._run(run_id)
        stage = run.stages.get(stage_id)
        if stage is None:
            raise ApiError(404, "stage_not_found", f"no stage {stage_id!r} in run {run_id!r}", "stage_id")
        # long-poll (?wait=, at most api.MAX_WAIT): hold a waiting answer until it changes
        deadline = time.monotonic() + wait
        while stage.state in WAITING_STATES and run.state == "active" and time.monotonic() < deadline:
            await asyncio.sleep(min(LONG_POLL_STEP, max(deadline - time.monotonic(), 0)))
        return self._stage_answer(run, stage)

    def _stage_answer(self, run: Run, stage: Stage) -> tuple[int, Any]:
        status, answer = stage.answer()
        if answer.get("state") == "ready":
            answer = {**answer, "exec_prefix": stage_exec.exec_prefix(self, run.run_id, stage.stage_id)}
        return status, answer

    async def api_stage_exec(self, run_id: str, stage_id: str) -> tuple[int, Any]:
        run = self._run(run_id)
        stage = run.stages.get(stage_id)
        if stage is None:
            raise ApiError(404, "stage_not_found", f"no stage {stage_id!r} in run {run_id!r}", "stage_id")
        return 200, stage_exec.exec_answer(self, run, stage)

    async def api_cancel_stage(self, run_id: str, stage_id: str) -> tuple[int, Any]:
        """DELETE of a waiting stage request: it leaves the profile's queue and ends cancelled."""
        run = self._run(run_id)
        stage = run.stages.get(stage_id)
        if stage is None:
            raise ApiError(404, "stage_not_found", f"no stage {stage_id!r} in run {run_id!r}", "stage_id")
        async with run.lock:
            if stage.state in ("ended", "failed"):
                return 200, {"state": "ended", "outcome": stage.outcome or "failed"}
            if stage.state not in WAITING_STATES:
                raise ApiError(409, "stage_not_waiting", f"stage {stage_id!r} is {stage.state}, not "
                               "waiting: end it with POST .../end", "stage_id")
            stage.state, stage.outcome = "ended", "cancelled"
            profile = stage.browser_req.profile
            others = [s for s in run.stages.values() if s is not stage and s.state in WAITING_STATES
                      and s.browser_req.profile == profile]
            if profile is not None and not others:
                key = self._profile_key(run, profile)

                def leave_queue() -> None:
                    holder = self.lease.holder(key)
                    if holder is None or holder.run != run.run_id:
                        self.lease.release(key, run.run_id)   # the queue only (never a held lease)
                with contextlib.suppress(StoreUnavailable):  # away: its queue place lapses with
                    await self.calls.run(leave_queue)        # this guard's, or goes at run end
        log.info("stage %s/%s left the queue", run_id, stage_id)
        for other in list(self.runs.values()):   # the places behind it move up now
            if other.state == "active":
                for st in list(other.stages.values()):
                    if st.state == "waiting":
                        await self._advance(other, st)
        return 200, {"state": "ended", "outcome": "cancelled"}

    async def api_end_stage(self, run_id: str, stage_id: str, body: models.StageEnd) -> tuple[int, Any]:
        run = self._run(run_id)
        stage = run.stages.get(stage_id)
        if stage is None:
            raise ApiError(404, "stage_not_found", f"no stage {stage_id!r} in run {run_id!r}", "stage_id")
        problems = await self._end_stage(run, stage, body.outcome)
        return 200, {"ok": not problems, "problems": problems}

    # -- API: status and profiles -------------------------------------------------------------
    def _lease_table(self) -> list[dict]:
        leases = []
        for info in self.store.list(self.scope):
            holder = self.lease.holder(info.key)
            queue = self.lease.queue(info.key)
            leases.append({"profile": info.key.name, "holder_run": holder.run if holder else None,
                           "since": _now_iso(holder.since) if holder else None,
                           "queue": [{"run": q.run, "since": _now_iso(q.since)} for q in queue],
                           **_holder_where(holder and holder.host, holder and holder.guard)})
        return leases

    async def api_status(self) -> tuple[int, Any]:
        # the store's part is bounded: with the database away, status still answers at once
        store_error = None
        try:
            leases = await self.calls.bounded(STATUS_STORE_WAIT, self._lease_table)
        except (StoreUnavailable, StoreSlow) as exc:
            leases, store_error = [], str(exc)
        return 200, {
            "guard": {"pid": os.getpid(), "since": _now_iso(self.started), "home": str(self.home),
                      "key_provider": self.keys.describe(), "scope": self.scope,
                      "store": self.stores.shown, "store_error": store_error},
            "policy": {"file": str(self.policy_path), "mode": self.site_policy.mode,
                       "state": "error" if self.policy_error else "ok", "error": self.policy_error},
            "runs": [r.public() for r in self.runs.values()],
            "leases": leases,
            "console": {"url": self.console.base_url} if self.console is not None else None,
        }

    async def api_list_profiles(self) -> tuple[int, Any]:
        def listing() -> list[dict]:
            out = []
            for info in self.store.list(self.scope):
                holder = self.lease.holder(info.key)
                out.append({"name": info.key.name, "scope": info.key.scope,
                            "created": _now_iso(info.created),
                            "last_used": _now_iso(info.last_used) if info.last_used else None,
                            "size": info.size, "leased_by": holder.run if holder else None,
                            "identity": info.identity})
            return out
        return 200, {"profiles": await self._store_call(listing)}

    async def _store_call(self, fn, *args, **kw):
        """A seam call off the event loop; the database away is a 503 the caller can retry."""
        try:
            return await self.calls.run(fn, *args, **kw)
        except StoreUnavailable as exc:
            raise ApiError(503, "store_unreachable", str(exc), None) from None

    async def api_delete_profile(self, name: str) -> tuple[int, Any]:
        try:
            key = ProfileKey(self.scope, name)
        except ProfileError as exc:
            raise ApiError(400, "invalid_name", str(exc), "name") from None
        holder = await self._store_call(self.lease.holder, key)
        if holder is not None:
            raise ApiError(409, "profile_leased", f"profile {name!r} is leased by run {holder.run!r}", "name")
        if not await self._store_call(self.store.exists, key):
            raise ApiError(404, "profile_not_found", f"no profile {name!r}", "name")
        await self._store_call(store_ops.delete_profile, self.stores, key, by="api")
        return 200, {"ok": True}

    # -- API: login check, envelope verification, human handoff --------------------------------
    def _run_allow(self, run: Run, profile: str) -> list[str]:
        """Every allow_domains pattern this run's stages asked for with this profile."""
        out: set[str] = set()
        for st in run.stages.values():
            if st.browser_req.profile == profile:
                out.update(st.browser_req.allow_domains)
        return sorted(out)

    async def _leased_browser(self, run: Run, profile: str, headed: bool) -> Browser:
        key = self._profile_key(run, profile)
        async with run.lock:
            result = await self._store_call(store_ops.grant, self.stores, key, run.run_id)
            if isinstance(result, Waiting):
                raise ApiError(409, "profile_leased", f"profile {key.name!r} is leased by run "
                               f"{result.holder_run!r}; this run is queued", "profile")
            try:
                return await self._ensure_anchor(run, key, headed)
            except (AnchorError, GateError, ProfileError, RuntimeError, OSError) as exc:
                # the same answer as a stage request whose browser fails (never a 500)
                raise ApiError(409 if isinstance(exc, ProfileError) else 503, "browser_failed",
                               f"could not start the browser of profile {key.name!r}: {exc}",
                               "profile") from None
            finally:
                self._save_record(run)

    async def api_login_check(self, run_id: str, body: models.LoginCheckRequest) -> tuple[int, Any]:
        run = self._active_run(run_id)
        from urllib.parse import urlsplit
        parts = urlsplit(body.login_check.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        allow = self._run_allow(run, body.profile)
        decision = self.site_policy.decide(parts.hostname or "", port, policy.compile_patterns(allow))
        if not decision.allowed:
            raise ApiError(403, "login_check_not_allowed", f"the check address's host is refused "
                           f"for this run: {decision.explanation}", "login_check.url")
        browser = await self._leased_browser(run, body.profile, headed=False)
        check_pattern = policy.allow_pattern_for_url(body.login_check.url)
        try:
            await run.proxy.set_allow(browser.client, self._browser_allow(run, browser) + [check_pattern])
            # its own tab and window, its own bound; a failed check leaves the anchor as it was
            result = await check_login(browser.anchor.pipe, body.login_check,
                                       timeout=LOGIN_CHECK_TIMEOUT)
        except LoginCheckError as exc:
            raise ApiError(422, "login_check_failed", str(exc), "login_check") from None
        except ValueError as exc:
            raise ApiError(400, "invalid_pattern", str(exc), "login_check") from None
        finally:
            if browser.client in run.proxy.clients:
                await run.proxy.set_allow(browser.client, self._browser_allow(run, browser))
        run.login_results[body.profile] = result

        def record_check() -> None:
            self.audit.record("login_checked", scope=self.scope, profile=browser.key,
                              run=run.run_id, host=decision.normalized_host,
                              logged_in=result.logged_in,
                              result="logged_in" if result.logged_in else "logged_out")
            note = getattr(self.store, "record_login_check", None)  # shared: a fenced state write
            if note is not None:
                with contextlib.suppress(ProfileError):  # a stale lease is refused and logged there
                    note(browser.profile, result.logged_in)
        await self._store_call(record_check)
        return 200, {"logged_in": result.logged_in, "url": result.url}

    async def api_login_verify(self, run_id: str, body: models.LoginVerifyRequest) -> tuple[int, Any]:
        run = self._run(run_id)
        mine = run.login_results.get(body.profile)
        if mine is None:
            raise ApiError(409, "no_login_check", f"the guard has not checked profile "
                           f"{body.profile!r} in this run; call login-check first", "profile")
        for field_name in ("logged_in", "url"):
            theirs, ours = getattr(body.reported, field_name), getattr(mine, field_name)
            if theirs != ours:
                raise ApiError(409, "envelope_mismatch",
                               f"the stage reported {field_name}={theirs!r} but the guard's own check "
                               f"found {field_name}={ours!r}", f"reported.{field_name}")
        return 200, {"ok": True}

    async def api_handoff(self, run_id: str, body: models.HandoffRequest) -> tuple[int, Any]:
        run = self._active_run(run_id)
        if live.wants_live_view(self, body):   # no screen here: a live view in the console
            return await live.open_live(self, run, body)
        handoff = LocalWindowHandoff()
        try:
            handoff.check_possible(profile=body.profile, url=body.url)
        except HandoffImpossible as exc:
            raise ApiError(409, "handoff_impossible", str(exc), None) from None
        browser = await self._leased_browser(run, body.profile, headed=True)
        if not browser.headed:  # reopen the anchor headed, same profile, same proxy client
            async with browser.lock:
                await self.host.close_anchor(browser.anchor)
                browser.headed = True
                browser.anchor = await self._launch(run, browser, browser.anchor.profile_dir)
                await self._reattach(run, browser)
        if body.url:
            from urllib.parse import urlsplit
            host = urlsplit(body.url).hostname or ""
            await run.proxy.set_allow(browser.client, self._browser_allow(run, browser) + [host])
            try:
                await browser.anchor.pipe.call("Target.createTarget", {"url": body.url, "newWindow": True})
            except Exception as exc:
                raise ApiError(503, "browser_failed", f"could not open the page in the browser "
                               f"({type(exc).__name__})", None) from None
        await self._store_call(self.audit.record, "handoff_opened", scope=self.scope,
                               profile=browser.key, run=run.run_id, host=body.site)
        return 200, handoff.payload(site=body.site, reason=body.reason, url=body.url).model_dump()

    async def api_handoff_state(self, run_id: str, wait: float = 0.0) -> tuple[int, Any]:
        return await live.state(self, run_id, wait)

    async def api_console_link(self, body: models.ConsoleLinkRequest) -> tuple[int, Any]:
        if self.console is None:
            raise ApiError(409, "console_off", "the guard runs without its console (--no-console)", None)
        return 200, self.console.login_link(body.ttl_s)

    # -- the stage state machine ---------------------------------------------------------------
    async def _advance(self, run: Run, stage: Stage) -> None:
        """Move a pending/waiting stage forward: lease, browser, gate token, env."""
        try:
            async with run.lock:
                if stage.state in ("ready", "ended", "failed") or run.state != "active":
                    return
                req = stage.browser_req
                if req.profile is not None:
                    key = self._profile_key(run, req.profile)
                    try:
                        result = await self.calls.run(store_ops.grant, self.stores, key, run.run_id)
                    except StoreUnavailable as exc:   # shared store away: no grant now, ask again
                        stage.state, stage.waiting = "waiting", None
                        stage.store_wait = (f"{exc}; the guard asks again and grants the profile "
                                            "when the database answers")
                        return
                    stage.store_wait = None
                    if isinstance(result, Waiting):
                        stage.state, stage.waiting = "waiting", result
                        return
                    browser = await self._ensure_anchor(run, key, stage.headed)
                else:
                    browser = await self._throwaway(run, stage)
                await self._attach_stage(run, browser, stage)
        except ApiError as exc:
            stage.state, stage.error = "failed", exc
        except (AnchorError, GateError, ProfileError, RuntimeError, OSError) as exc:
            log.warning("stage %s/%s could not get a browser: %s", run.run_id, stage.stage_id, exc)
            stage.state = "failed"
            stage.error = ApiError(409 if isinstance(exc, ProfileError) else 503, "browser_failed",
                                   f"the guard could not start this stage's browser: {exc}", None)
        finally:
            with contextlib.suppress(Exception):
                self._save_record(run)

    async def _ensure_proxy(self, run: Run) -> RunProxy:
        """The run's proxy: the warm spare when one is ready (a proxy child takes ~0.7 s to
        start), else a new one; then a new spare is started in the background."""
        if run.proxy is None:
            run.workdir = private_dir(self.runtime / f"r-{_short_id()}")
            spare, self._spare = self._spare, None
            if spare is not None and spare.alive():
                proxy = spare
            else:
                if spare is not None:
                    await spare.stop()
                proxy = RunProxy(None, self.policy_path, self.logs_dir / "decisions.log", self.resolve)
                await proxy.start()
            proxy.run_id = run.run_id
            run.proxy = proxy
            self._save_record(run)
            self._refill_spare()
        return run.proxy

    def _refill_spare(self) -> None:
        if self._spare is not None:
            return  # one warm spare at most
        if self._spare_task is None or self._spare_task.done():
            self._spare_task = asyncio.get_running_loop().create_task(self._make_spare())

    async def _make_spare(self) -> None:
        proxy = RunProxy(None, self.policy_path, self.logs_dir / "decisions.log", self.resolve)
        try:
            await proxy.start()
        except Exception as exc:
            log.warning("could not start a spare run proxy: %s", exc)
            return
        if self._stopping or self._spare is not None:
            await proxy.stop()   # never overwrite (and so lose) a spare that is still running
        else:
            self._spare = proxy

    def _browser_allow(self, run: Run, browser: Browser) -> list[str]:
        out: set[str] = set()
        for sid in browser.stages:
            st = run.stages.get(sid)
            if st is not None:
                out.update(st.browser_req.allow_domains)
        return sorted(out)

    async def _launch(self, run: Run, browser: Browser, profile_dir: Path | None) -> Anchor:
        proxy = await self._ensure_proxy(run)
        if self.browser_tool.path is None:
            raise RuntimeError("no browser found (install Chromium or set SFGUARD_BROWSER)")
        if self.browser_user is not None:   # downloads land here; the browser user writes them
            browser_user.owned_subdir(run.workdir / "artifacts", self.browser_user)
        spec = AnchorSpec(session=f"sfa-{_short_id()}", socket_dir=self.socket_dir,
                          config_path=self.config_path, browser_path=self.browser_tool.path,
                          profile_dir=profile_dir, proxy_url=proxy.url_for(browser.client),
                          headed=browser.headed, temp_root=run.workdir)
        return await self.host.launch_anchor(spec)

    async def _ensure_anchor(self, run: Run, key: ProfileKey, headed: bool) -> Browser:
        browser = run.browsers.get(key.name)
        if browser is not None and browser.anchor is not None:
            return browser
        proxy = await self._ensure_proxy(run)
        if not await self.calls.run(self.store.exists, key):
            # a profile made for `@pipeline` keeps its workflow identity (PLAT-322): the same
            # on every host, since it depends only on the normalised pipeline path
            identity = (pipeline_profile_name(run.pipeline) if run.pipeline
                        and key.name == pipeline_profile_name(run.pipeline) else None)
            await self.calls.run(store_ops.create_profile, self.stores, key, identity,
                                 run=run.run_id)
        name = await proxy.add_client([])
        browser = Browser(key.name, key, headed, name)
        run.browsers[key.name] = browser
        profile_dir = await self.calls.run(self.store.open, key)
        self._save_record(run)
        try:
            browser.anchor = await self._launch(run, browser, profile_dir)
        except BaseException:
            # a browser that never started changed nothing: drop the working copy (the sealed
            # profile stays as it was) so that the next request can open the profile again
            run.browsers.pop(key.name, None)
            with contextlib.suppress(Exception):
                await self.calls.run(self.store.close, key, save=False)
            with contextlib.suppress(Exception):
                await proxy.remove_client(name)
            raise
        log.info("run %s: anchor for profile %s ready", run.run_id, key.name)
        return browser

    async def _throwaway(self, run: Run, stage: Stage) -> Browser:
        proxy = await self._ensure_proxy(run)
        name = await proxy.add_client([])
        browser = Browser(f"tmp-{stage.stage_id}", None, stage.headed, name)
        run.browsers[browser.key] = browser
        browser.anchor = await self._launch(run, browser, None)
        return browser

    async def _attach_stage(self, run: Run, browser: Browser, stage: Stage) -> None:
        browser.stages.add(stage.stage_id)
        await run.proxy.set_allow(browser.client, self._browser_allow(run, browser))
        stage.browser_key = browser.key
        gate_key = f"{run.run_id}/{stage.stage_id}/{stage.attempt}"
        anchor, artifacts, quota = browser.anchor, run.workdir / "artifacts", self.site_policy.tab_quota
        # The stage's session (a gate token, an agent-browser session through it with the
        # stage's tab pinned and the unauthenticated stream server off): a shared anchor's
        # spare, started ahead, when there is one; else one started now. A shared anchor then
        # starts the spare for its next stage (supervisor/daemon/stage_sessions.py).
        started = await self.sessions.take(anchor, gate_key, quota) if browser.profile else None
        # The next stage's session starts beside this stage's own. Measured on 2 idle cores
        # (supervisor_bench, 5 rounds): beside it, first stage 2.20x a bare launch and second
        # stage 18 ms; after it, 1.72x and 604 ms (the second stage then waits for the spare).
        if browser.profile is not None:
            self.sessions.prestart(run.run_id, anchor, artifacts_dir=artifacts, tab_quota=quota,
                                   on_ready=lambda: run.state != "ended" and self._save_record(run))
        if started is None:
            started = await self.sessions.start(gate_key, anchor, artifacts_dir=artifacts,
                                                tab_quota=quota)
        # The stage's bridges for `sfguard stage-exec` (closed at stage end, like the token).
        try:
            await self.bridges.open(gate_key, started.url, run.proxy, stage.browser_req.allow_domains)
        except BaseException:
            await self.sessions.end(started)
            raise
        stage.gate_key = gate_key
        # The stage gets exactly the docs/design.md 4.3 variables; the guard started the session, and
        # closes it later, with the same ones (plus PATH/HOME...): both sides carry one env.
        stage.env = {k: started.env_full[k] for k in STAGE_ENV_KEYS}
        stage.env_full = dict(started.env_full)
        stage.processes = list(started.processes)
        stage.state, stage.waiting = "ready", None

    # -- teardown: one path per level -----------------------------------------------------------
    async def _end_stage(self, run: Run, stage: Stage, outcome: str) -> list[str]:
        """Close the stage's tabs and session (with its own env), revoke its token, then drop
        its domains from its browser's allowlist; a throw-away browser is closed."""
        problems: list[str] = []
        if stage.state == "ended":
            return problems
        was_ready = stage.state == "ready"
        stage.state, stage.outcome = "ended", outcome
        if stage.gate_key:  # a stage-exec sandbox loses its gate and proxy at once
            await self.bridges.close(stage.gate_key, run.proxy)
        if stage.gate_key and was_ready:
            # 1. the stage's session closes its tab and itself, through its still valid token
            if stage.env_full:
                try:
                    await self.host.close_stage_session(stage.env_full)
                except Exception as exc:
                    log.debug("stage session close: %s", exc)
            # 2. any other tab of the stage, over the raw connection
            with contextlib.suppress(Exception):
                await self.gate.close_stage_tabs(stage.gate_key)
            # 3. only then the token: revoking first would leave a session nobody can close
            await self.gate.revoke(stage.gate_key)
            # in a thread: the event loop also answers every browser's paused requests
            await asyncio.to_thread(terminate_recorded, stage.processes, 3)
        browser = run.browsers.get(stage.browser_key or "")
        if browser is not None:
            browser.stages.discard(stage.stage_id)
            if browser.profile is None:
                problems += await self._close_browser(run, browser)
            elif run.proxy is not None and browser.client in run.proxy.clients:
                try:
                    await run.proxy.set_allow(browser.client, self._browser_allow(run, browser))
                except RuntimeError as exc:
                    problems.append(str(exc))
        with contextlib.suppress(Exception):
            self._save_record(run)
        return problems

    async def _close_browser(self, run: Run, browser: Browser) -> list[str]:
        problems: list[str] = []
        browser.closing = True
        if browser.anchor is not None:
            await self.sessions.drop(browser.anchor)   # a spare no stage took
            try:
                await self.host.close_anchor(browser.anchor)
            except Exception as exc:
                problems.append(f"closing the browser of {browser.key}: {exc}")
                await asyncio.to_thread(terminate_recorded, browser.anchor.processes)
            browser.anchor = None
        if browser.profile is not None:
            try:
                await self.calls.run(self.store.close, browser.profile, save=True)
            except Exception as exc:
                problems.append(f"resealing profile {browser.profile.name} failed: {exc}; "
                                "the previous sealed copy is kept")
                with contextlib.suppress(Exception):
                    await self.calls.run(self.store.close, browser.profile, save=False)
        if run.proxy is not None:
            with contextlib.suppress(RuntimeError):
                await run.proxy.remove_client(browser.client)
        run.browsers.pop(browser.key, None)
        return problems

    async def _end_run(self, run: Run, outcome: str) -> None:
        async with run.lock:
            if run.state != "active":
                return
            run.state, run.outcome = "ending", outcome
        stage_outcome = "succeeded" if outcome == "succeeded" else "cancelled"
        for stage in list(run.stages.values()):
            if stage.state != "ended":
                run.problems += await self._end_stage(run, stage, stage_outcome)
        for browser in list(run.browsers.values()):
            run.problems += await self._close_browser(run, browser)
        if run.proxy is not None:
            await run.proxy.stop()
        _released, problems = await self.calls.run(store_ops.release_run, self.stores,
                                                   run.run_id, outcome)
        run.problems += problems
        if run.workdir is not None:
            shutil.rmtree(run.workdir, ignore_errors=True)
        run.state = "ended"
        with contextlib.suppress(FileNotFoundError):
            (self.runs_dir / f"{run.run_id}.json").unlink()
        # hand the released profiles over at once, not at the next watchdog tick
        for other in list(self.runs.values()):
            if other.state == "active":
                for st in list(other.stages.values()):
                    if st.state == "waiting":
                        asyncio.get_running_loop().create_task(self._advance(other, st))
        self._flush_refusals()
        log.info("run %s ended: %s%s", run.run_id, outcome,
                 f" ({len(run.problems)} problem(s))" if run.problems else "")

    # -- watchdog: waiting stages, dead proxies, dead anchors -----------------------------------
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            try:
                await self._watch_once()
            except Exception:
                log.exception("watchdog pass failed")

    async def _watch_once(self) -> None:
        self._check_policy()
        for run in list(self.runs.values()):
            if run.state != "active":
                continue
            for stage in list(run.stages.values()):
                if stage.state == "waiting":
                    await self._advance(run, stage)
            if run.proxy is not None and run.proxy.proc is not None and not run.proxy.alive():
                log.warning("run %s: guard proxy died; restarting it on the same port", run.run_id)
                run.proxy.restarts += 1
                with contextlib.suppress(Exception):
                    await run.proxy.stop()
                await run.proxy.start()
                self._save_record(run)
            for browser in list(run.browsers.values()):
                if (browser.anchor is not None and not browser.closing and not browser.lock.locked()
                        and not self.host.alive(browser.anchor)):
                    await self._restart_browser(run, browser)

    async def _restart_browser(self, run: Run, browser: Browser) -> None:
        async with browser.lock:
            if browser.closing or run.state != "active":
                return
            log.warning("run %s: browser %s died; restarting it", run.run_id, browser.key)
            dead = browser.anchor
            await self.sessions.drop(dead)
            await asyncio.to_thread(terminate_recorded, dead.processes, 3)
            await dead.pipe.close()
            browser.restarts += 1
            for sid in browser.stages:  # answer 202 until the new env works
                st = run.stages[sid]
                st.events.append({"ts": _now_iso(), "event": "browser_restarted",
                                  "message": "the stage's browser stopped and was restarted: its "
                                  "tabs are gone and its gate URL changed; GET the stage for the "
                                  "new env"})
                if st.state == "ready":
                    st.state = "relaunching"
            browser.anchor = await self._launch(run, browser, dead.profile_dir if browser.profile else None)
            await self._reattach(run, browser)

    async def _reattach(self, run: Run, browser: Browser) -> None:
        """After the browser was replaced: new gate tokens for its stages; the next GET of a
        stage returns the refreshed env."""
        for sid in sorted(browser.stages):
            stage = run.stages[sid]
            if stage.state in ("ready", "relaunching") and stage.gate_key:
                await self.gate.revoke(stage.gate_key)
                # the old session's daemon served the dead browser: end it with its files (a
                # new session is started below), so no agent-browser outlives the guard
                if stage.env_full:
                    with contextlib.suppress(Exception):
                        await self.host.close_stage_session(stage.env_full, graceful=False)
                await asyncio.to_thread(terminate_recorded, stage.processes, 3)
                stage.state = "pending"
                async with run.lock:
                    await self._attach_stage(run, browser, stage)
        self._save_record(run)


# --------------------------------------------------------------------------- sweep

def release_runtime(guard: Guard) -> bool:
    """Remove the guard's runtime folder (memory-backed: sockets, config, throw-away profiles)
    when nothing in it still matters, i.e. no profile is left unsealed (a failed reseal keeps
    its working copy for the next sweep). True when it was removed."""
    if guard.store.unsealed():
        log.error("an unsealed profile is left in the runtime folder; the next start reseals it")
        return False
    shutil.rmtree(guard.runtime, ignore_errors=True)
    return not guard.runtime.exists()


def sweep(guard: Guard) -> dict:
    """Clean what dead runs left: processes (by pid AND start time), session files, temp dirs,
    unsealed profiles (resealed), stale leases. Returns a report of what was done."""
    report: dict[str, Any] = {"runs": [], "processes": 0, "resealed": [], "leases": [], "orphans": 0}
    for path in sorted(guard.runs_dir.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            daemon = rec.get("daemon", {})
            owner = ProcessIdentity(int(daemon["pid"]), float(daemon["start_time"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("run record %s is unreadable (%s); left in place for inspection", path.name, exc)
            report.setdefault("unreadable", []).append(path.name)
            continue
        if process_alive(owner) and owner.pid != os.getpid():
            continue  # a live guard owns it
        records = [ProcRecord.from_json(p) for p in rec.get("processes", [])]
        report["processes"] += len(terminate_recorded(records, timeout=5))
        for sess in rec.get("sessions", []):
            with contextlib.suppress(Exception):
                agent_browser.remove_session_files(guard.socket_dir, sess)
        for p in rec.get("paths", []):
            pp = Path(p)
            if pp.is_relative_to(guard.runtime):
                shutil.rmtree(pp, ignore_errors=True)
        run_id = rec.get("run_id")
        report["runs"].append(run_id)
        try:
            released, problems = store_ops.release_run(guard.stores, run_id, "abandoned")
        except ValueError:
            released, problems = [], []  # a record without a valid run id holds no lease
        for problem in problems:
            log.error("sweep of run %s: %s", run_id, problem)
        report["leases"] += [key.name for key in released]
        path.unlink()
    # processes that carry this guard's runtime paths but no record (e.g. killed mid-launch)
    # ... of the guard's user and of its browser user (`sfguard sweep` looks that one up)
    user = guard.browser_user or (sandbox.lookup_user(guard.browser_user_name)
                                  if os.geteuid() == 0 else None)
    orphans = scan_orphans([str(guard.runtime)], (user.uid,) if user is not None else ())
    report["orphans"] = len(terminate_recorded(orphans, timeout=5))
    for key in guard.store.unsealed():
        try:
            guard.store.close(key, save=True)
            report["resealed"].append(key.name)
        except Exception as exc:
            log.error("profile %s could not be resealed after a crash (%s); the previous sealed "
                      "copy is kept", key.name, exc)
            with contextlib.suppress(Exception):
                guard.store.close(key, save=False)
    for key, run_id in guard.lease.sweep_stale():
        if not store_ops.audited(guard.lease):    # the shared store audits it as it drops it
            guard.audit.record("profile_released", scope=key.scope, profile=key.name,
                               run=run_id, outcome="abandoned")
        report["leases"].append(key.name)
    return report
