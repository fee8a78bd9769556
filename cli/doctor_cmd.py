"""`sfguard doctor`: what this machine has, and how to get what is missing."""
from __future__ import annotations

import importlib.metadata as md

from supervisor import tools

REQUIRED_PACKAGES = ("mitmproxy", "aiohttp", "pydantic", "PyYAML", "psutil", "keyring",
                     "cryptography", "idna")


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check the tools and packages sfguard needs")
    p.set_defaults(func=run)


def _keyring_backend() -> tuple[bool, str]:
    try:
        import keyring
        from keyring.backends import fail
    except Exception as exc:  # keyring itself is a required package; reported above
        return False, f"keyring unusable ({type(exc).__name__})"
    kr = keyring.get_keyring()
    if isinstance(kr, fail.Keyring):
        return False, "no keyring backend: profile keys go to a 0600 key file in the guard home"
    backends = getattr(kr, "backends", None)
    if backends is not None and not backends:
        return False, "no keyring backend: profile keys go to a 0600 key file in the guard home"
    return True, f"{type(kr).__module__}.{type(kr).__name__}"


def _sandbox_line() -> str:
    """Can `sfguard stage-exec` build a stage sandbox here? (not required: stage-exec refuses
    where it cannot, everything else works)."""
    import os
    from supervisor import sandbox
    user = None
    note = ""
    if os.geteuid() == 0:
        user = sandbox.lookup_user(sandbox.DEFAULT_STAGE_USER)
        if user is None:
            note = f"; stage user {sandbox.DEFAULT_STAGE_USER} missing (sfguard start creates it)"
    else:
        note = ("; the guard is not root: stages run as this user inside the sandbox (a root "
                "guard would run them as an unprivileged stage user)")
    ok, detail = sandbox.probe(user)
    return ("ok       stage sandbox: " if ok else "WARNING  stage sandbox: stage-exec will refuse: ") + detail + note


def run(args) -> int:
    missing = 0
    lines: list[str] = []
    for name in REQUIRED_PACKAGES:
        try:
            lines.append(f"ok       python package {name} {md.version(name)}")
        except md.PackageNotFoundError:
            missing += 1
            lines.append(f"MISSING  python package {name}: run ./dev setup")
    for tool in (tools.find_agent_browser(), tools.find_browser()):
        if tool.found:
            lines.append(f"ok       {tool.name} {tool.version or '(version unknown)'} at {tool.path} ({tool.source})")
        else:
            missing += 1
            lines.append(f"MISSING  {tool.name}: {tool.source}; {tool.hint}")
    disp = tools.display_available()
    if disp:
        lines.append(f"ok       display {disp} is set: headed browsers and local login windows work")
    else:
        note = " (inside a container)" if tools.in_container() else ""
        lines.append("info     no display (DISPLAY/WAYLAND_DISPLAY unset)" + note
                     + ": browsers run headless; a local login window is not possible")
    lines.append(_sandbox_line())
    ok, text = _keyring_backend()
    lines.append(("ok       keyring " if ok else "info     ") + text)
    print("\n".join(lines))
    if missing:
        print(f"{missing} required piece(s) missing")
        return 1
    print("everything required is present")
    return 0
