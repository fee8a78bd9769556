"""`sfguard doctor`: what this machine has, and how to get what is missing."""
from __future__ import annotations

import importlib.metadata as md

from sfguard.cli.options import add_home
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.handoff import display_refusal

REQUIRED_PACKAGES = ("mitmproxy", "aiohttp", "pydantic", "PyYAML", "psutil", "keyring",
                     "cryptography", "idna", "psycopg", "psycopg-pool")


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check the tools and packages sfguard needs",
                       description=("Report sfguard's version, the Python packages, agent-browser, "
                                    "the browser, the display and the keyring this machine has, and "
                                    "how to get what is missing. Exit 0 when everything required is "
                                    "present, 1 when something is missing."))
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: {version, ok, checks: [{status, what, detail}]}")
    add_home(p)
    p.add_argument("--store", metavar="URL", help="the store to check: 'local' (default) or "
                   "postgresql://... (default $SFGUARD_STORE)")
    p.set_defaults(func=run)


def _store_checks(args) -> list[tuple[str, str, str]]:
    """The store in use and the key provider behind it (a shared store is connected to)."""
    from sfguard.supervisor.home import resolve_home
    from sfguard.supervisor.profiles.stores import StoreError, describe_store, open_stores, store_url
    from sfguard.supervisor.protocols import ProfileError
    try:
        shared = store_url(getattr(args, "store", None)) is not None
        shown = describe_store(getattr(args, "store", None))
    except StoreError as exc:
        return [("missing", "store", str(exc))]
    home = resolve_home(getattr(args, "home", None))
    if not shared:
        from sfguard.supervisor.profiles.keys import default_key_provider
        return [("ok", "store", "local home (profiles, leases and audit in the guard home)"),
                ("ok", "key provider", default_key_provider(home).describe())]
    from sfguard.supervisor.profiles.pg_schema import NoSchema
    try:   # read-only: doctor migrates and writes nothing
        stores = open_stores(home, None, getattr(args, "store", None), heartbeat=False,
                             read_only=True)
    except NoSchema as exc:
        return [("info", "store", f"{shown}: {exc}")]
    except (ProfileError, StoreError, ValueError) as exc:
        return [("missing", "store", f"{shown}: {exc}")]
    try:
        return [("ok", "store", f"{stores.shown} (schema version {stores.backend.schema_version})"),
                ("ok", "key provider", stores.keys.describe())]
    finally:
        stores.close()


def _keyring_backend() -> tuple[bool, str]:
    try:
        import keyring
        from keyring.backends import fail
    except ImportError as exc:  # keyring itself is a required package; reported above
        return False, f"keyring unusable ({type(exc).__name__})"
    kr = keyring.get_keyring()
    if isinstance(kr, fail.Keyring):
        return False, "no keyring backend: profile keys go to a 0600 key file in the guard home"
    backends = getattr(kr, "backends", None)
    if backends is not None and not backends:
        return False, "no keyring backend: profile keys go to a 0600 key file in the guard home"
    return True, f"{type(kr).__module__}.{type(kr).__name__}"


def _sandbox_check() -> tuple[str, str, str]:
    """Can `sfguard stage-exec` build a stage sandbox here? (not required: stage-exec refuses
    where it cannot, everything else works)."""
    import os

    from sfguard.supervisor.stage import sandbox
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
    if ok:
        return ("ok", "stage sandbox:", detail + note)
    return ("warning", "stage sandbox", "stage-exec will refuse: " + detail + note)


def _browser_user_check() -> tuple[str, str, str]:
    """Who the guard's browsers run as (layer 2 of stage containment): under root, a user of
    its own for each running browser (the default pool's users, checked)."""
    import os

    from sfguard.supervisor.browsers import browser_pool
    if os.geteuid() != 0:
        return ("info", "browser users", "this guard is not root: every browser runs as this one "
                "user, Chromium's sandbox on. A page that escapes one browser's sandbox holds this "
                "user, so the other runs' unsealed logins and browsers too, and a process of this "
                "user (a stage outside stage-exec) reads them. A root guard runs each browser as a "
                "user of its own (docs/threat-model.md, layer 2 and what it does not stop)")
    config = browser_pool.PoolConfig()
    try:
        users = browser_pool.ensure_users(config, create=False)
    except browser_pool.PoolError as exc:
        if "does not exist" in str(exc):
            return ("ok", "browser users:", f"{config.prefix}1..{config.size} (some missing): sfguard start "
                    "or `sfguard service ensure-users` creates them; each browser runs as one of its own, "
                    "Chromium's sandbox on")
        return ("missing", "browser users", f"{exc}: sfguard start refuses them")
    problem = browser_pool.acl_problem()
    if problem:
        return ("missing", "browser users", problem)
    pool = browser_pool.describe_users(users)
    return ("ok", "browser users:", f"browsers run {pool}; {browser_pool.held_count(users)} in use now")


def _proxy_versions_check() -> tuple[str, str, str]:
    """The proxy runs only on the mitmproxy/h11 versions it was tested on (proxy_addons/versions.py)."""
    from sfguard.proxy_addons import versions
    problem = versions.untested()
    if problem is None:
        return ("ok", "proxy versions:", versions.describe())
    return ("missing", "proxy versions", problem)


def _ca_check(args) -> tuple[str, str, str]:
    """Extra certificate authorities (sfguard start --ca-file): certutil, and what a guard
    running on this home trusts (supervisor/browsers/trust.py)."""
    from sfguard.supervisor.browsers import trust
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.home import resolve_home
    if trust.certutil() is None:
        return ("info", "trusted CAs:", "certutil not found (Debian: libnss3-tools): `sfguard start --ca-file` "
                "cannot be used; browsers trust the system's authorities")
    try:
        status, body = GuardClient(resolve_home(getattr(args, "home", None)), timeout=2).call("GET", "/v1/status")
    except (GuardUnavailable, OSError):
        return ("ok", "trusted CAs:", "certutil present: `sfguard start --ca-file PEM` can add authorities")
    cas = body.get("trusted_cas", []) if status == 200 and isinstance(body, dict) else []
    shown = ", ".join(f"{c['subject']} (sha256 {c['sha256'][:16]}...)" for c in cas)
    return ("ok", "trusted CAs:", "the guard on this home: its browsers trust the system's authorities"
            + (f" and {shown}" if shown else " only"))


def run(args) -> int:
    from sfguard.cli.main import version
    checks: list[tuple[str, str, str]] = []   # (status, what, detail)
    for name in REQUIRED_PACKAGES:
        try:
            checks.append(("ok", f"python package {name}", md.version(name)))
        except md.PackageNotFoundError:
            checks.append(("missing", f"python package {name}", "run ./dev setup"))
    for tool in (tools.find_agent_browser(), tools.find_browser()):
        if tool.found:
            checks.append(("ok", tool.name, f"{tool.version or '(version unknown)'} at {tool.path} ({tool.source})"))
        else:
            checks.append(("missing", tool.name, f"{tool.source}; {tool.hint}"))
    disp = tools.display_available()
    refusal = display_refusal() if disp else None
    if disp and refusal:
        checks.append(("info", "display", f"{disp} is set but {refusal}"))
    elif disp:
        checks.append(("ok", "display", f"{disp} is set and answers: headed browsers and local "
                       "login windows work"))
    else:
        note = " (inside a container)" if tools.in_container() else ""
        checks.append(("info", "display", "no display (DISPLAY/WAYLAND_DISPLAY unset)" + note
                       + ": browsers run headless; a local login window is not possible"))
    checks.append(_proxy_versions_check())
    checks.append(_ca_check(args))
    checks.append(_sandbox_check())
    checks.append(_browser_user_check())
    ok, text = _keyring_backend()
    checks.append(("ok" if ok else "info", "keyring", text))
    checks += _store_checks(args)
    missing = sum(1 for c in checks if c[0] == "missing")
    if getattr(args, "json", False):
        import json
        print(json.dumps({"version": version(), "ok": not missing,
                          "checks": [{"status": s, "what": w, "detail": d} for s, w, d in checks]},
                         indent=2))
        return 1 if missing else 0
    lines = [f"ok       sfguard {version()}"]
    for status, what, detail in checks:
        if status == "ok":
            lines.append(f"ok       {what} {detail}")
        elif status == "missing":
            lines.append(f"MISSING  {what}: {detail}")
        elif status == "warning":
            lines.append(f"WARNING  {what}: {detail}")
        else:
            bare = what == "display" or what == "keyring"
            lines.append(f"info     {detail}" if bare else f"info     {what}: {detail}")
    print("\n".join(lines))
    if missing:
        print(f"{missing} required piece(s) missing")
        return 1
    print("everything required is present")
    return 0
