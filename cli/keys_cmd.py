"""`sfguard keys status|rotate|retire`: the key versions that seal the profiles and key the audit.

status reads the home (or the shared store) and creates nothing. rotate asks the guard running
on the home to rotate (`POST /v1/keys/rotate`), else rotates itself; retire works on the home
or store directly. The work is in sfguard.supervisor.profiles.rotation.
"""
from __future__ import annotations

import argparse
import atexit
import json
import time

from sfguard.cli.errors import CliError
from sfguard.cli.options import add_home
from sfguard.supervisor.home import ensure_home, existing_home, resolve_home, upgrade_format
from sfguard.supervisor.protocols import ProfileError, StoreUnavailable


def register(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    add_home(common)
    common.add_argument("--store", metavar="URL", help="'local' (the home, default) or the shared "
                        "postgresql://... store (default $SFGUARD_STORE)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("keys", help="key versions: status, rotate, retire",
                       description=("The key versions that seal the profiles and key the audit "
                                    "chain: status shows them and what each covers, rotate moves "
                                    "everything to a new version (through the running guard when "
                                    "one runs), retire drops an old version nothing uses."))
    ksub = p.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    ksub.required = True
    a = ksub.add_parser("status", parents=[common], help="versions, where each lives, what each covers",
                        description="Show every key version (current, old, retired), where its keys "
                                    "live, and how many profiles and audit segments and records each "
                                    "covers, and a rotation under way. Creates nothing. Exit 0, 1 when "
                                    "this host has not got the current version's keys.")
    a.set_defaults(func=cmd_status)
    a = ksub.add_parser("rotate", parents=[common], help="a new key version for every profile and the audit",
                        description="Make a new key version current and reseal every profile at rest "
                                    "under it; a profile a run holds is resealed when the run ends. A "
                                    "guard running on the home does it (its runs go on); without one, "
                                    "this command does. A rotation a crash left is finished instead. "
                                    "Exit 0 done (or waiting for leased profiles), 1 refused (another "
                                    "rotation under way, the new key not on this host), 2 usage.")
    a.set_defaults(func=cmd_rotate)
    a = ksub.add_parser("retire", parents=[common], help="drop an old key version nothing uses",
                        description="Delete the keys of an old version once no profile is sealed "
                                    "under it; otherwise name what still uses it. Exit 0 retired, 1 "
                                    "something still uses it, 2 not an old version of this store.")
    a.add_argument("version", metavar="VERSION", help="the key version to retire (a number)")
    a.set_defaults(func=cmd_retire)


def _stores(args, read_only: bool):
    """The seams of the store setting; read-only opens an existing home and changes nothing."""
    from sfguard.supervisor.profiles.pg_schema import NoSchema
    from sfguard.supervisor.profiles.stores import StoreError, open_stores, store_url
    try:
        shared = store_url(args.store) is not None
    except StoreError as exc:
        raise CliError(str(exc), 2) from None
    if shared:
        home = resolve_home(args.home)
    elif read_only:
        home = existing_home(args.home)
    else:
        home = ensure_home(args.home)
        upgrade_format(home)
    try:
        stores = open_stores(home, None, args.store, heartbeat=not read_only, read_only=read_only)
    except NoSchema as exc:
        raise CliError(str(exc), 2) from None
    except ProfileError as exc:
        raise CliError(f"the store cannot be used: {exc}", 2) from None
    atexit.register(stores.close)
    return home, stores


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def cmd_status(args) -> int:
    from sfguard.supervisor.profiles.rotation import key_status
    _home, stores = _stores(args, read_only=True)
    try:
        status = key_status(stores)
    except (ProfileError, StoreUnavailable) as exc:
        raise CliError(str(exc), 2) from None
    held = all(v["available"] for v in status["versions"] if v["state"] == "current")
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0 if held else 1
    print(f"current key version: {status['current']} ({status['key_provider']})")
    print(f"{'version':>7}  {'state':<9} {'profiles':>8} {'audit segments':>14} {'records':>8}  where")
    for v in status["versions"]:
        state = v["state"] + ("" if v["available"] or v["state"] == "retired" else "!")
        where = v["where"] + (f" (retired {_when(v['retired'])})" if v["retired"] else "")
        print(f"{v['version']:>7}  {state:<9} {v['profiles']:>8} {v['audit_segments']:>14} "
              f"{v['audit_records']:>8}  {where}")
    rot = status["rotation"]
    if rot is not None:
        print(f"rotation {rot['from_version']} -> {rot['to_version']} under way since "
              f"{_when(rot['started'])}: {len(rot['remaining'])} profile(s) still on an older version")
    for p in status["old_profiles"]:
        holder = f", leased by run {p['leased_by']}: resealed when that run ends" if p["leased_by"] else ""
        print(f"  {p['scope']}/{p['profile']}: version {p['version']}{holder}")
    if not held:
        print("this host has not got the current key version's keys: seals and audit records "
              "are refused here until it has (docs/deployment.md)")
    return 0 if held else 1


def _through_guard(args, home) -> dict | None:
    """The running guard's answer to POST /v1/keys/rotate, or None when no guard runs here."""
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.profiles.stores import describe_store
    client = GuardClient(home, timeout=3600)
    try:
        st, status = client.call("GET", "/v1/status")
    except GuardUnavailable:
        return None
    mine = describe_store(args.store)
    theirs = (status.get("guard") or {}).get("store") if st == 200 else None
    if theirs != mine:
        raise CliError(f"the guard running on {home} uses the store {theirs}, not {mine}: give "
                       "that --store (the guard rotates its own store), or stop the guard", 2)
    st, answer = client.call("POST", "/v1/keys/rotate")
    if st != 200:
        err = (answer or {}).get("error") or {}
        raise CliError(f"the guard refused the rotation: {err.get('message', st)}", 1)
    answer["by"] = "the running guard"
    return answer


def cmd_rotate(args) -> int:
    from sfguard.supervisor.profiles.keys import KeyMissing
    from sfguard.supervisor.profiles.rotation import KeysBusy, KeyStateError, rotate
    home = resolve_home(args.home)
    report = _through_guard(args, home) if home.is_dir() else None
    if report is None:
        home, stores = _stores(args, read_only=False)
        try:
            report = rotate(stores, by="cli")
        except (KeysBusy, KeyMissing, KeyStateError) as exc:
            raise CliError(str(exc), 1) from None
        except StoreUnavailable as exc:
            raise CliError(str(exc), 2) from None
        report["by"] = "this command (no guard runs on the home)"
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    verb = "resumed" if report["resumed"] else "rotated"
    print(f"{verb} by {report['by']}: key version {report['to_version']} is current (was "
          f"{report['from_version']}); {len(report['resealed'])} profile(s) resealed at rest")
    for p in report["pending"]:
        who = f"is leased by run {p['leased_by']}" if p["leased_by"] else "is wanted by a waiting run"
        print(f"  waiting: {p['scope']}/{p['profile']} {who}: resealed when that run ends")
    for p in report["failed"]:
        print(f"  not resealed: {p['scope']}/{p['profile']}: {p['error']}")
    print("rotation finished" if report["finished"] else
          "rotation under way: `sfguard keys status` shows what it waits for")
    return 0


def cmd_retire(args) -> int:
    from sfguard.supervisor.profiles.rotation import KeysBusy, KeyStateError, retire
    try:
        version = int(args.version)
    except ValueError:
        raise CliError(f"VERSION: a key version number, not {args.version[:20]!r}", 2) from None
    _home, stores = _stores(args, read_only=False)
    try:
        result = retire(stores, version)
    except KeyStateError as exc:
        raise CliError(str(exc), 2) from None
    except KeysBusy as exc:
        raise CliError(str(exc), 1) from None
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0 if result["retired"] else 1
    if result["retired"]:
        print(f"key version {version} retired: its keys are deleted (a copy of a profile sealed "
              "under it opens nowhere now, unless a backup of those keys survives)")
        return 0
    users = result["users"]
    lines = "\n".join(f"  {u['scope']}/{u['profile']}" + (f" (leased by run {u['leased_by']}: "
                                                           "resealed when it ends)" if u["leased_by"] else
                                                           " (at rest: `sfguard keys rotate` reseals it)")
                      for u in users)
    raise CliError(f"key version {version} is still used by {len(users)} profile(s):\n{lines}", 1)
