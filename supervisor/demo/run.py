"""`sfguard demo`: a guard of its own, the fixture login site, and the example pipeline twice.

`run_demo()` starts the fixture login site and a guard of its own, then plays the pipeline
runner (supervisor/demo/runner.py) for supervisor/demo/login-pipeline.yaml twice (check, login
when needed, work) and prints a transcript and a summary. Every process it starts is stopped by
pid on every exit path.

It talks to the guard only through its API (supervisor/client/) and starts processes with argv
lists; it never prints a cookie value, a token or a password.
"""
from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import psutil
import yaml

from sfguard import policy
from sfguard.supervisor.browsers.browser_pool import existing_uids
from sfguard.supervisor.client.guard_client import GuardClient
from sfguard.supervisor.client.ops import OpError, guard_running
from sfguard.supervisor.demo.runner import DemoError, DemoRunner, RunReport
from sfguard.supervisor.home import resolve_home, runtime_path
from sfguard.supervisor.procs import end_popen, scan_orphans, terminate_recorded

if TYPE_CHECKING:
    from sfguard.supervisor.pipeline.report import PipelineReport

# Package data: installed with the wheel, so the demo runs outside a checkout too.
EXAMPLE_PIPELINE = Path(__file__).resolve().with_name("login-pipeline.yaml")
#: The fixture port written in the example pipeline; the demo runs the site on a free port and
#: rewrites it in a copy of the pipeline.
EXAMPLE_PORT = 8080
STARTUP_S = 60.0             # fixture site / guard start-up
STOP_S = 60.0                # guard shutdown (closes browsers, reseals) before SIGKILL

__all__ = ["EXAMPLE_PIPELINE", "DemoError", "DemoResult", "prepare_pipeline", "run_demo",
           "write_demo_policy"]


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


def _start_site(children: list[Child], env: dict[str, str], workdir: Path,
                say: Callable[[str], None]) -> tuple[str, int]:
    """Step 1: the fixture login site on a free port; its origin and port."""
    site = Child("fixture site", [sys.executable, "-m", "sfguard.fixtures.login_server", "--port", "0"],
                 env, workdir / "fixture-site.log")
    children.append(site)
    line = site.wait_line(lambda l: l.startswith("ready "), STARTUP_S)
    if line is None:
        raise DemoError(f"the fixture site did not start; see {workdir / 'fixture-site.log'}")
    origin = line.split()[1]
    port = urlsplit(origin).port
    if port is None:
        raise DemoError(f"the fixture site named no port ({origin})")
    say(f"sfguard demo: fixture login site on {origin} (pid {site.proc.pid})")
    return origin, port


def _prepare(workdir: Path, port: int, say: Callable[[str], None]) -> tuple[Path, PipelineReport]:
    """Step 2: the demo site policy and the example pipeline, validated against it."""
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
    return pol, report


def _start_guard(children: list[Child], env: dict[str, str], workdir: Path, guard_home: Path, pol: Path,
                 report: PipelineReport) -> Child:
    """Step 3: `sfguard start` on the home with the demo policy, resolving the fixture hosts."""
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
    return guard


def _clean_up(children: list[Child], workdir: Path, guard_home: Path, *, failed: bool, keep: bool,
              temp_home: bool, say: Callable[[str], None]) -> None:
    """The last step on every path: stop every child, end what outlived the guard, keep or
    remove the work folder."""
    for child in children:
        code = child.stop(STOP_S if child.name == "guard" else 10)
        say(f"sfguard demo: stopped the {child.name} (pid {child.proc.pid}, exit {code})")
        for left in child.leftovers:
            say(f"sfguard demo: the {child.name} left process {left} running after it exited; "
                "ended it (a bug to report)")
    # what no child list shows: an agent-browser daemon a stage command started carries
    # the guard's runtime folder only in its env; the sweep's own scan finds it
    # (under root the guard's browsers ran as its browser users: their processes count too)
    busers = existing_uids() if os.geteuid() == 0 else ()
    for orphan in terminate_recorded(scan_orphans([runtime_path(resolve_home(guard_home))], busers), 5):
        say(f"sfguard demo: process {orphan.pid} ({orphan.kind}) of the guard's runtime "
            "folder outlived the guard; ended it (a bug to report)")
    log_file = workdir / "guard.log"
    if failed and log_file.exists():  # the guard's own log is redacted by its filter
        tail = log_file.read_text(errors="replace").strip().splitlines()[-8:]
        say("sfguard demo: the guard's last log lines:\n  " + "\n  ".join(tail))
    if keep:
        say(f"sfguard demo: kept {workdir} (demo policy, logs)"
            + (f" and the guard home {guard_home}" if temp_home else ""))
    else:
        shutil.rmtree(workdir, ignore_errors=True)
        if temp_home:  # the temporary home's runtime folder goes with it
            shutil.rmtree(runtime_path(resolve_home(guard_home)), ignore_errors=True)


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
        origin, port = _start_site(children, env, workdir, say)
        pol, report = _prepare(workdir, port, say)
        guard = _start_guard(children, env, workdir, guard_home, pol, report)
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
        _clean_up(children, workdir, guard_home, failed=failed, keep=keep, temp_home=home is None, say=say)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, old_term)
