"""The guard as a systemd service: the unit `sfguard service print` writes (docs/sfguard.service).

The guard runs as root so that its browsers and stages run as their own unprivileged users
(supervisor/browsers/browser_user.py, supervisor/stage/sandbox.py). The unit takes from root
everything the guard does not use. Each setting below was checked against a real run of
`sfguard demo --auto-login` under the same restrictions (tests/cli/test_service_unit.py emulates
them with bubblewrap and setpriv, because this machine has no systemd as PID 1):

- capabilities: CAP_SETUID and CAP_SETGID start a browser as its user; CAP_CHOWN hands it the
  unsealed profile; CAP_FOWNER and CAP_DAC_OVERRIDE let root reseal and remove what that user
  wrote; CAP_KILL ends a browser user's processes on teardown and after a crash. Without any
  one of the first five the demo fails (measured); CAP_KILL is needed only on those paths.
- the file system is read-only but for the home (StateDirectory), a private /tmp and /dev/shm
  (where unsealed profiles live, memory-backed); /home, /root and /run/user are hidden.
- users are made by `ExecStartPre=+... service ensure-users`, which runs outside the
  restrictions: /etc is read-only for the guard itself.

Left out on purpose, because the guard's browsers need them: MemoryDenyWriteExecute (V8's JIT),
RestrictNamespaces and PrivateUsers (Chromium's sandbox uses user namespaces), PrivateDevices
(Chromium's shared memory), PrivateNetwork (the run proxies reach the sites), SystemCallFilter
(Chromium's sandbox needs calls outside @system-service).
"""
from __future__ import annotations

import re
from pathlib import Path

from sfguard.errors import SfguardError

DEFAULT_HOME = Path("/var/lib/sfguard")
DEFAULT_EXEC = Path("/usr/local/bin/sfguard")
#: Seconds systemd waits for the guard to tear every run down after SIGTERM.
STOP_TIMEOUT_S = 60

#: What a root guard needs and nothing more (see the module text).
CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID")

#: Hardening settings of [Service], in the order written.
HARDENING: tuple[tuple[str, str], ...] = (
    ("UMask", "0077"),
    ("NoNewPrivileges", "yes"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "yes"),
    ("PrivateTmp", "yes"),
    ("CapabilityBoundingSet", " ".join(CAPABILITIES)),
    ("AmbientCapabilities", ""),
    ("ProtectKernelTunables", "yes"),
    ("ProtectKernelModules", "yes"),
    ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"),
    ("ProtectClock", "yes"),
    ("ProtectHostname", "yes"),
    ("LockPersonality", "yes"),
    ("RestrictRealtime", "yes"),
    ("RestrictSUIDSGID", "yes"),
    ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6 AF_NETLINK"),
    ("SystemCallArchitectures", "native"),
)


#: Characters a path or name may hold here: none that systemd would expand (`%`, `$`), quote
#: or escape (quotes, backslash), and no white space, so a word needs no quoting.
_SAFE = re.compile(r"[A-Za-z0-9._/+@:,=-]+")


class ServiceUnitError(SfguardError):
    """An argument that cannot go into a unit (a relative path, a line break)."""


def _path(value: Path, what: str) -> str:
    text = str(value)
    if not Path(text).is_absolute():
        raise ServiceUnitError(f"{what} must be an absolute path, got {text!r}")
    if not _SAFE.fullmatch(text):
        raise ServiceUnitError(f"{what} holds a character this unit does not write (only letters, "
                               f"digits and ._/+@:,=- are taken): {text!r}")
    return text




#: What ProtectHome= hides.
HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))


def under_home_roots(paths: list[Path]) -> list[Path]:
    """Those of `paths` that ProtectHome= would hide (an installation under /root or /home:
    its Python, its venv), each once, outermost first."""
    out: list[Path] = []
    for p in sorted({Path(x) for x in paths}, key=lambda q: len(q.parts)):
        if any(p.is_relative_to(r) and p != r for r in HOME_ROOTS) and not any(p.is_relative_to(o) for o in out):
            out.append(p)
    return out


def unit_text(exe: Path = DEFAULT_EXEC, home: Path = DEFAULT_HOME, policy: Path | None = None,
              api_group: str | None = None, browser_user: str | None = None,
              stage_user: str | None = None, install_paths: tuple[Path, ...] = ()) -> str:
    """The unit file for a guard of home `home` started by the `sfguard` executable `exe`.
    `install_paths`: the folders the installation runs from (its Python, venv, checkout); those
    under /home or /root are bound back read-only (ProtectHome=tmpfs), else ProtectHome=yes."""
    exe_s, home_s = _path(exe, "the sfguard executable"), _path(home, "the guard home")
    if any(Path(home_s).is_relative_to(r) for r in HOME_ROOTS):
        raise ServiceUnitError(f"the guard home {home_s} is under {', '.join(map(str, HOME_ROOTS))}, "
                               "which the unit hides (ProtectHome=): use a folder such as /var/lib/sfguard")
    binds = [_path(p, "an installation folder") for p in under_home_roots([*install_paths, Path(exe_s).parent])]
    if not home_s.startswith("/var/lib/") or home_s.rstrip("/") == "/var/lib":
        state = None   # a home elsewhere: made writable by ReadWritePaths only
    else:
        state = home_s[len("/var/lib/"):].rstrip("/")
    start = [exe_s, "start", "--home", home_s]
    if policy is not None:
        start += ["--policy", _path(policy, "the policy file")]
    users: list[str] = []
    for flag, name in (("--api-group", api_group), ("--browser-user", browser_user),
                       ("--stage-user", stage_user)):
        if name is None:
            continue
        if not _SAFE.fullmatch(name) or "/" in name:
            raise ServiceUnitError(f"{flag}: not a user or group name: {name!r}")
        start += [flag, name]
        if flag != "--api-group":
            users += [flag, name]
    lines = [
        "# sfguard: the guard daemon as a systemd service (made by `sfguard service print`).",
        "# Install, start, logs and upgrade: docs/operator-guide.md, \"Running as a service\".",
        "[Unit]",
        "Description=sfguard guard daemon (guarded, logged-in browsers for pipeline stages)",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"Environment=SFGUARD_HOME={home_s}",
        "Environment=PYTHONUNBUFFERED=1",
        "# the browser and stage users: made outside the restrictions below (/etc is read-only)",
        " ".join([f"ExecStartPre=+{exe_s}", "service", "ensure-users", *users]),
        "ExecStart=" + " ".join(start),
        "# SIGTERM to the guard only: it tears every run down itself (browsers closed so that",
        "# cookies are flushed, profiles resealed, leases released); what is left at the timeout",
        "# is killed, and the next start sweeps it",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "Restart=on-failure",
        "RestartSec=5s",
    ]
    if state is not None:
        lines += [f"StateDirectory={state}", "StateDirectoryMode=0700"]
    lines.append(f"ReadWritePaths={home_s}")
    for k, v in HARDENING:
        if k == "ProtectHome" and binds:
            lines += ["# this installation runs from a home folder: hide the homes but bind it back, read-only",
                      "ProtectHome=tmpfs", "BindReadOnlyPaths=" + " ".join(binds)]
        else:
            lines.append(f"{k}={v}")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def service_settings(text: str) -> dict[str, list[str]]:
    """The [Service] section of a unit as key -> values (a key may repeat). For tests and
    for `sfguard doctor`-like readers; comments and blank lines are skipped."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out
