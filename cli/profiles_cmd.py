"""`sfguard profiles list|show|create|clear|check|login`: the logins kept by the guard.

list/show/create/clear work on the guard home directly (sealed at rest). check and login talk
to the running guard (`sfguard start`) over its control socket: they are short runs of their
own (`check-<random>`, `login-<random>`), so the profile is leased, unsealed, used through the
guard's proxy and resealed exactly as in a pipeline run (sfguard.supervisor.client.ops).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home
from sfguard.supervisor.home import ensure_home, existing_home, upgrade_format
from sfguard.supervisor.profiles.audit import LocalAuditSink
from sfguard.supervisor.profiles.keys import default_key_provider
from sfguard.supervisor.profiles.lease import LocalProfileLease
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.protocols import (
    LOCAL_SCOPE,
    Granted,
    ProfileBusy,
    ProfileError,
    ProfileExists,
    ProfileKey,
    ProfileNameError,
    ProfileNotFound,
)


def _home_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_home(p)
    p.add_argument("--store", metavar="URL", help="'local' (the home, default) or the shared "
                   "postgresql://... store (default $SFGUARD_STORE)")
    return p


def register(sub) -> None:
    home = _home_parent()
    p = sub.add_parser("profiles", help="list, show, create, clear, check and log in to saved browser logins",
                       description=("The browser logins the guard keeps, sealed at rest: list, show, "
                                    "create and clear work on the guard home; check and login go "
                                    "through the running guard (exit 3 when none runs)."))
    psub = p.add_subparsers(dest="profiles_command", metavar="SUBCOMMAND")
    psub.required = True
    a = psub.add_parser("list", parents=[home], help="all profiles of this guard",
                        description="List the profiles of this guard's scope with their state "
                                    "(sealed, unsealed, leased by a run). Creates nothing.")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(func=cmd_list)
    a = psub.add_parser("show", parents=[home], help="one profile",
                        description="Show one profile: created, last used, size, state, lease "
                                    "holder and queue. Exit 1 when there is no such profile.")
    a.add_argument("name", help="profile name")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(func=cmd_show)
    a = psub.add_parser("create", parents=[home], help="create an empty sealed profile",
                        description="Create an empty profile, sealed under this guard's key "
                                    "(the home is created when missing). Exit 1 when it exists.")
    a.add_argument("name", help="profile name")
    a.set_defaults(func=cmd_create)
    a = psub.add_parser("clear", parents=[home], help="delete a profile and its login",
                        description="Delete a profile and the login it holds (asks unless --yes; "
                                    "refused while a run leases it).")
    a.add_argument("name", help="profile name")
    a.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    a.set_defaults(func=cmd_clear)
    a = psub.add_parser("check", parents=[home], help="check a profile's login through the running guard "
                        "(exit 0 logged in, 1 not, 2 error, 3 no guard)",
                        description="Open --url in the profile's browser through the running guard "
                                    "and match the final address: exit 0 logged in, 1 not logged in, "
                                    "2 bad input, 3 no guard running.")
    a.add_argument("name", help="profile name")
    _login_check_args(a, required=True)
    a.set_defaults(func=cmd_check)
    a = psub.add_parser("login", parents=[home], help="open a browser on a profile so a person can log "
                        "in (a visible window, or a live view in the guard's console without a display)",
                        description="Open a visible browser on the profile through the running guard "
                                    "so a person logs in, then reseal it on Enter. Where the guard has "
                                    "no display, print a one-time link to a live view of the login "
                                    "page in the guard's console instead, and reseal on Done there. "
                                    "With --logged-in, check the login afterwards. Exit 3 when no "
                                    "guard runs.")
    a.add_argument("name", help="profile name")
    _login_check_args(a, required=False)
    a.add_argument("--wait", type=float, default=3600, metavar="SECONDS",
                   help="how long to wait for the confirmation (default 3600)")
    a.set_defaults(func=cmd_login)


class _Ctx:
    def __init__(self, args, read_only: bool = False):
        # read-only commands (list, show) never create the home, a key or a lease file
        self.read_only = read_only
        self.home = existing_home(args.home) if read_only else ensure_home(args.home)
        if not read_only:     # a command that writes brings an older home up to this format
            upgrade_format(self.home)
        self.keys = default_key_provider(self.home)
        self.store = LocalProfileStore(self.home, self.keys)
        self.lease = LocalProfileLease(self.home)
        self.audit = LocalAuditSink(self.home)


class _SharedCtx:
    """The shared (PostgreSQL) store: profiles, leases and audit from the database.
    Read-only commands (list, show) open it read-only: nothing is migrated or written, and
    `no_schema` holds the reason when no guard has started on the database yet."""

    def __init__(self, args, read_only: bool = False):
        import atexit

        from sfguard.supervisor.home import resolve_home
        from sfguard.supervisor.profiles.pg_schema import NoSchema
        from sfguard.supervisor.profiles.stores import StoreError, open_stores
        self.read_only = False          # the database answers holders and queues directly
        self.no_schema: str | None = None
        home = resolve_home(args.home)
        try:
            stores = open_stores(home, None, args.store, heartbeat=False, read_only=read_only)
        except NoSchema as exc:
            self.no_schema = str(exc)
            return
        except (StoreError, ProfileError) as exc:
            raise CliError(f"the store cannot be used: {exc}", 2) from None
        atexit.register(stores.close)
        self.home, self.keys = home, stores.keys
        self.store, self.lease, self.audit = stores.store, stores.lease, stores.audit


def _shared(args) -> bool:
    from sfguard.supervisor.profiles.stores import StoreError, store_url
    try:
        return store_url(getattr(args, "store", None)) is not None
    except StoreError as exc:
        raise CliError(str(exc), 2) from None


def _ctx(args, read_only: bool = False):
    return _SharedCtx(args, read_only) if _shared(args) else _Ctx(args, read_only)


def _key(name: str) -> ProfileKey:
    try:
        return ProfileKey(LOCAL_SCOPE, name)
    except ProfileNameError as exc:
        raise CliError(str(exc)) from None


def _when(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _describe(ctx: _Ctx, key: ProfileKey) -> dict:
    info = ctx.store.info(key)
    tracked = not ctx.read_only or ctx.lease.has_state(key)
    holder = ctx.lease.holder(key) if tracked else None
    state = "leased" if holder else ("unsealed" if info.unsealed else "sealed")
    d = {"name": key.name, "scope": key.scope, "created": _when(info.created),
         "last_used": _when(info.last_used), "size": info.size, "state": state,
         "leased_by": holder.run if holder else None,
         "leased_since": _when(holder.since) if holder else None,
         "waiting": [q.run for q in ctx.lease.queue(key)] if tracked else [],
        "identity": info.identity}
    details = getattr(ctx.store, "details", None)     # the shared store keeps more
    if details is not None:
        extra = details(key)
        d["last_login_check"] = _when(extra["last_login_check"])
        d["last_login_ok"] = extra["last_login_ok"]
        if holder is not None and holder.guard:
            d["leased_on"] = f"host {holder.host}, guard {holder.guard}"
    return d


def _line(d: dict) -> str:
    state = d["state"] + (f" by run {d['leased_by']} since {d['leased_since']}" if d["leased_by"] else "")
    return (f"{d['name']:<24} {d['scope']:<8} {d['created']:<21} {d['last_used'] or '-':<21} "
            f"{d['size']:>10}  {state}")


def _no_schema(ctx) -> str | None:
    """Why a shared store has nothing yet (no guard has started on the database), or None."""
    return getattr(ctx, "no_schema", None)


def cmd_list(args) -> int:
    ctx = _ctx(args, read_only=True)
    if _no_schema(ctx):
        if args.json:
            print(json.dumps({"profiles": [], "note": _no_schema(ctx)}, indent=2))
        else:
            print("no profiles")
            print(f"sfguard profiles: {_no_schema(ctx)}", file=sys.stderr)
        return 0
    rows = [_describe(ctx, info.key) for info in ctx.store.list(LOCAL_SCOPE)]
    if args.json:
        print(json.dumps({"profiles": rows, "key_provider": ctx.keys.describe()}, indent=2))
        return 0
    if not rows:
        print("no profiles")
        return 0
    print(f"{'NAME':<24} {'SCOPE':<8} {'CREATED':<21} {'LAST USED':<21} {'SIZE':>10}  STATE")
    for d in rows:
        print(_line(d))
    return 0


def cmd_show(args) -> int:
    ctx = _ctx(args, read_only=True)
    key = _key(args.name)
    if _no_schema(ctx):
        raise CliError(f"no profile {key.name!r}: {_no_schema(ctx)}", 1)
    try:
        d = _describe(ctx, key)
    except ProfileNotFound as exc:
        raise CliError(str(exc), 1) from None
    d["key_provider"] = ctx.keys.describe()
    d["cleaned"] = _last_cleaned(ctx, key.name)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        for k, v in d.items():
            print(f"{k + ':':<14} {v if v not in (None, []) else '-'}")
    return 0


def _last_cleaned(ctx, name: str) -> str | None:
    """When the profile last carried what would run before the guard (a saved session, start-up
    pages, an extension), and what was removed (the audit chain's `profile_cleaned`)."""
    try:
        recs = [r for r in ctx.audit.records(profile=name) if r.get("event") == "profile_cleaned"]
    except (OSError, ValueError):
        return None
    if not recs:
        return None
    f = recs[-1].get("fields") or {}
    return f"{_when(recs[-1].get('ts'))} (run {f.get('run')}): {f.get('removed')}"


def cmd_create(args) -> int:
    ctx = _ctx(args)
    key = _key(args.name)
    from sfguard.supervisor.profiles import store_ops
    try:
        info = store_ops.create_profile(ctx, key)
    except ProfileExists as exc:
        raise CliError(str(exc), 1) from None
    print(f"created profile {key.name} (sealed, {info.size} bytes; keys: {ctx.keys.describe()})")
    return 0


def cmd_clear(args) -> int:
    ctx = _ctx(args)
    key = _key(args.name)
    if not ctx.store.exists(key):
        raise CliError(f"no profile {key.name!r}", 1)
    holder = ctx.lease.holder(key)
    if holder:
        raise CliError(f"profile {key.name} is leased by run {holder.run} since "
                       f"{_when(holder.since)}: wait for that run to end", 1)
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError("not clearing without confirmation: pass --yes", 2)
        answer = input(f"Delete profile {key.name} and the login it holds? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not cleared")
            return 1
    # Hold the lease ourselves while deleting, so no run can be granted it half-way.
    run = f"cli-clear-{os.getpid()}"
    got = ctx.lease.try_acquire(key, run)
    if not isinstance(got, Granted):
        ctx.lease.release(key, run)
        raise CliError(f"profile {key.name} is leased by run {got.holder_run}: wait for that run to end", 1)
    from sfguard.supervisor.profiles import store_ops
    try:
        store_ops.delete_profile(ctx, key, by="cli")
    except ProfileBusy as exc:
        from sfguard.cli.guardhint import with_home
        raise CliError(f"{exc} (a crashed run left it unsealed: `{with_home('sfguard sweep', args.home)}` "
                       "reseals it)", 1) from None
    except ProfileError as exc:
        raise CliError(str(exc), 1) from None
    finally:
        ctx.lease.release(key, run)
    print(f"cleared profile {key.name}")
    return 0


# -- check and login: through the running guard ------------------------------------------------

def _login_check_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--url", required=True, help="the page to open (http:// or https://)")
    p.add_argument("--logged-in", dest="logged_in", required=required, metavar="PATTERN",
                   help="final address pattern when logged in (* wildcards)")
    p.add_argument("--logged-out", dest="logged_out", action="append", default=[], metavar="PATTERN",
                   help="final address pattern when logged out (repeatable)")
    p.add_argument("--selector", help="CSS selector that must be present when logged in")
    p.add_argument("--allow", action="append", default=[], metavar="PATTERNS",
                   help="more hosts the browser may reach (comma separated, repeatable); the "
                        "--url host is always allowed")


def _guard_op(args):
    """The CLI's side of a short guard run (sfguard.supervisor.client.ops.ProfileOps), with errors as CliError."""
    from sfguard.supervisor.client import ops
    from sfguard.supervisor.home import resolve_home

    try:
        return ops.ProfileOps(resolve_home(args.home), args.name, args.url,
                              allow=[p for a in args.allow for p in a.split(",") if p.strip()])
    except ops.OpError as exc:
        raise _op_error(args, exc) from None


def _op_error(args, exc) -> CliError:
    """An OpError as the CLI's answer: no guard -> 3 with a hint that keeps --home; else 2."""
    from sfguard.cli.guardhint import no_guard
    from sfguard.supervisor.client import ops
    from sfguard.supervisor.home import resolve_home
    if isinstance(exc, ops.GuardNotRunning):
        return no_guard(resolve_home(args.home), args.home)
    return CliError(str(exc), 2)


def _check_spec(args) -> dict | None:
    if not args.logged_in:
        if args.logged_out or args.selector:
            raise CliError("--logged-out and --selector need --logged-in", 2)
        return None
    spec = {"url": args.url, "logged_in": args.logged_in, "logged_out": args.logged_out}
    if args.selector:
        spec["selector"] = args.selector
    return spec


def _print_check(name: str, result: dict) -> int:
    if result["logged_in"]:
        print(f"profile {name}: logged in (final address {result['url']})")
        return 0
    print(f"profile {name}: NOT logged in (final address {result['url']})")
    return 1


def cmd_check(args) -> int:
    from sfguard.supervisor.client import ops
    _key(args.name)
    spec = _check_spec(args)
    profile_ops = _guard_op(args)
    try:
        result = profile_ops.check(spec, _note)
    except ops.OpError as exc:
        raise _op_error(args, exc) from None
    return _print_check(args.name, result)


def cmd_login(args) -> int:
    from sfguard.supervisor.client import ops
    _key(args.name)
    spec = _check_spec(args)
    profile_ops = _guard_op(args)
    try:
        session = profile_ops.open_login_window(spec)
    except ops.HandoffRefused as exc:
        print(f"sfguard profiles login: cannot open a login window: {exc}", file=sys.stderr)
        return 1
    except ops.OpError as exc:
        raise _op_error(args, exc) from None
    confirmed = False
    try:
        payload = session.payload
        if payload.get("kind") == "live_view":
            print(f"The guard has no screen: log in to profile {args.name} through the live view "
                  "in its console. Open this one-time link in a browser:")
            print(f"  {payload['url']}")
            print("Sign in there (password, 2FA), then press Done in the page (Cancel aborts).",
                  flush=True)
            state = session.run.wait_handoff(args.wait)
            print(f"live view ended: {state['state']}")
            confirmed = state["state"] == "done"
        else:
            print(f"A browser window is open on {payload.get('url') or args.url} (profile {args.name}).")
            print("Log in there yourself (password, 2FA), then press Enter here. Ctrl-D aborts.",
                  flush=True)
            confirmed = _wait_for_enter(args.wait)
    except ops.OpError as exc:
        print(f"sfguard profiles login: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\naborted")
    finally:
        problems = session.finish(confirmed)
    if problems:
        print("the guard reported problems while closing: " + "; ".join(problems), file=sys.stderr)
    if not confirmed:
        if session.new_profile is not None:
            print(f"not confirmed: the new profile {args.name} was removed again")
        else:
            print(f"not confirmed: the profile {args.name} was resealed as it is")
        return 1
    print(f"confirmed: the browser was closed and profile {args.name} resealed")
    if spec is None:
        return 0 if not problems else 1
    try:
        return _print_check(args.name, profile_ops.check(spec, _note))
    except ops.OpError as exc:
        raise _op_error(args, exc) from None


def _note(message: str) -> None:
    print(f"sfguard profiles: {message}", file=sys.stderr, flush=True)


def _wait_for_enter(timeout: float) -> bool:
    """True when the operator pressed Enter within `timeout` seconds; False on EOF or time-out."""
    import select
    deadline = time.monotonic() + max(timeout, 0)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"no confirmation within {timeout:.0f} s")
            return False
        ready, _, _ = select.select([sys.stdin], [], [], min(left, 1.0))
        if ready:
            return sys.stdin.readline() != ""
