"""The guard as a systemd service: the unit `sfguard service print` writes (docs/sfguard.service).

The guard runs as root so that its browsers (each as a user of its own) and stages run as
unprivileged users (supervisor/browsers/browser_pool.py, supervisor/stage/sandbox.py). The unit
takes from root everything the guard does not use: only CAPABILITIES, HARDENING (a read-only file
system but for the home, a private /tmp and /dev/shm; /home, /root and /run/user hidden; the
DENIED_SYSCALLS groups answered EPERM), LIMITS, and `WatchdogSec=` with the guard sending
WATCHDOG=1 from its event loop (supervisor/daemon/sd_notify.py). The users are made by
`ExecStartPre=+... service ensure-users`, outside the restrictions. An installation, or a file
the guard reads, under a folder the unit hides or empties is refused (`ServiceUnitError`,
`service print` exits 2); MemoryMax= is the operator's (`--memory-max`).
tests/service/test_service_unit.py runs the demo under the same restrictions, emulated.

Why each setting, what each capability is for, what is left out on purpose and the measured
figures behind the limits: docs/decisions/0002-service-unit-watchdog-limits.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sfguard.errors import SfguardError

DEFAULT_HOME = Path("/var/lib/sfguard")
DEFAULT_EXEC = Path("/usr/local/bin/sfguard")
#: Seconds systemd waits for the guard to tear every run down after SIGTERM.
STOP_TIMEOUT_S = 60
#: Seconds without WATCHDOG=1 before systemd kills and restarts the guard (it pings every third).
WATCHDOG_S = 30

#: What a root guard needs and nothing more (see the module text).
CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID")
#: System call groups denied (EPERM): none of them is used by the guard, its proxies or browsers.
DENIED_SYSCALLS = ("@clock", "@cpu-emulation", "@debug", "@module", "@obsolete", "@raw-io",
                   "@reboot", "@swap")

#: Hardening settings of [Service], in the order written.
HARDENING: tuple[tuple[str, str], ...] = (
    ("UMask", "0077"),
    ("NoNewPrivileges", "yes"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "yes"),
    ("PrivateTmp", "yes"),
    ("PrivateMounts", "yes"),
    ("PrivateDevices", "yes"),
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
    ("SystemCallFilter", "~" + " ".join(DENIED_SYSCALLS)),
    ("SystemCallErrorNumber", "EPERM"),
)

#: Resource limits of [Service] (see the module text for the measured figures).
LIMITS: tuple[tuple[str, str], ...] = (
    ("TasksMax", "8192"),           # ~55 runs of one stage at 146 tasks each
    ("LimitNOFILE", "65536"),
    ("OOMPolicy", "continue"),
)

#: Characters a path or name may hold here: none that systemd would expand (`%`, `$`), quote
#: or escape (quotes, backslash), and no white space, so a word needs no quoting.
_SAFE = re.compile(r"[A-Za-z0-9._/+@:,=-]+")
_MEMORY = re.compile(r"(\d+(\.\d+)?[KMGT]?|\d{1,2}%|100%|infinity)")

#: What ProtectHome= hides, and what PrivateTmp= replaces by an empty folder.
HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))
TMP_ROOTS = (Path("/tmp"), Path("/var/tmp"))


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


def _visible(value: Path, what: str, bound: tuple[str, ...] = ()) -> str:
    """A path the guard reads under the unit: not in a folder the unit hides or empties (a
    folder under the homes that the unit binds back, `bound`, is seen)."""
    text = _path(value, what)
    if any(Path(text).is_relative_to(b) for b in bound):
        return text
    for root in (*TMP_ROOTS, *HOME_ROOTS):
        if Path(text).is_relative_to(root):
            why = "PrivateTmp= gives the service an empty one" if root in TMP_ROOTS else "ProtectHome= hides it"
            where = "install sfguard elsewhere, e.g. /opt/sfguard" if "installation" in what or \
                "executable" in what else "put it elsewhere, e.g. in /etc/sfguard"
            raise ServiceUnitError(f"{what} {text} is under {root}, which the unit cannot see ({why}): {where}")
    return text


def under_home_roots(paths: list[Path]) -> list[Path]:
    """Those of `paths` that ProtectHome= would hide (an installation under /root or /home:
    its Python, its venv), each once, outermost first."""
    out: list[Path] = []
    for p in sorted({Path(x) for x in paths}, key=lambda q: len(q.parts)):
        if any(p.is_relative_to(r) and p != r for r in HOME_ROOTS) and not any(p.is_relative_to(o) for o in out):
            out.append(p)
    return out


@dataclass(frozen=True)
class StartOptions:
    """What the unit's `sfguard start` is given (each checked as `sfguard start` would take it,
    except files' contents: those are read when the service starts)."""
    policy: Path | None = None
    api_group: str | None = None
    browser_users: str | None = None
    browser_pool_size: int | None = None
    stage_user: str | None = None
    ca_files: tuple[Path, ...] = ()
    tcp: int | None = None
    token_file: Path | None = None
    console: str | None = None
    console_public: bool = False
    console_url: str | None = None
    console_tls_cert: Path | None = None
    console_tls_key: Path | None = None
    console_trusted_proxy: str | None = None
    console_plain_http: bool = False
    no_console: bool = False
    log_format: str | None = None


def _users(o: StartOptions) -> tuple[list[str], list[str]]:
    """(start's user and group arguments, ensure-users' arguments)."""
    start: list[str] = []
    users: list[str] = []
    for flag, name in (("--api-group", o.api_group), ("--browser-users", o.browser_users),
                       ("--stage-user", o.stage_user)):
        if name is None:
            continue
        if not _SAFE.fullmatch(name) or "/" in name:
            raise ServiceUnitError(f"{flag}: not a user or group name: {name!r}")
        start += [flag, name]
        if flag != "--api-group":
            users += [flag, name]
    if o.browser_pool_size is not None:
        from sfguard.supervisor.browsers.browser_pool import MAX_SIZE  # noqa: PLC0415
        if not 1 <= o.browser_pool_size <= MAX_SIZE:
            raise ServiceUnitError(f"--browser-pool-size: from 1 to {MAX_SIZE}, got {o.browser_pool_size}")
        start += ["--browser-pool-size", str(o.browser_pool_size)]
        users += ["--browser-pool-size", str(o.browser_pool_size)]
    return start, users


def _api_args(o: StartOptions, home: str) -> list[str]:
    if o.tcp is None:
        if o.token_file is not None:
            raise ServiceUnitError("--token-file needs --tcp PORT")
        return []
    if not 0 <= o.tcp <= 65535:
        raise ServiceUnitError(f"--tcp wants a port from 0 to 65535, got {o.tcp}")
    # the token goes to a file in the home, never into the journal (the banner would print it)
    token = _path(o.token_file or Path(home) / "api.token", "--token-file")
    if not Path(token).is_relative_to(home):
        raise ServiceUnitError(f"--token-file {token}: the unit can write only in the home {home}")
    return ["--tcp", str(o.tcp), "--token-file", token]


def _console_args(o: StartOptions, bound: tuple[str, ...]) -> list[str]:
    from sfguard.supervisor.console.listen import ConsoleError, is_loopback, parse_listen
    if o.no_console:
        return ["--no-console"]
    out: list[str] = []
    if o.console is not None:
        try:
            host, _ = parse_listen(o.console)
        except ConsoleError as exc:
            raise ServiceUnitError(str(exc)) from None
        if not is_loopback(host) and not o.console_public:
            raise ServiceUnitError(f"--console {o.console} is not loopback: add --console-public "
                                   "(and TLS, or --console-plain-http)")
        out += ["--console", _path_free(o.console, "--console")]
    for flag, on in (("--console-public", o.console_public), ("--console-plain-http", o.console_plain_http)):
        out += [flag] if on else []
    for flag, value in (("--console-url", o.console_url), ("--console-trusted-proxy", o.console_trusted_proxy)):
        if value is not None:
            out += [flag, _path_free(value, flag)]
    for flag, path in (("--console-tls-cert", o.console_tls_cert), ("--console-tls-key", o.console_tls_key)):
        if path is not None:
            out += [flag, _visible(path, flag, bound)]
    return out


def _path_free(value: str, what: str) -> str:
    """A word (not a path) that goes into ExecStart= as it is."""
    if not _SAFE.fullmatch(value):
        raise ServiceUnitError(f"{what} holds a character this unit does not write: {value!r}")
    return value


def start_args(o: StartOptions, home: str, bound: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """`sfguard start`'s arguments after `--home HOME`, and ensure-users' arguments."""
    args: list[str] = []
    if o.policy is not None:
        args += ["--policy", _visible(o.policy, "the policy file", bound)]
    users_start, users = _users(o)
    args += users_start
    for ca in o.ca_files:
        args += ["--ca-file", _visible(ca, "--ca-file", bound)]
    args += _api_args(o, home)
    args += _console_args(o, bound)
    if o.log_format is not None:
        if o.log_format not in ("text", "json"):
            raise ServiceUnitError(f"--log-format is text or json, got {o.log_format!r}")
        args += ["--log-format", o.log_format]
    return args, users


def _limits(memory_max: str | None) -> list[str]:
    lines = [f"WatchdogSec={WATCHDOG_S}s", *(f"{k}={v}" for k, v in LIMITS)]
    if memory_max is None:
        lines += ["# MemoryMax= is yours to set (sfguard service print --memory-max SIZE): about",
                  "# 250 MB per open run with one stage, 70 MB the guard (docs/operator-guide.md 11)"]
    elif not _MEMORY.fullmatch(memory_max):
        raise ServiceUnitError(f"--memory-max wants a size such as 4G, 512M or 50%, got {memory_max!r}")
    else:
        lines.append(f"MemoryMax={memory_max}")
    return lines


def unit_text(exe: Path = DEFAULT_EXEC, home: Path = DEFAULT_HOME, install_paths: tuple[Path, ...] = (),
              memory_max: str | None = None, **start: object) -> str:
    """The unit file for a guard of home `home` started by the `sfguard` executable `exe`, with
    `start` the StartOptions' fields. `install_paths`: the folders the installation runs from
    (its Python, venv, checkout); those under /home or /root are bound back read-only
    (ProtectHome=tmpfs), else ProtectHome=yes; one under /tmp or /var/tmp is refused."""
    exe_s, home_s = _path(exe, "the sfguard executable"), _path(home, "the guard home")
    if any(Path(home_s).is_relative_to(r) for r in (*HOME_ROOTS, *TMP_ROOTS)):
        raise ServiceUnitError(f"the guard home {home_s} is under "
                               f"{', '.join(map(str, (*HOME_ROOTS, *TMP_ROOTS)))}, which the unit hides "
                               "(ProtectHome=, PrivateTmp=): use a folder such as /var/lib/sfguard")
    binds = tuple(_path(p, "an installation folder")
                  for p in under_home_roots([*install_paths, Path(exe_s).parent]))
    for p in (Path(exe_s), *install_paths):
        _visible(p, "this installation" if p != Path(exe_s) else "the sfguard executable", binds)
    args, users = start_args(StartOptions(**start), home_s, binds)  # type: ignore[arg-type]
    lines = _head(exe_s, home_s, args, users)
    lines += _limits(memory_max)
    if home_s.startswith("/var/lib/") and home_s.rstrip("/") != "/var/lib":
        lines += [f"StateDirectory={home_s[len('/var/lib/'):].rstrip('/')}", "StateDirectoryMode=0700"]
    lines.append(f"ReadWritePaths={home_s}")     # a home elsewhere: made writable by this only
    for k, v in HARDENING:
        if k == "ProtectHome" and binds:
            lines += ["# this installation runs from a home folder: hide the homes but bind it back, read-only",
                      "ProtectHome=tmpfs", "BindReadOnlyPaths=" + " ".join(binds)]
        else:
            lines.append(f"{k}={v}")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def _head(exe_s: str, home_s: str, args: list[str], users: list[str]) -> list[str]:
    return [
        "# sfguard: the guard daemon as a systemd service (made by `sfguard service print`).",
        "# Install, start, logs and upgrade: docs/operator-guide.md, \"Running as a service\".",
        "# Webhook notifications are configured in the home (notify.yaml): no option here.",
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
        "# the browser users (one per running browser) and the stage user: made outside the",
        "# restrictions below (/etc is read-only for the guard)",
        " ".join([f"ExecStartPre=+{exe_s}", "service", "ensure-users", *users]),
        "ExecStart=" + " ".join([exe_s, "start", "--home", home_s, *args]),
        "# SIGTERM to the guard only: it tears every run down itself (browsers closed so that",
        "# cookies are flushed, profiles resealed, leases released); what is left at the timeout",
        "# is killed, and the next start sweeps it",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "Restart=on-failure",
        "RestartSec=5s",
        "# the guard sends WATCHDOG=1 while its event loop runs; silent for WatchdogSec: restarted",
    ]


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
