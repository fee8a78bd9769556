"""Fixtures shared by every test folder. Folder-specific fixtures live in that folder's conftest."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SFGUARD = [sys.executable, "-m", "sfguard.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def guard_home(tmp_path, monkeypatch) -> Path:
    """A fresh guard home; also exported as $SFGUARD_HOME for subprocesses."""
    home = tmp_path / "home"
    monkeypatch.setenv("SFGUARD_HOME", str(home))
    return home


@pytest.fixture
def browser_env() -> dict[str, str]:
    """Env for real agent-browser + Chromium runs on this machine (root needs --no-sandbox)."""
    from sfguard.supervisor.browsers import tools
    ab, br = tools.find_agent_browser(), tools.find_browser()
    if not (ab.found and br.found and ab.path and br.path):
        pytest.fail("agent-browser or Chromium missing: run ./dev setup")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "AGENT_BROWSER_EXECUTABLE_PATH": br.path, "SFGUARD_AGENT_BROWSER_BIN": ab.path}
    if os.geteuid() == 0:
        env["AGENT_BROWSER_ARGS"] = "--no-sandbox"
    return env


@contextlib.contextmanager
def login_site():
    """The fixture login site (fixtures/login_server) on a free port of 127.0.0.1: yields the
    port; its /hits.json counts what reached it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sfguard.fixtures.login_server", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("ready "), line
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def site():
    """The fixture login site for one test (login_site)."""
    with login_site() as port:
        yield port


#: A cold first start of Chromium on a fresh machine builds its font and shader caches (seconds,
#: more under load). Pay it once, before the first real-browser test, with a generous bound, so
#: no test's own bounded wait has to absorb it.
COLD_START_BOUND_S = 180


@pytest.fixture(scope="session", autouse=True)
def chromium_warmed_up(request):
    if not any(item.get_closest_marker("browser") for item in request.session.items):
        return
    from sfguard.supervisor.browsers import tools
    br = tools.find_browser()
    if not br.found or br.path is None:
        return  # the browser tests themselves say what is missing
    import tempfile
    with tempfile.TemporaryDirectory(prefix="sfg-warm-") as profile:
        argv = [br.path, "--headless=new", f"--user-data-dir={profile}", "--no-first-run",
                "--disable-background-networking", "--dump-dom", "about:blank"]
        if os.geteuid() == 0:
            argv.insert(1, "--no-sandbox")   # a one-shot local page; the guard's browsers are separate
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=COLD_START_BOUND_S)
        except subprocess.TimeoutExpired:
            pass  # subprocess.run killed it; the tests will report a browser that does not start


@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL for the session (tests/pgserver.py), started when first asked for and
    stopped (pg_ctl stop -m fast) at the end. Missing PostgreSQL fails: ./dev installs it."""
    from tests.pgserver import PgMissing, PgServer
    try:
        server = PgServer().start()
    except PgMissing as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server) -> str:
    """The URL of a fresh, empty database on the session's PostgreSQL."""
    return pg_server.create_db()


# -- no runtime or bridge folder left behind (issues 11, 16) ------------------------------------
# A guard's runtime folder (`/dev/shm/sfg-...`) and its per-stage bridge folders
# (`/dev/shm/sfb-...`) must go with it on every exit path, and a store used without a guard
# leaves neither. After each test, the folders of homes inside that test's tmp_path must be gone;
# at the end of the session, those of every home under the session's temporary folder
# (module-scoped guards included). Matched by name (tests/shm_leftovers.py): other sessions' folders are never
# counted, and nothing is removed.

LEFTOVER_PREFIXES = ("sfb", "sfg")


@pytest.fixture(autouse=True)
def no_bridge_folder_left(request):
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None:
        return
    from tests.shm_leftovers import left_by
    left = left_by(Path(tmp), LEFTOVER_PREFIXES)
    assert left == [], f"runtime or bridge folders left by this test: {[str(p) for p in left]}"


def pytest_sessionfinish(session, exitstatus):
    factory = getattr(session.config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None)     # None: no test asked for a temp folder
    if base is None or exitstatus not in (0, 1):
        return
    from tests.shm_leftovers import left_by
    left = left_by(Path(base), LEFTOVER_PREFIXES)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = f"runtime or bridge folders left by this session: {[str(p) for p in left]}"
        if reporter is not None:
            reporter.write_line(msg, red=True)
        session.exitstatus = 1


#: Seconds the slowest test files took in one full run (single process, loaded machine): only the
#: order depends on it. Under `./dev test` (pytest-xdist, a file per worker) the long files start
#: first, so the two workers finish together instead of one running a long file at the end.
SLOW_FILES = {
    "browser_host/test_write_gates.py": 140, "proxy/test_proxy_cli.py": 111, "proxy/test_hardening.py": 110,
    "stage_exec/test_stage_exec.py": 79, "daemon/test_runs.py": 72, "daemon/test_shared_anchor.py": 72,
    "daemon/test_login_abort.py": 67, "daemon/test_api_contract.py": 65, "console/test_live_view_browser.py": 65,
    "daemon/test_api_edges.py": 58, "demo/test_demo_browser.py": 49,
    "demo/test_profiles_guard.py": 41, "pg/test_guards.py": 39, "pg/test_outage.py": 36,
    "stage_exec/test_hostile_stage.py": 33, "daemon/test_real_browser.py": 30, "daemon/test_ca_file.py": 30,
    "stage_exec/test_bridge_cleanup.py": 29, "browser_host/test_fetch_switch_off.py": 28,
    "cli/test_cli_table.py": 28, "cdp_gate/test_cdp_gate_browser.py": 26, "service/test_service_unit.py": 26,
    "console/test_console_scope.py": 26, "sso/test_sso.py": 25, "daemon/test_django_admin.py": 43,
    "proxy/test_proxy_entry.py": 24, "handoff/test_window_route.py": 80, "stage_exec/test_write_floor_shell.py": 72,
    "daemon/test_write_gate_daemon.py": 60, "daemon/test_runner_guide_live.py": 50,
    "handoff/test_window_desktop_user.py": 30, "console/test_approvals_page.py": 20,
}


def pytest_collection_modifyitems(session, config, items):
    root = Path(__file__).resolve().parent

    def weight(item) -> int:
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        except ValueError:
            return 0
        return SLOW_FILES.get(rel, 0)

    items.sort(key=lambda item: -weight(item))     # stable: a file's own order is kept
