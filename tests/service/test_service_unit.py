"""The guard as a systemd service (docs/sfguard.service, `sfguard service print`).

What a user of the unit can check: `systemd-analyze verify` says nothing about it, with every
option `service print` takes; `systemd-analyze security` scores it below the 5.3 of the unit
before issue 46; the copy in docs/ is what the command prints; an installation or a file the
unit would hide (/tmp, /var/tmp, the homes) is refused; the guard tells systemd when it is
ready and when it stops (Type=notify), and sends WATCHDOG=1 while its event loop runs and not
while it is blocked; and a whole guarded login (`sfguard demo --auto-login`: real Chromium as
the browser user, real agent-browser, the run proxy, sealing) works under the unit's
restrictions. This machine has no systemd as PID 1, so the last test applies the restrictions
that decide whether the guard works (read-only system, hidden homes, private /tmp, a minimal
/dev, no new privileges, the capability bounding set, the system-call deny list, the umask)
with bubblewrap, setpriv and a seccomp filter, read from the unit's own text. Every test
passes from a checkout under /tmp too (the unit hides /tmp: there `service print` refuses).
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sfguard.supervisor.daemon import sd_notify
from sfguard.supervisor.daemon.service_unit import (
    HOME_ROOTS,
    TMP_ROOTS,
    ServiceUnitError,
    service_settings,
    unit_text,
)
from tests.service.seccomp import deny_filter

ROOT = Path(__file__).resolve().parents[2]
SFGUARD = Path(sys.executable).parent / "sfguard"
#: the checkout and its Python: what the unit would run (hidden by PrivateTmp= under /tmp)
INSTALL = sorted({ROOT, Path(sys.prefix), Path(os.path.realpath(sys.executable)).parent.parent})
UNDER_TMP = [p for p in INSTALL if any(p.is_relative_to(t) for t in TMP_ROOTS)]
#: an executable every machine has, outside what the unit hides: `systemd-analyze verify`
#: checks that ExecStart's file exists, whatever the checkout's place
ANY_EXE = Path(shutil.which("true") or "/bin/true")


def sfguard(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(SFGUARD), *args], capture_output=True, text=True, timeout=60, **kw)


def test_docs_copy_is_the_unit_of_a_system_wide_install():
    """docs/sfguard.service: an installation in /usr/local (nothing under a home to bind back)."""
    assert (ROOT / "docs" / "sfguard.service").read_text() == unit_text(), (
        "regenerate: python -c 'from sfguard.supervisor.daemon.service_unit import unit_text; "
        "print(unit_text(), end=\"\")' > docs/sfguard.service")


EVERY_OPTION = dict(
    home=Path("/srv/guard"), policy=Path("/etc/sfguard/sites.yaml"), api_group="runners",
    browser_users="web-b", browser_pool_size=24, stage_user="web-s",
    ca_files=(Path("/etc/ssl/a.pem"), Path("/etc/ssl/b.pem")),
    tcp=9400, console="0.0.0.0:8443", console_public=True, console_url="https://guard.example.com:8443",
    console_tls_cert=Path("/etc/sfguard/console.crt"), console_tls_key=Path("/etc/sfguard/console.key"),
    log_format="json", memory_max="8G")


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("options", [{}, EVERY_OPTION, dict(console="127.0.0.1:8787", console_url="https://g.example",
                                                              console_trusted_proxy="127.0.0.1", no_console=False)],
                         ids=["defaults", "every-option", "behind-a-proxy"])
def test_systemd_analyze_verify_is_clean(tmp_path, options):
    unit = tmp_path / "sfguard.service"
    unit.write_text(unit_text(ANY_EXE, **options))
    check = analyze("verify", str(unit))
    assert check.returncode == 0 and check.stdout + check.stderr == "", check.stdout + check.stderr


#: systemd-analyze security's score of the unit before issue 46 (docs/sfguard.service then)
SCORE_BEFORE = 5.3


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_security_scores_it_lower_than_before(tmp_path):
    unit = tmp_path / "sfguard.service"
    unit.write_text(unit_text(ANY_EXE, **EVERY_OPTION))
    out = analyze("security", "--offline=yes", str(unit))
    m = re.search(r"Overall exposure level for sfguard\.service: (\d+\.\d)", out.stdout)
    assert out.returncode == 0 and m, out.stdout[-500:] + out.stderr
    assert float(m.group(1)) < SCORE_BEFORE, out.stdout


def test_service_print_runs_this_installation_or_says_why_not():
    """From a checkout under /tmp the unit could not see the executable (PrivateTmp=): refused,
    exit 2, naming it. Anywhere else: a unit that runs this very executable."""
    proc = sfguard("service", "print", "--home", "/srv/guard")
    if UNDER_TMP:
        assert proc.returncode == 2 and "PrivateTmp=" in proc.stderr and proc.stdout == "", proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert service_settings(proc.stdout)["ExecStart"][0].startswith(f"{SFGUARD} start --home /srv/guard")


def test_the_unit_takes_what_the_guard_does_not_need():
    s = service_settings(unit_text())
    assert s["WatchdogSec"] == ["30s"] and s["NotifyAccess"] == ["main"]
    assert int(s["TasksMax"][0]) >= 4096 and int(s["LimitNOFILE"][0]) >= 65536 and s["OOMPolicy"] == ["continue"]
    assert "MemoryMax" not in s          # the operator's: --memory-max
    assert service_settings(unit_text(memory_max="6G"))["MemoryMax"] == ["6G"]
    assert s["PrivateDevices"] == ["yes"] and s["PrivateMounts"] == ["yes"]
    assert s["SystemCallFilter"][0].startswith("~@clock ") and s["SystemCallErrorNumber"] == ["EPERM"]
    assert s["Type"] == ["notify"] and s["KillMode"] == ["mixed"] and s["Restart"] == ["on-failure"]
    assert s["NoNewPrivileges"] == ["yes"] and s["ProtectSystem"] == ["strict"]
    assert s["ProtectHome"] == ["yes"] and s["PrivateTmp"] == ["yes"] and s["UMask"] == ["0077"]
    assert s["ReadWritePaths"] == ["/var/lib/sfguard"] and s["StateDirectoryMode"] == ["0700"]
    assert set(s["CapabilityBoundingSet"][0].split()) == {
        "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"}
    assert int(s["TimeoutStopSec"][0]) >= 30
    assert s["ExecStartPre"][0].startswith("+")   # users made outside the read-only system


def test_the_browser_users_and_pool_size_go_to_start_and_to_ensure_users():
    s = service_settings(unit_text(ANY_EXE, **EVERY_OPTION))
    for line in (s["ExecStart"][0], s["ExecStartPre"][0]):
        words = line.split()
        for flag, value in (("--browser-users", "web-b"), ("--browser-pool-size", "24"), ("--stage-user", "web-s")):
            assert words[words.index(flag) + 1] == value, line
    assert "service ensure-users" in s["ExecStartPre"][0]


@pytest.mark.parametrize("kwargs, word", [
    ({"home": Path("relative/home")}, "absolute"),
    ({"home": Path("/root/guard")}, "ProtectHome"),
    ({"home": Path("/tmp/guard")}, "PrivateTmp"),
    ({"home": Path("/var/lib/a b")}, "character"),
    ({"exe": Path("/opt/$HOME/sfguard")}, "character"),
    ({"exe": Path("/tmp/venv/bin/sfguard")}, "PrivateTmp"),
    ({"install_paths": (Path("/var/tmp/checkout"),)}, "PrivateTmp"),
    ({"policy": Path("/etc/%n.yaml")}, "character"),
    ({"policy": Path("/tmp/sites.yaml")}, "PrivateTmp"),
    ({"ca_files": (Path("/root/ca.pem"),)}, "ProtectHome"),
    ({"console_tls_key": Path("/home/op/console.key")}, "ProtectHome"),
    ({"api_group": "a b"}, "not a user or group"),
    ({"browser_users": "../x"}, "not a user or group"),
    ({"browser_pool_size": 0}, "--browser-pool-size"),
    ({"browser_pool_size": 100000}, "--browser-pool-size"),
    ({"tcp": 70000}, "port"),
    ({"tcp": 9400, "token_file": Path("/etc/sfguard/token")}, "only in the home"),
    ({"token_file": Path("/var/lib/sfguard/t")}, "needs --tcp"),
    ({"console": "0.0.0.0:8443"}, "--console-public"),
    ({"console": "guard.lan"}, "not an IP address"),
    ({"console_url": "https://g.example/$x"}, "character"),
    ({"log_format": "xml"}, "text or json"),
    ({"memory_max": "lots"}, "--memory-max"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_cannot_go_into_a_unit_is_refused(kwargs, word):
    with pytest.raises(ServiceUnitError, match=word):
        unit_text(**kwargs)


def test_an_installation_under_a_home_is_bound_back_read_only():
    text = unit_text(install_paths=(Path("/root/.pyenv/versions/3.11.7"), Path("/root/.pyenv/versions/3.11.7/lib"),
                                    Path("/opt/sfguard")))
    s = service_settings(text)
    assert s["ProtectHome"] == ["tmpfs"]
    assert s["BindReadOnlyPaths"] == ["/root/.pyenv/versions/3.11.7"]


class Manager:
    """The service manager's end of NOTIFY_SOCKET: every datagram with its arrival time."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.got: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.got.append((time.monotonic(), self.sock.recv(4096)))
            except TimeoutError:
                continue

    def wait_for(self, message: bytes, timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, m in list(self.got):
                if m == message:
                    return at
            time.sleep(0.05)
        raise AssertionError(f"no {message!r} within {timeout} s: {self.got[-5:]}")

    def pings(self, start: float, end: float) -> list[float]:
        return [at for at, m in self.got if m == b"WATCHDOG=1" and start <= at <= end]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("watchdog_usec", [None, "600000"], ids=["no-watchdog", "watchdog-0.6s"])
def test_ready_watchdog_and_stopping_reach_the_service_manager(tmp_path, watchdog_usec):
    """Type=notify: READY=1 once the API serves; with WatchdogSec (systemd's $WATCHDOG_USEC)
    WATCHDOG=1 every third of it, and none without; STOPPING=1 on SIGTERM, then a clean exit."""
    manager = Manager(tmp_path / "notify.sock")
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify.sock"), SFGUARD_HOME=str(tmp_path / "home"))
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    if watchdog_usec:
        env["WATCHDOG_USEC"] = watchdog_usec
    guard = subprocess.Popen([str(SFGUARD), "start", "--no-console"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        ready = manager.wait_for(b"READY=1")
        assert (tmp_path / "home" / "guard.sock").exists()          # ready means the API answers
        status = sfguard("status", "--json", env=dict(os.environ, SFGUARD_HOME=str(tmp_path / "home")))
        assert status.returncode == 0, status.stderr
        time.sleep(max(0.0, ready + 2.0 - time.monotonic()))
        pings = manager.pings(ready, ready + 2.0)
        if watchdog_usec:
            assert len(pings) >= 6, pings          # every 0.2 s: about 10 in 2 s
            assert max(b - a for a, b in zip(pings, pings[1:], strict=False)) < 0.6
        else:
            assert [m for _, m in manager.got if m == b"WATCHDOG=1"] == []
        guard.send_signal(signal.SIGTERM)
        manager.wait_for(b"STOPPING=1")
        assert guard.wait(timeout=60) == 0
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.wait(timeout=30)
        manager.close()


def test_watchdog_pings_stop_while_the_event_loop_is_blocked(tmp_path, monkeypatch):
    """The pings come from the loop itself: a loop blocked for 1.5 s sends none in that time
    (systemd would then restart the guard), and they resume once it runs again."""
    manager = Manager(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "300000")          # a ping every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)

    async def guard_loop() -> tuple[float, float, float]:
        pinger = sd_notify.start_keep_alive()
        assert pinger is not None
        await asyncio.sleep(0.6)
        blocked = time.monotonic()
        time.sleep(1.5)                                     # a call that blocks the loop
        resumed = time.monotonic()
        await asyncio.sleep(0.6)
        pinger.cancel()
        return blocked, resumed, time.monotonic()

    try:
        blocked, resumed, end = asyncio.run(guard_loop())
        time.sleep(0.2)
        pings = manager.pings(blocked - 1.0, end + 1.0)
        gaps = [b - a for a, b in zip(pings, pings[1:], strict=False)]
        # arrival times, read by a thread that may itself wait a little under load: a gap as
        # long as the block, and pings on both sides of it at the loop's pace
        assert max(gaps) >= 1.3, gaps
        assert len(manager.pings(blocked - 0.6, blocked)) >= 3
        assert len(manager.pings(resumed + 0.2, end + 0.2)) >= 3
    finally:
        manager.close()
    monkeypatch.setenv("WATCHDOG_PID", "1")                  # meant for another process: none
    assert sd_notify.watchdog_interval() is None


def _emulation(settings: dict[str, list[str]], rw: Path, seccomp_fd: int | None,
               installed: list[Path]) -> list[str]:
    """bubblewrap + setpriv arguments for the unit's file-system, device, system-call and
    privilege settings. `installed`: this checkout's folders under /tmp, bound back read-only
    (the unit itself refuses such an installation; here the checkout stands for /usr/local)."""
    assert settings["ProtectSystem"] == ["strict"]
    args = ["bwrap", "--die-with-parent", "--ro-bind", "/", "/"]
    if settings.get("PrivateDevices") == ["yes"]:
        # systemd's private /dev: the pseudo devices, a new devpts, and the host's /dev/shm
        args += ["--dev", "/dev", "--bind", "/dev/shm", "/dev/shm"]
    else:
        args += ["--dev-bind", "/dev", "/dev"]
    args += ["--proc", "/proc"]
    if settings.get("PrivateTmp") == ["yes"]:
        args += ["--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    if settings.get("ProtectHome", ["no"])[0] in ("yes", "tmpfs"):
        args += [a for r in HOME_ROOTS if r.is_dir() for a in ("--tmpfs", str(r))]
    for value in settings.get("BindReadOnlyPaths", []):
        args += [a for p in value.split() for a in ("--ro-bind", p, p)]
    args += [a for p in installed for a in ("--ro-bind", str(p), str(p))]
    for value in settings["ReadWritePaths"]:
        assert value == str(rw)
        args += ["--bind", value, value]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--chdir", "/", "--"]
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in settings["CapabilityBoundingSet"][0].split())
    if settings.get("NoNewPrivileges") == ["yes"]:
        args += ["setpriv", "--no-new-privs"]
    else:
        args += ["setpriv"]
    args += ["--bounding-set", f"-all,{caps}", "--inh-caps", "-all", "--",
             "sh", "-c", f'umask {settings["UMask"][0]} && exec "$@"', "sh"]
    return args


@pytest.fixture
def unit_home():
    """A home the unit can take: not under /tmp (PrivateTmp= would empty it) nor the homes."""
    import tempfile
    base = Path(tempfile.mkdtemp(prefix="sfguard-unit-", dir="/dev/shm"))
    try:
        yield base / "home"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.browser
@pytest.mark.skipif(os.geteuid() != 0, reason="the unit runs the guard as root (browsers as their own user)")
@pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("setpriv") is None
                    or shutil.which("systemd-analyze") is None,
                    reason="needs bubblewrap, setpriv and systemd-analyze to apply the unit's restrictions")
def test_a_guarded_login_works_under_the_units_restrictions(unit_home):
    home = unit_home
    if UNDER_TMP:      # `service print` refuses this checkout (tested above): the same unit, made directly
        text = unit_text(home=home, install_paths=tuple(p for p in INSTALL if p not in UNDER_TMP))
    else:
        text = sfguard("service", "print", "--home", str(home)).stdout
    settings = service_settings(text)
    pre = [str(SFGUARD), *settings["ExecStartPre"][0].removeprefix("+").split()[1:]]
    assert subprocess.run(pre, capture_output=True, text=True, timeout=60).returncode == 0
    env = dict(os.environ)
    for value in settings["Environment"]:
        key, _, v = value.partition("=")
        env[key] = v
    denied = settings["SystemCallFilter"][0]
    assert denied.startswith("~") and settings["SystemCallErrorNumber"] == ["EPERM"]
    with deny_filter(denied[1:].split()) as bpf:
        fd = bpf.fileno()

        def under_unit(*argv: str, timeout: float) -> subprocess.CompletedProcess:
            bpf.seek(0)
            return subprocess.run(_emulation(settings, home, fd, UNDER_TMP) + list(argv), capture_output=True,
                                  text=True, timeout=timeout, env=env, pass_fds=(fd,))
        home.mkdir(mode=0o700)
        proc = under_unit(str(SFGUARD), "demo", "--auto-login", "--home", str(home), timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert "sfguard demo: ok" in out
        assert "run 2: the check said logged in" in out      # the login was sealed and reused
        # the restrictions were in force: the guard could write nothing outside its home, open
        # no device but the pseudo ones, and a denied call fails with EPERM
        probe = under_unit("touch", "/etc/sfguard-probe", timeout=60)
        assert probe.returncode != 0 and not Path("/etc/sfguard-probe").exists()
        devices = under_unit("ls", "/dev", timeout=60)
        seen = set(devices.stdout.split())
        assert devices.returncode == 0 and {"null", "shm"} <= seen, seen
        assert not seen & {"kmsg", "loop0", "kvm", "fuse"}, seen
        call = under_unit(sys.executable, "-c", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
                          "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())", timeout=60)
        assert call.stdout.split() == ["-1", "1"], call.stdout + call.stderr
