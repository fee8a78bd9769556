"""The guard as a systemd service (docs/sfguard.service, `sfguard service print`).

What a user of the unit can check: `systemd-analyze verify` says nothing about it; the copy in
docs/ is what the command prints; the guard tells systemd when it is ready and when it stops
(Type=notify); and a whole guarded login (`sfguard demo --auto-login`: real Chromium as the
browser user, real agent-browser, the run proxy, sealing) works under the unit's restrictions.
This machine has no systemd as PID 1, so the last test applies the restrictions that decide
whether the guard works (read-only system, hidden homes, private /tmp, no new privileges, the
capability bounding set, the umask) with bubblewrap and setpriv, read from the unit's own text.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sfguard.supervisor.daemon.service_unit import HOME_ROOTS, ServiceUnitError, service_settings, unit_text

ROOT = Path(__file__).resolve().parents[2]
SFGUARD = Path(sys.executable).parent / "sfguard"


def sfguard(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(SFGUARD), *args], capture_output=True, text=True, timeout=60, **kw)


def test_docs_copy_is_the_unit_of_a_system_wide_install():
    """docs/sfguard.service: an installation in /usr/local (nothing under a home to bind back)."""
    assert (ROOT / "docs" / "sfguard.service").read_text() == unit_text(), (
        "regenerate: python -c 'from sfguard.supervisor.daemon.service_unit import unit_text; "
        "print(unit_text(), end=\"\")' > docs/sfguard.service")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("extra", [
    (), ("--home", "/srv/guard", "--api-group", "runners", "--policy", "/etc/sfguard/sites.yaml"),
], ids=["defaults", "options"])
def test_systemd_analyze_verify_is_clean(tmp_path, extra):
    proc = sfguard("service", "print", *extra)   # the real executable: verify checks it exists
    assert proc.returncode == 0, proc.stderr
    unit = tmp_path / "sfguard.service"
    unit.write_text(proc.stdout)
    check = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout + check.stderr == "", check.stdout + check.stderr


def test_the_unit_takes_what_the_guard_does_not_need():
    s = service_settings(unit_text())
    assert s["Type"] == ["notify"] and s["KillMode"] == ["mixed"] and s["Restart"] == ["on-failure"]
    assert s["NoNewPrivileges"] == ["yes"] and s["ProtectSystem"] == ["strict"]
    assert s["ProtectHome"] == ["yes"] and s["PrivateTmp"] == ["yes"] and s["UMask"] == ["0077"]
    assert s["ReadWritePaths"] == ["/var/lib/sfguard"] and s["StateDirectoryMode"] == ["0700"]
    assert set(s["CapabilityBoundingSet"][0].split()) == {
        "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"}
    assert int(s["TimeoutStopSec"][0]) >= 30
    assert s["ExecStartPre"][0].startswith("+")   # users made outside the read-only system


@pytest.mark.parametrize("kwargs, word", [
    ({"home": Path("relative/home")}, "absolute"),
    ({"home": Path("/root/guard")}, "ProtectHome"),
    ({"home": Path("/var/lib/a b")}, "character"),
    ({"exe": Path("/opt/$HOME/sfguard")}, "character"),
    ({"policy": Path("/etc/%n.yaml")}, "character"),
    ({"api_group": "a b"}, "not a user or group"),
    ({"browser_user": "../x"}, "not a user or group"),
])
def test_what_cannot_go_into_a_unit_is_refused(kwargs, word):
    with pytest.raises(ServiceUnitError, match=word):
        unit_text(**kwargs)


def test_an_installation_under_a_home_is_bound_back_read_only():
    text = unit_text(install_paths=(Path("/root/.pyenv/versions/3.11.7"), Path("/root/.pyenv/versions/3.11.7/lib"),
                                    Path("/opt/sfguard")))
    s = service_settings(text)
    assert s["ProtectHome"] == ["tmpfs"]
    assert s["BindReadOnlyPaths"] == ["/root/.pyenv/versions/3.11.7"]


def test_ready_and_stopping_reach_the_service_manager(tmp_path):
    """Type=notify: READY=1 once the API serves, STOPPING=1 on SIGTERM, then a clean exit."""
    addr = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(addr)
        manager.settimeout(60)
        env = dict(os.environ, NOTIFY_SOCKET=addr, SFGUARD_HOME=str(tmp_path / "home"))
        guard = subprocess.Popen([str(SFGUARD), "start", "--no-console"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            assert manager.recv(4096) == b"READY=1"
            sock = tmp_path / "home" / "guard.sock"
            assert sock.exists()          # ready means the API answers
            status = sfguard("status", "--json", env=dict(os.environ, SFGUARD_HOME=str(tmp_path / "home")))
            assert status.returncode == 0, status.stderr
            guard.send_signal(signal.SIGTERM)
            assert manager.recv(4096) == b"STOPPING=1"
            assert guard.wait(timeout=60) == 0
        finally:
            if guard.poll() is None:
                guard.kill()
                guard.wait(timeout=30)


def _emulation(settings: dict[str, list[str]], rw: Path) -> list[str]:
    """bubblewrap + setpriv arguments for the unit's file-system and privilege settings."""
    assert settings["ProtectSystem"] == ["strict"]
    args = ["bwrap", "--die-with-parent", "--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev",
            "--proc", "/proc"]
    if settings.get("PrivateTmp") == ["yes"]:
        args += ["--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    if settings.get("ProtectHome", ["no"])[0] in ("yes", "tmpfs"):
        args += [a for r in HOME_ROOTS if r.is_dir() for a in ("--tmpfs", str(r))]
    for value in settings.get("BindReadOnlyPaths", []):
        args += [a for p in value.split() for a in ("--ro-bind", p, p)]
    for value in settings["ReadWritePaths"]:
        assert value == str(rw)
        args += ["--bind", value, value]
    args += ["--chdir", "/", "--"]
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in settings["CapabilityBoundingSet"][0].split())
    if settings.get("NoNewPrivileges") == ["yes"]:
        args += ["setpriv", "--no-new-privs"]
    else:
        args += ["setpriv"]
    args += ["--bounding-set", f"-all,{caps}", "--inh-caps", "-all", "--",
             "sh", "-c", f'umask {settings["UMask"][0]} && exec "$@"', "sh"]
    return args


@pytest.mark.browser
@pytest.mark.skipif(os.geteuid() != 0, reason="the unit runs the guard as root (browsers as their own user)")
@pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("setpriv") is None,
                    reason="needs bubblewrap and setpriv to apply the unit's restrictions")
def test_a_guarded_login_works_under_the_units_restrictions(tmp_path):
    home = tmp_path / "home"
    text = sfguard("service", "print", "--home", str(home)).stdout
    settings = service_settings(text)
    pre = settings["ExecStartPre"][0].removeprefix("+").split()
    assert subprocess.run(pre, capture_output=True, text=True, timeout=60).returncode == 0
    env = dict(os.environ)
    for value in settings["Environment"]:
        key, _, v = value.partition("=")
        env[key] = v
    cmd = _emulation(settings, home) + [str(SFGUARD), "demo", "--auto-login", "--home", str(home)]
    home.mkdir(mode=0o700)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "sfguard demo: ok" in out
    assert "run 2: the check said logged in" in out      # the login was sealed and reused
    # the restrictions were in force: the guard could write nothing outside its home
    probe = subprocess.run(_emulation(settings, home) + ["touch", "/etc/sfguard-probe"],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and not Path("/etc/sfguard-probe").exists()
