"""The runner's side of the control API, for `sfguard profiles check|login` and `sfguard demo`.

Three layers, each usable alone:

* `GuardRun`: one run on a running guard, spoken to over its unix socket with
  `sfguard.supervisor.client.guard_client.GuardClient` exactly like a pipeline runner would: create the run, ask for
  stage browsers, ask the guard for a login check, open a handoff, end stages and the run. API
  errors become `OpError` (message = the guard's own sentence, `code` = its error code).
* `ProfileOps`: the two operator commands. `check()` is a short run `check-<random>` with one
  headless stage on the profile (so the check host is in the run's allow list), one login
  check, then the run ends (the profile is resealed). `open_login_window()` is a run
  `login-<random>` with a headed stage and a `local_window` handoff; the caller waits for the
  person and calls `finish()`.
* `run_demo()`: `sfguard demo`. Starts the fixture login site and a guard of its own, then plays
  the pipeline runner for supervisor/demo/login-pipeline.yaml twice (check, login when needed,
  work) and prints a transcript and a summary. Every process it starts is stopped by pid on
  every exit path.

This module only talks to the guard through its API and starts processes with argv lists; it
never prints a cookie value, a token or a password (cookies are compared by the fixture site's
markers: the first 8 hex digits of sha256(value)).
"""
from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import yaml

from sfguard import policy
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.browser_user import DEFAULT_BROWSER_USER
from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
from sfguard.supervisor.daemon.sweep import end_popen, scan_orphans, terminate_recorded
from sfguard.supervisor.home import resolve_home, runtime_path
from sfguard.supervisor.stage.sandbox import lookup_user

# Package data: installed with the wheel, so the demo runs outside a checkout too.
EXAMPLE_PIPELINE = Path(__file__).resolve().with_name("login-pipeline.yaml")
#: The fixture port written in the example pipeline; the demo runs the site on a free port and
#: rewrites it in a copy of the pipeline.
EXAMPLE_PORT = 8080
#: The fixture site's default login (fixtures/login_server); $SFGUARD_FIXTURE_USER/_PASSWORD
#: override both the site's and the demo's (the demo passes its environment to the site).
FIXTURE_USER, FIXTURE_PASSWORD = "operator", "correct-horse"
STAGE_WAIT_S = 60.0          # a queued stage (profile leased by another run) waits this long
STARTUP_S = 60.0             # fixture site / guard start-up
STOP_S = 60.0                # guard shutdown (closes browsers, reseals) before SIGKILL
AB_TIMEOUT_S = 60.0          # one agent-browser command of the stage side
MAX_LOGIN_ATTEMPTS = 3
LIVE_VIEW_WAIT_S = 900.0     # a person at a live view has this long (the guard's own limit too)


# --------------------------------------------------------------------------- errors

class OpError(Exception):
    """An operation on the guard failed; str() is a sentence for the operator."""

    def __init__(self, message: str, code: str = "error", status: int | None = None):
        super().__init__(message)
        self.code, self.status = code, status


class GuardNotRunning(OpError):
    pass


class HandoffRefused(OpError):
    """The guard cannot show a login window (no display, container); str() names the cause."""


class ProfileBusy(OpError):
    pass


class DemoError(Exception):
    """The demo could not complete; str() says why (no traceback for the user)."""


# --------------------------------------------------------------------------- one run

def host_pattern(url: str) -> str:
    """The allow_domains pattern for a URL's host: `host`, or `host:port` when the URL names a
    port; IPv6 literals bracketed. Raises OpError for a URL that is not http(s) with a host."""
    try:
        return policy.allow_pattern_for_url(url)
    except policy.MalformedHost as exc:
        raise OpError(f"{url!r} is not an http:// or https:// address with a valid host and "
                      f"port ({exc.reason})", "invalid_url") from None


def _error_of(status: int, answer: Any) -> OpError:
    err = (answer or {}).get("error") if isinstance(answer, dict) else None
    if not err:
        return OpError(f"the guard answered HTTP {status}", "http_error", status)
    msg = err.get("message") or err.get("code") or f"HTTP {status}"
    return OpError(msg, err.get("code") or "error", status)


class GuardRun:
    """One run on a running guard. Use as a context manager, or call `end()` yourself."""

    def __init__(self, client: GuardClient, run_id: str, pipeline: str | None = None):
        self.client, self.run_id = client, run_id
        self.ended = False
        body: dict[str, Any] = {"run_id": run_id}
        if pipeline:
            body["pipeline"] = pipeline
        status, answer = self._call("POST", "/v1/runs", body)
        if status != 201:
            raise _error_of(status, answer)

    def _call(self, method: str, route: str, body: Any = None) -> tuple[int, Any]:
        try:
            return self.client.call(method, route, body)
        except GuardUnavailable as exc:
            raise GuardNotRunning(str(exc), "guard_unavailable") from None
        except OSError as exc:  # timeouts, a guard that went away mid-call
            raise OpError(f"talking to the guard failed: {exc}", "guard_io") from None

    def stage(self, stage_id: str, browser: dict, attempt: int = 1,
              wait: float = STAGE_WAIT_S) -> dict[str, str]:
        """Ask for a stage's browser; returns the stage env. A queued stage (the profile is
        leased by another run) is polled for at most `wait` seconds, then ProfileBusy."""
        body = {"stage_id": stage_id, "attempt": attempt, "browser": browser}
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/stages", body)
        deadline = time.monotonic() + wait
        while status == 202:
            if time.monotonic() >= deadline:
                raise ProfileBusy(f"profile {browser.get('profile')!r} is in use by run "
                                  f"{answer.get('holder_run')!r} since {answer.get('since')}; "
                                  "try again when that run has ended", "profile_leased", 202)
            time.sleep(0.5)
            status, answer = self._call("GET", f"/v1/runs/{self.run_id}/stages/{stage_id}")
        if status != 200:
            raise _error_of(status, answer)
        return dict(answer["env"])

    def end_stage(self, stage_id: str, outcome: str = "succeeded") -> list[str]:
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/stages/{stage_id}/end",
                                    {"outcome": outcome})
        if status != 200:
            raise _error_of(status, answer)
        return list(answer.get("problems") or [])

    def login_check(self, profile: str, spec: dict,
                    on_retry: Callable[[str], None] | None = None) -> dict:
        """The guard's own {logged_in, url} for `profile` (needs a stage that allowed the host).

        A check that timed out inside the guard (`login_check_failed`, "did not finish") is
        tried once more, after telling `on_retry`: seen now and then on a freshly started anchor;
        any other error is raised at once."""
        for attempt in (1, 2):
            status, answer = self._call("POST", f"/v1/runs/{self.run_id}/login-check",
                                        {"profile": profile, "login_check": spec})
            if status == 200:
                return {"logged_in": bool(answer["logged_in"]), "url": str(answer["url"])}
            err = _error_of(status, answer)
            if attempt == 1 and err.code == "login_check_failed" and "did not finish" in str(err):
                if on_retry:
                    on_retry(f"the guard's login check timed out ({err}); trying once more")
                continue
            raise err
        raise AssertionError("unreachable")

    def verify(self, profile: str, reported: dict) -> None:
        """Have the guard compare a stage's envelope with its own last check (OpError on 409)."""
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/login-check/verify",
                                    {"profile": profile, "reported": reported})
        if status != 200:
            raise _error_of(status, answer)

    def handoff(self, profile: str, site: str, reason: str, url: str | None,
                kind: str = "auto", stage_id: str | None = None,
                login_check: dict | None = None) -> dict:
        """Open the profile's browser for a person; the gate payload, or HandoffRefused.
        `auto`: a visible window where the guard has a screen, else a live view in its console."""
        body: dict[str, Any] = {"profile": profile, "site": site, "reason": reason, "kind": kind}
        if url:
            body["url"] = url
        if stage_id:
            body["stage_id"] = stage_id
        if login_check:
            body["login_check"] = login_check
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/handoff", body)
        if status == 409 and (answer or {}).get("error", {}).get("code") == "handoff_impossible":
            raise HandoffRefused(answer["error"]["message"], "handoff_impossible", 409)
        if status != 200:
            raise _error_of(status, answer)
        return dict(answer)

    def wait_handoff(self, limit: float = LIVE_VIEW_WAIT_S) -> dict:
        """Long-poll the run's live_view handoff until it is no longer open (or `limit` s)."""
        deadline = time.monotonic() + limit
        while True:
            status, answer = self._call("GET", f"/v1/runs/{self.run_id}/handoff?wait=30")
            if status != 200:
                raise _error_of(status, answer)
            if answer["state"] != "open" or time.monotonic() >= deadline:
                return dict(answer)

    def end(self, outcome: str = "succeeded") -> list[str]:
        """End the run: the guard closes its browsers, reseals its profiles, releases leases."""
        if self.ended:
            return []
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/end", {"outcome": outcome})
        self.ended = True
        if status != 200:
            raise _error_of(status, answer)
        return list(answer.get("problems") or [])

    def __enter__(self) -> GuardRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.ended:
            with contextlib.suppress(OpError):
                self.end("succeeded" if exc_type is None else
                         "cancelled" if exc_type is KeyboardInterrupt else "failed")


def _run_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


# --------------------------------------------------------------------------- profiles check/login

@dataclass
class LoginWindow:
    """An open `profiles login` run: show `payload`, wait for the person, then `finish()`."""
    run: GuardRun
    payload: dict

    def finish(self, confirmed: bool) -> list[str]:
        """End the stage and the run (closes the window, reseals the profile)."""
        problems: list[str] = []
        with contextlib.suppress(OpError):
            problems += self.run.end_stage("login", "succeeded" if confirmed else "cancelled")
        try:
            problems += self.run.end("succeeded" if confirmed else "cancelled")
        except OpError as exc:
            problems.append(f"ending the run failed: {exc}")
        return problems


class ProfileOps:
    """`sfguard profiles check` and `sfguard profiles login` against the guard of `home`."""

    def __init__(self, home: Path, name: str, url: str, allow: list[str] | None = None):
        self.client = GuardClient(home)
        self.name, self.url = name, url
        self.allow = [host_pattern(url)] + [a.strip() for a in (allow or []) if a.strip()]
        try:
            policy.compile_patterns(self.allow, source="--allow")
        except policy.PolicyError as exc:
            raise OpError(str(exc), "invalid_pattern") from None

    def _browser(self, headed: bool) -> dict:
        return {"profile": self.name, "headed": headed, "allow_domains": self.allow}

    def _profile_exists(self) -> bool:
        try:
            status, answer = self.client.call("GET", "/v1/profiles")
        except GuardUnavailable as exc:
            raise GuardNotRunning(str(exc), "guard_unavailable") from None
        if status != 200:
            raise _error_of(status, answer)
        return any(p.get("name") == self.name for p in answer.get("profiles", []))

    def check(self, spec: dict, on_retry: Callable[[str], None] | None = None) -> dict:
        """{logged_in, url} computed by the guard in a short run of its own."""
        if not self._profile_exists():
            raise OpError(f"no profile {self.name!r} on this guard (create it with `sfguard profiles "
                          f"create {self.name}` or log in with `sfguard profiles login {self.name} "
                          "--url URL`)", "profile_not_found")
        with GuardRun(self.client, _run_id("check")) as run:
            run.stage("check", self._browser(headed=False), wait=0)
            result = run.login_check(self.name, spec, on_retry)
            run.end_stage("check")
            run.end()
        return result

    def open_login_window(self, spec: dict | None = None) -> LoginWindow:
        """A run with a headed stage on the profile and a local_window handoff at the URL; on a
        guard without a screen, a headless stage and a live_view handoff (payload kind
        live_view, url = a one-time console link). HandoffRefused when neither can work."""
        run = GuardRun(self.client, _run_id("login"))
        try:
            try:
                run.stage("login", self._browser(headed=True), wait=0)
            except OpError as exc:
                if exc.code != "no_display":
                    raise
                # The guard has no screen: a headless browser and a live view in its console
                # (kind auto), or, with its console off, a refusal that names the cause.
                run.stage("login", self._browser(headed=False), wait=0)
                payload = run.handoff(self.name, urlsplit(self.url).hostname or self.url,
                                      f"sfguard profiles login: sign in to profile {self.name}",
                                      self.url, "auto", "login", spec)
                if payload.get("kind") != "live_view":
                    raise HandoffRefused(str(exc), "no_display")
                return LoginWindow(run, payload)
            payload = run.handoff(self.name, urlsplit(self.url).hostname or self.url,
                                  f"sfguard profiles login: sign in to profile {self.name}", self.url)
        except BaseException:
            with contextlib.suppress(OpError):
                run.end("cancelled")
            raise
        return LoginWindow(run, payload)


# --------------------------------------------------------------------------- processes

class Child:
    """A process the demo started: its stdout read by a thread (so no wait blocks forever)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], stderr_path: Path):
        self.name = name
        self._stderr = open(stderr_path, "ab", opener=lambda p, f: os.open(p, f, 0o600))
        # Own session: a Ctrl-C in the terminal reaches only the demo, which stops the children
        # in order (the guard first, so it closes its browsers and reseals).
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self._stderr,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.leftovers: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, predicate: Callable[[str], bool], timeout: float) -> str | None:
        """The first stdout line for which predicate holds, or None (exit or time-out)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                return None
            if predicate(line):
                return line

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; by pid. Then wait (bounded) for the
        processes it had started itself (recorded by pid and start time before the signal):
        any still alive 10 s after it exited are ended by pid too (`self.leftovers`)."""
        kids: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        try:
            self._stop_main(timeout)
            _, alive = psutil.wait_procs(kids, timeout=10)
            for p in alive:  # psutil checks the start time: never a recycled pid
                with contextlib.suppress(psutil.Error):
                    self.leftovers.append(f"{p.pid} {' '.join(p.cmdline()[:3])}")
                    p.kill()
            psutil.wait_procs(alive, timeout=5)
            return self.proc.returncode
        finally:
            self._stderr.close()

    def _stop_main(self, timeout: float) -> None:
        end_popen(self.proc, timeout, kill_wait=10)


def _child_env() -> dict[str, str]:
    return dict(os.environ)


# --------------------------------------------------------------------------- demo setup

def write_demo_policy(dest: Path, port: int) -> Path:
    """The shipped site policy plus the fixture's port and 127.0.0.1/32 as a private network
    the demo may reach. Validated before use."""
    data = yaml.safe_load(policy.default_policy_path().read_text())
    ports = list(data.get("ports") or [80, 443])
    if port not in ports:
        ports.append(port)
    data["ports"] = ports
    nets = data.setdefault("private_networks", {}) or {}
    data["private_networks"] = nets
    allow = list(nets.get("allow") or [])
    if "127.0.0.1/32" not in allow:
        allow.append("127.0.0.1/32")
    nets["allow"] = allow
    text = ("# sfguard demo: the shipped policy/sites.yaml plus the local fixture site\n"
            + yaml.safe_dump(data, sort_keys=False))
    dest.write_text(text)
    os.chmod(dest, 0o600)
    policy.load_policy(dest)  # raises PolicyError if the result is not valid
    return dest


def prepare_pipeline(src: Path, dest: Path, port: int) -> Path:
    """A copy of the example pipeline with the fixture port 8080 replaced by `port`."""
    text = src.read_text()
    text = re.sub(rf"(?<=[\w.\]]):{EXAMPLE_PORT}\b", f":{port}", text)
    dest.write_text(text)
    os.chmod(dest, 0o600)
    return dest


def _fixture_hosts(stages) -> list[str]:
    """Host names (not IP literals) the pipeline's browsers use: the guard resolves them to
    127.0.0.1 (`--resolve`), where the fixture site listens."""
    hosts: set[str] = set()
    for st in stages:
        if st.browser is None:
            continue
        names = [policy.split_host_port(p)[0] for p in st.browser.allow_domains]
        if st.browser.login_check:
            names.append(urlsplit(st.browser.login_check.url).hostname or "")
        for h in names:
            h = h.removeprefix("*.")
            if h and not re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", h):
                hosts.add(h)
    return sorted(hosts)


# --------------------------------------------------------------------------- the stage side

class StageSide:
    """Runs agent-browser as a stage worker would: with ONLY the env the guard returned, plus
    PATH and an empty per-demo HOME."""

    def __init__(self, env: dict[str, str], home: Path):
        ab = tools.find_agent_browser()
        if not ab.found:
            raise DemoError(f"agent-browser is missing ({ab.hint}); run ./dev setup")
        self.ab = ab.path
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **env}

    def run(self, *args: str, check: bool = True) -> str:
        try:
            r = subprocess.run([self.ab, *args], env=self.env, capture_output=True, text=True,
                               timeout=AB_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise DemoError(f"agent-browser {args[0]} did not finish within {AB_TIMEOUT_S:.0f} s") from None
        if check and r.returncode != 0:
            # agent-browser's message, without the arguments (a fill value stays out of it)
            msg = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DemoError(f"agent-browser {args[0]} failed: {msg[0][:300]}")
        return r.stdout.strip()


_MARKER = re.compile(r"\b(sf_[a-z_]+)\s+([0-9a-f]{8})\b")


def read_markers(stage: StageSide, origin: str) -> dict[str, str]:
    """Cookie name -> marker, as the fixture site's /cookies page shows them (never values)."""
    stage.run("open", f"{origin}/cookies")
    return dict(_MARKER.findall(stage.run("get", "text", "#cookies")))


# --------------------------------------------------------------------------- the runner's part

@dataclass
class RunReport:
    run_id: str
    executed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    check: dict | None = None
    login_ran: bool = False
    login_by: str | None = None        # "operator (window)" | "demo (headless, no display)"
    heading: str | None = None
    markers: dict[str, str] = field(default_factory=dict)


def _gate(st) -> dict:
    """A stage's gate as plain data (the validator keeps the YAML node, aliases resolved here)."""
    if st.gate is None:
        return {}
    data = st.gate if isinstance(st.gate, dict) else yaml.safe_load(yaml.serialize(st.gate))
    return data if isinstance(data, dict) else {}


def _cond_fires(cond: str | None, output: dict) -> bool:
    if not cond:
        return True
    m = re.fullmatch(r"\s*([A-Za-z_][\w.]*)\s*(eq|ne|==|!=)\s*(\S+)\s*", cond)
    if not m:
        raise DemoError(f"the demo runner does not understand the condition {cond!r}")
    name, op, want = m.groups()
    have = output.get(name)
    have_s = str(have).lower() if isinstance(have, bool) else str(have)
    equal = have_s == want.strip("'\"")
    return equal if op in ("eq", "==") else not equal


class DemoRunner:
    """Plays the pipeline runner for the validated example pipeline, one run at a time."""

    def __init__(self, client: GuardClient, report, pipeline_src: Path, stage_home: Path,
                 say: Callable[[str], None], interactive: bool, auto_login: bool = False,
                 site_origin: str | None = None):
        self.client, self.stages, self.say = client, report.stages, say
        self.site_origin = site_origin
        self.pipeline_src, self.stage_home = pipeline_src, stage_home
        self.interactive = interactive
        self.auto_login = auto_login
        self.headless_fallback = False
        self.user = os.environ.get("SFGUARD_FIXTURE_USER") or FIXTURE_USER
        self.password = os.environ.get("SFGUARD_FIXTURE_PASSWORD") or FIXTURE_PASSWORD

    # The stage order is the pipeline's; a stage runs when it is the first one or when a route
    # from a stage that ran fires (routes from skipped stages do not block a join: topology A).
    def run(self, n: int) -> RunReport:
        rep = RunReport(_run_id(f"demo-{n}"))
        self.say(f"== run {n} ({rep.run_id}) ==")
        fired: set[str] = set()
        with GuardRun(self.client, rep.run_id, pipeline=str(self.pipeline_src)) as run:
            for i, st in enumerate(self.stages):
                if i > 0 and st.id not in fired:
                    rep.skipped.append(st.id)
                    self.say(f"[{st.id}] skipped: no route into it fired")
                    continue
                output = self._stage(run, st, rep)
                rep.executed.append(st.id)
                for r in st.routes:
                    ok = _cond_fires(r.cond, output)
                    why = f" (if {r.cond}: {'true' if ok else 'false'})" if r.cond else ""
                    self.say(f"[route] {st.id} -> {r.target}{why}{'' if ok else ': not taken'}")
                    if ok:
                        fired.add(r.target)
            problems = run.end("succeeded")
            self.say("[run] ended: the guard closed the browser and resealed the profile"
                     + (f" (problems: {'; '.join(problems)})" if problems else ""))
        return rep

    def _browser(self, st) -> dict:
        b = st.browser.model_dump(exclude_none=True)
        if self.headless_fallback:
            b["headed"] = False
        return b

    def _request(self, run: GuardRun, st, attempt: int) -> StageSide:
        try:
            env = run.stage(st.id, self._browser(st), attempt)
        except OpError as exc:
            if exc.code != "no_display" or self.headless_fallback:
                raise
            self.headless_fallback = True
            self.say(f"[{st.id}] the guard has no display ({exc}); the demo runs every stage "
                     "headless (headed: false)")
            env = run.stage(st.id, self._browser(st), attempt)
        b = st.browser
        self.say(f"[{st.id}] stage ready: profile {b.profile}, allow_domains {b.allow_domains}, "
                 f"env {sorted(env)}")
        return StageSide(env, self.stage_home)

    def _stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        if st.browser is None:
            self.say(f"[{st.id}] no browser: nothing for the guard to do")
            return {}
        if _gate(st).get("handoff"):
            return self._login_stage(run, st, rep)
        if st.browser.login_check is not None:
            return self._check_stage(run, st, rep)
        return self._work_stage(run, st, rep)

    def _check_stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        self._request(run, st, 1)
        spec = st.browser.login_check.model_dump(exclude_none=True)
        result = run.login_check(st.browser.profile, spec, on_retry=lambda m: self.say(f"[{st.id}] {m}"))
        rep.check = result
        self.say(f"[{st.id}] guard login check of {spec['url']}: logged_in={str(result['logged_in']).lower()}, "
                 f"final address {result['url']}")
        # The stage agent reports the guard's result in its envelope; the runner has the guard
        # compare it with its own (a made-up envelope would be refused with 409).
        run.verify(st.browser.profile, result)
        self.say(f"[{st.id}] envelope {{logged_in: {str(result['logged_in']).lower()}}} verified by the guard")
        run.end_stage(st.id)
        return result

    def _login_stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        rep.login_ran = True
        spec = st.browser.login_check.model_dump(exclude_none=True)
        gate = _gate(st)
        handoff = gate["handoff"]
        for attempt in range(1, MAX_LOGIN_ATTEMPTS + 1):
            stage = self._request(run, st, attempt)
            self.say(f"[{st.id}] gate: {gate.get('message', 'confirm')}")
            confirmed = "gate confirmed"
            try:
                kind = "live_view" if handoff.get("kind") == "live_view" else "auto"
                payload = run.handoff(st.browser.profile, str(handoff.get("site")),
                                      str(handoff.get("reason")), spec["url"], kind, st.id)
                if payload["kind"] == "live_view":
                    if not self._live_view(run, st, payload, rep):
                        raise DemoError("the login was cancelled in the live view")
                    confirmed = "gate confirmed (Done in the live view)"
                else:
                    self._window_handoff(st, stage, spec, payload, rep)
            except HandoffRefused as exc:
                self.say(f"[{st.id}] handoff refused by the guard: {exc}")
                self.say(f"[{st.id}] the demo plays the operator instead, headless, through this "
                         "stage's own agent-browser env (open the login page, fill, click)")
                self._play_operator(stage, spec["url"])
                rep.login_by = "the demo, headless (no display for a login window)"
            self.say(f"[{st.id}] {confirmed}")
            # verify: login_check -- the guard checks the login again after the confirm
            result = run.login_check(st.browser.profile, spec, on_retry=lambda m: self.say(f"[{st.id}] {m}"))
            self.say(f"[{st.id}] verify: guard login check says logged_in={str(result['logged_in']).lower()} "
                     f"({result['url']})")
            run.end_stage(st.id, "succeeded" if result["logged_in"] else "failed")
            if result["logged_in"]:
                return result
            if st.on_verify_fail != st.id:
                raise DemoError(f"the login was not confirmed by the guard ({result['url']})")
            self.say(f"[{st.id}] on_verify_fail: back to {st.id}")
        raise DemoError(f"no login after {MAX_LOGIN_ATTEMPTS} attempts")

    def _window_handoff(self, st, stage: StageSide, spec: dict, payload: dict, rep: RunReport) -> None:
        """A visible login window on the guard's screen: the operator logs in (or, with no one
        at the terminal, the demo plays the operator in that window)."""
        self.say(f"[{st.id}] handoff: {payload['kind']} for {payload['site']} at {payload.get('url')}")
        if self.interactive:
            self.say(f"[{st.id}] log in as user {self.user!r} in the browser window, then press "
                     "Enter here (Ctrl-D aborts)")
            if sys.stdin.readline() == "":
                raise DemoError("aborted at the login gate")
            rep.login_by = "the operator, in the visible window"
        else:
            self.say(f"[{st.id}] no one at the terminal: the demo plays the operator in the window")
            self._play_operator(stage, spec["url"])
            rep.login_by = "the demo, in the visible window (no terminal)"

    def _live_view(self, run: GuardRun, st, payload: dict, rep: RunReport) -> bool:
        """The guard has no screen: its console shows the login tab at a one-time link. With
        --auto-login a scripted person (a separate, unguarded headless Chromium) signs in
        through that page; otherwise a person opens the link. True when Done was pressed."""
        url = payload["url"]
        shown = url.split("?", 1)[0]
        if self.auto_login:
            self.say(f"[{st.id}] handoff: live_view for {payload['site']} at {shown} (one-time "
                     "link given to the scripted person, not printed)")
            import asyncio

            from sfguard.supervisor.console.viewer import ViewerError, scripted_login
            try:
                out = asyncio.run(scripted_login(url, self.user, self.password, say=self.say))
            except ViewerError as exc:
                raise DemoError(f"the scripted person could not log in through the live view: {exc}") from None
            self.say(f"[person] pressed Done; the page says: {out['result']}")
            self._say_how_the_form_was_sent()
            rep.login_by = "a scripted person, through the live view (a separate headless browser)"
        else:
            self.say(f"[{st.id}] handoff: live_view for {payload['site']}. Open this one-time "
                     f"link in a browser, sign in as user {self.user!r}, then press Done:")
            self.say(f"    {url}")
            rep.login_by = "the operator, through the live view"
        state = run.wait_handoff()
        self.say(f"[{st.id}] live view ended: {state['state']}")
        return state["state"] == "done"

    def _say_how_the_form_was_sent(self) -> None:
        """What the fixture site saw of its sign-in form (its /submits.json: how each POST was
        sent, by a click on the button or by the keyboard; never the user or password)."""
        if not self.site_origin:
            return
        import json
        import urllib.request
        try:
            with urllib.request.urlopen(f"{self.site_origin}/submits.json", timeout=10) as r:
                submits = json.load(r).get("submits") or []
        except (OSError, ValueError):
            self.say("[site] could not read how the sign-in form was sent")
            return
        vias = ", ".join(str(x.get("via")) for x in submits) or "none"
        self.say(f"[site] sign-in form posts so far, sent by: {vias}")

    def _play_operator(self, stage: StageSide, url: str) -> None:
        stage.run("open", url)
        stage.run("fill", "input[name=user]", self.user)
        stage.run("fill", "input[name=password]", self.password)
        stage.run("click", "button[type=submit]")
        stage.run("wait", "1000", check=False)
        self.say(f"[operator] signed in; the page is now {stage.run('get', 'url')}")

    def _work_stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        stage = self._request(run, st, 1)
        check = next((s.browser.login_check for s in self.stages
                      if s.browser and s.browser.profile == st.browser.profile and s.browser.login_check), None)
        if check is None:
            raise DemoError(f"stage {st.id}: no login_check names the page to read")
        page = urlsplit(check.url)
        origin = f"{page.scheme}://{page.netloc}"
        stage.run("open", check.url)
        rep.heading = stage.run("get", "text", "h1")
        self.say(f"[{st.id}] opened {check.url}: heading {rep.heading!r}")
        rep.markers = read_markers(stage, origin)
        shown = ", ".join(f"{k} (marker {v})" for k, v in sorted(rep.markers.items())) or "none"
        self.say(f"[{st.id}] cookies the site received: {shown}")
        run.end_stage(st.id)
        return {}


# --------------------------------------------------------------------------- sfguard demo

@dataclass
class DemoResult:
    runs: list[RunReport]
    ok: bool
    summary: list[str]


def _summarise(runs: list[RunReport], cookie: str = "sf_persist",
               session_cookie: str = "sf_session") -> tuple[bool, list[str]]:
    r1, r2 = runs
    lines, ok = [], True
    if r1.login_ran and r1.check and not r1.check["logged_in"]:
        lines.append(f"run 1: the check said logged out, so the login stage ran (login by {r1.login_by})")
    else:
        ok = False
        lines.append(f"run 1: UNEXPECTED: check={r1.check}, login stage ran={r1.login_ran}")
    if not r2.login_ran and r2.check and r2.check["logged_in"] and "login" in r2.skipped:
        lines.append("run 2: the check said logged in, so the login stage was skipped")
    else:
        ok = False
        lines.append(f"run 2: UNEXPECTED: check={r2.check}, login stage ran={r2.login_ran}")
    for i, r in enumerate(runs, 1):
        if r.heading is None or "Signed in" not in r.heading:
            ok = False
            lines.append(f"run {i}: UNEXPECTED: the work stage read {r.heading!r}")
    m1, m2 = r1.markers.get(cookie), r2.markers.get(cookie)
    if m1 and m1 == m2:
        lines.append(f"persistent cookie {cookie}: the same marker {m1} in both runs: it survived "
                     "the browser closing and the profile being sealed and unsealed")
    else:
        ok = False
        lines.append(f"persistent cookie {cookie}: UNEXPECTED: marker {m1} in run 1, {m2} in run 2")
    if session_cookie in r1.markers and session_cookie not in r2.markers:
        lines.append(f"session cookie {session_cookie}: present in run 1, gone in run 2 "
                     "(session-only, as a real browser restart would do)")
    return ok, lines


def guard_running(home: Path) -> bool:
    try:
        status, _ = GuardClient(home, timeout=10).call("GET", "/v1/status")
    except (GuardUnavailable, OSError):
        return False
    return status == 200


def run_demo(home: Path | None, keep: bool, say: Callable[[str], None],
             interactive: bool = False, auto_login: bool = False) -> DemoResult:
    """`sfguard demo`: see the module docstring. `home` None: a temp guard home. Raises
    DemoError with a sentence for the user; stops every process it started on every path."""
    if home is not None and guard_running(home):
        raise DemoError(f"a guard is already running on {home}; the demo starts its own guard "
                        "(with a demo site policy): stop that guard or pick another --home")
    workdir = Path(tempfile.mkdtemp(prefix="sfguard-demo-"))
    os.chmod(workdir, 0o700)
    guard_home = home if home is not None else workdir / "home"
    children: list[Child] = []
    failed = False
    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(_sig, _frame):
        raise KeyboardInterrupt
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    try:
        env = _child_env()
        site = Child("fixture site", [sys.executable, "-m", "sfguard.fixtures.login_server", "--port", "0"],
                     env, workdir / "fixture-site.log")
        children.append(site)
        line = site.wait_line(lambda l: l.startswith("ready "), STARTUP_S)
        if line is None:
            raise DemoError(f"the fixture site did not start; see {workdir / 'fixture-site.log'}")
        origin = line.split()[1]
        port = urlsplit(origin).port
        say(f"sfguard demo: fixture login site on {origin} (pid {site.proc.pid})")
        pol = write_demo_policy(workdir / "demo-sites.yaml", port)
        pipe = prepare_pipeline(EXAMPLE_PIPELINE, workdir / "login-pipeline.yaml", port)
        from sfguard.supervisor.pipeline.spec import validate_pipeline
        report = validate_pipeline(pipe, policy_path=pol)
        if not report.ok:
            raise DemoError("the example pipeline does not validate:\n" +
                            "\n".join(str(i) for i in report.errors))
        profiles = sorted({s.browser.profile for s in report.stages if s.browser and s.browser.profile})
        say(f"sfguard demo: pipeline {EXAMPLE_PIPELINE.name} (fixture port "
            f"{EXAMPLE_PORT} -> {port}), stages {[s.id for s in report.stages]}, "
            f"profile {', '.join(profiles) or '-'} (the name the pipeline gives)")
        argv = [sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(guard_home), "--policy", str(pol)]
        for h in _fixture_hosts(report.stages):
            argv += ["--resolve", f"{h}=127.0.0.1"]
        guard = Child("guard", argv, env, workdir / "guard.log")
        children.insert(0, guard)  # stopped first: it closes browsers and reseals
        if guard.wait_line(lambda l: l.strip() == "sfguard: ready", STARTUP_S) is None:
            code = guard.proc.poll()
            tail = (workdir / "guard.log").read_text(errors="replace").strip().splitlines()[-3:]
            if code == 3:
                raise DemoError(f"a guard is already running on {guard_home}; stop it or pick another --home")
            raise DemoError(f"the guard did not start (exit {code}): {' | '.join(tail)}")
        say(f"sfguard demo: guard started (pid {guard.proc.pid}), home {guard_home}"
            f"{' (temporary)' if home is None and not keep else ''}, policy {pol}")
        stage_home = workdir / "stage-home"
        stage_home.mkdir(mode=0o700)
        runner = DemoRunner(GuardClient(guard_home), report, EXAMPLE_PIPELINE, stage_home, say,
                            interactive, auto_login, site_origin=origin)
        runs = [runner.run(1), runner.run(2)]
        ok, summary = _summarise(runs)
        say("== summary ==")
        for s in summary:
            say(s)
        return DemoResult(runs, ok, summary)
    except OpError as exc:
        failed = True
        raise DemoError(f"the guard refused: {exc} ({exc.code})") from None
    except policy.PolicyError as exc:
        raise DemoError(f"the demo site policy is invalid:\n{exc}") from None
    except DemoError:
        failed = True
        raise
    finally:
        for child in children:
            code = child.stop(STOP_S if child.name == "guard" else 10)
            say(f"sfguard demo: stopped the {child.name} (pid {child.proc.pid}, exit {code})")
            for left in child.leftovers:
                say(f"sfguard demo: the {child.name} left process {left} running after it exited; "
                    "ended it (a bug to report)")
        # what no child list shows: an agent-browser daemon a stage command started carries
        # the guard's runtime folder only in its env; the sweep's own scan finds it
        # (under root the guard's browsers ran as the browser user: its processes count too)
        buser = lookup_user(DEFAULT_BROWSER_USER) if os.geteuid() == 0 else None
        for left in terminate_recorded(scan_orphans([runtime_path(resolve_home(guard_home))],
                                                    (buser.uid,) if buser else ()), 5):
            say(f"sfguard demo: process {left.pid} ({left.kind}) of the guard's runtime "
                "folder outlived the guard; ended it (a bug to report)")
        log_file = workdir / "guard.log"
        if failed and log_file.exists():  # the guard's own log is redacted by its filter
            tail = log_file.read_text(errors="replace").strip().splitlines()[-8:]
            say("sfguard demo: the guard's last log lines:\n  " + "\n  ".join(tail))
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, old_term)
        if keep:
            say(f"sfguard demo: kept {workdir} (demo policy, logs)"
                + (f" and the guard home {guard_home}" if home is None else ""))
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            if home is None:  # the temporary home's runtime folder goes with it
                shutil.rmtree(runtime_path(resolve_home(guard_home)), ignore_errors=True)
