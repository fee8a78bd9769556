"""`sfguard profiles list|show|create|clear`: the logins kept by the guard (sealed at rest)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cli.main import CliError
from supervisor.audit import LocalAuditSink
from supervisor.home import ensure_home
from supervisor.keys import default_key_provider
from supervisor.lease import LocalProfileLease
from supervisor.profiles import LocalProfileStore
from supervisor.protocols import (
    LOCAL_SCOPE, Granted, ProfileBusy, ProfileError, ProfileExists, ProfileKey,
    ProfileNameError, ProfileNotFound,
)


def _home_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--home", metavar="DIR", help="guard home (default $SFGUARD_HOME or ~/.stageflow/guard)")
    return p


def register(sub) -> None:
    home = _home_parent()
    p = sub.add_parser("profiles", help="list, show, create and clear saved browser logins")
    psub = p.add_subparsers(dest="profiles_command", metavar="ACTION")
    psub.required = True
    a = psub.add_parser("list", parents=[home], help="all profiles of this guard")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(func=cmd_list)
    a = psub.add_parser("show", parents=[home], help="one profile")
    a.add_argument("name")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(func=cmd_show)
    a = psub.add_parser("create", parents=[home], help="create an empty sealed profile")
    a.add_argument("name")
    a.set_defaults(func=cmd_create)
    a = psub.add_parser("clear", parents=[home], help="delete a profile and its login")
    a.add_argument("name")
    a.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    a.set_defaults(func=cmd_clear)


class _Ctx:
    def __init__(self, args):
        self.home = ensure_home(args.home)
        self.keys = default_key_provider(self.home)
        self.store = LocalProfileStore(self.home, self.keys)
        self.lease = LocalProfileLease(self.home)
        self.audit = LocalAuditSink(self.home)


def _key(name: str) -> ProfileKey:
    try:
        return ProfileKey(LOCAL_SCOPE, name)
    except ProfileNameError as exc:
        raise CliError(str(exc)) from None


def _when(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _describe(ctx: _Ctx, key: ProfileKey) -> dict:
    info = ctx.store.info(key)
    holder = ctx.lease.holder(key)
    state = "leased" if holder else ("unsealed" if info.unsealed else "sealed")
    return {"name": key.name, "scope": key.scope, "created": _when(info.created),
            "last_used": _when(info.last_used), "size": info.size, "state": state,
            "leased_by": holder.run if holder else None,
            "leased_since": _when(holder.since) if holder else None,
            "waiting": [q.run for q in ctx.lease.queue(key)]}


def _line(d: dict) -> str:
    state = d["state"] + (f" by run {d['leased_by']} since {d['leased_since']}" if d["leased_by"] else "")
    return (f"{d['name']:<24} {d['scope']:<8} {d['created']:<21} {d['last_used'] or '-':<21} "
            f"{d['size']:>10}  {state}")


def cmd_list(args) -> int:
    ctx = _Ctx(args)
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
    ctx = _Ctx(args)
    key = _key(args.name)
    try:
        d = _describe(ctx, key)
    except ProfileNotFound as exc:
        raise CliError(str(exc), 1) from None
    d["key_provider"] = ctx.keys.describe()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        for k, v in d.items():
            print(f"{k + ':':<14} {v if v not in (None, []) else '-'}")
    return 0


def cmd_create(args) -> int:
    ctx = _Ctx(args)
    key = _key(args.name)
    try:
        info = ctx.store.create(key)
    except ProfileExists as exc:
        raise CliError(str(exc), 1) from None
    ctx.audit.record("profile_created", scope=key.scope, profile=key.name)
    print(f"created profile {key.name} (sealed, {info.size} bytes; keys: {ctx.keys.describe()})")
    return 0


def cmd_clear(args) -> int:
    ctx = _Ctx(args)
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
    try:
        ctx.store.delete(key)
    except ProfileBusy as exc:
        raise CliError(f"{exc} (a crashed run left it unsealed: `sfguard sweep` reseals it)", 1) from None
    except ProfileError as exc:
        raise CliError(str(exc), 1) from None
    finally:
        ctx.lease.release(key, run)
    ctx.audit.record("profile_deleted", scope=key.scope, profile=key.name, by="cli")
    print(f"cleared profile {key.name}")
    return 0
