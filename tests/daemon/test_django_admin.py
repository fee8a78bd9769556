"""A real web application's own login through the guard (issue 33, section 3): Django's admin
site over HTTPS (hypercorn, an authority given with --ca-file), with its CSRF-protected login
form, a Secure; SameSite=None session cookie, `next=` redirects and server-side logout. Real
`sfguard start`, Chromium and agent-browser; the site is on loopback as admin.test. One site and
one guard for the module; each test uses a profile of its own.

- a stage signs in with the real form; the login check, reuse across runs, logout detected;
- a person signs in through the console's live view (profile login by live view);
- the write-gate table on a real CSRF-protected POST: deleting an object in the admin with the
  stage's `browser.writes` at `deny`, `gate` (denied, then approved) and `allow`."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sfguard.supervisor.browsers import trust
from sfguard.supervisor.console.viewer import Viewer
from tests.conftest import free_port
from tests.live_person import press_done, sign_in_by_sight, wait_address
from tests.tls_site import issue, make_ca

from .conftest import Daemon
from .test_ca_file import start_guard
from .test_real_browser import as_stage

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(trust.certutil() is None, reason="certutil comes with ./dev setup (libnss3-tools)")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PASSWORD = "correct-horse-" + secrets.token_hex(4)
GROUPS = ("deny-me", "gate-me", "allow-me")
#: the admin's buttons (its stylesheet's --button-bg); its header band has the same colour
BUTTON_RGB = (0x41, 0x76, 0x90)


@dataclass
class Admin:
    d: Daemon
    origin: str
    env: dict
    db: Path            # the site's SQLite database (read here, never written)
    access_log: Path    # every request that reached the site: "[time] [pid] [INFO] METHOD /path STATUS"


def django(env: dict, code: str) -> str:
    """Run `code` in the test site's Django (settings from `env`); its stdout."""
    r = subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + code], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def admin_site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("django")
    port = free_port()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.django_site.settings", "PYTHONPATH": ROOT,
           "SFGUARD_DJANGO_SECRET": secrets.token_hex(32), "SFGUARD_DJANGO_DB": str(tmp / "db.sqlite3"),
           "SFGUARD_DJANGO_PORT": str(port)}
    django(env, "from django.core.management import call_command; call_command('migrate', verbosity=0)\n"
                "from django.contrib.auth.models import Group, User\n"
                f"User.objects.create_superuser('operator', 'op@admin.test', {PASSWORD!r})\n"
                f"for name in {GROUPS!r}: Group.objects.create(name=name)")
    ca = make_ca("sfguard django authority")
    cert, key = issue(ca, "admin.test", tmp)
    access_log = tmp / "access.log"
    site = subprocess.Popen([sys.executable, "-m", "hypercorn", "--certfile", str(cert), "--keyfile", str(key),
                             "--bind", f"127.0.0.1:{port}", "--access-logfile", str(access_log),
                             "--access-logformat", "%(m)s %(U)s %(s)s", "tests.django_site.asgi:application"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    d = start_guard(tmp, "home", "--ca-file", str(ca.write(tmp / "ca.pem")), "--resolve", "admin.test=127.0.0.1",
                    ports=(port,))
    try:
        yield Admin(d, f"https://admin.test:{port}", env, tmp / "db.sqlite3", access_log)
    finally:
        d.finish()
        site.terminate()
        site.wait(10)


def login_check(origin: str) -> dict:
    return {"url": f"{origin}/admin/", "logged_in": f"{origin}/admin/", "logged_out": [f"{origin}/admin/login/*"]}


def logged_in(d, run: str, origin: str, profile: str = "django") -> bool:
    status, body = d.call("POST", f"/v1/runs/{run}/login-check",
                          {"profile": profile, "login_check": login_check(origin)})
    assert status == 200, body
    return body["logged_in"]


def stage(d, run: str, sid: str, profile: str = "django", **browser) -> dict:
    status, answer = d.call("POST", f"/v1/runs/{run}/stages",
                            {"stage_id": sid, "attempt": 1,
                             "browser": {"profile": profile, "headed": False, "allow_domains": ["admin.test"],
                                         **browser}})
    assert status == 200, answer
    return answer


def sign_in_as_stage(s: dict, origin: str) -> None:
    """A stage fills and sends Django's real login form (a CSRF-protected POST)."""
    assert as_stage(s, "open", f"{origin}/admin/login/?next=/admin/").returncode == 0
    assert as_stage(s, "fill", "#id_username", "operator").returncode == 0
    assert as_stage(s, "fill", "#id_password", PASSWORD).returncode == 0
    assert as_stage(s, "click", "input[type=submit]").returncode == 0
    as_stage(s, "wait", "1000")
    assert as_stage(s, "get", "url").stdout.strip() == f"{origin}/admin/"


def query(db: Path, sql: str, *args) -> list[tuple]:
    """Read the site's database (read-only), as its owner would look."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as c:
        return c.execute(sql, args).fetchall()


def test_login_check_reuse_across_runs_and_logout(admin_site):
    d, origin, env = admin_site.d, admin_site.origin, admin_site.env
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    s = stage(d, "r1", "login")["env"]
    assert logged_in(d, "r1", origin) is False
    sign_in_as_stage(s, origin)
    assert "Site administration" in as_stage(s, "get", "title").stdout
    assert logged_in(d, "r1", origin) is True
    assert d.call("POST", "/v1/runs/r1/stages/login/end", {"outcome": "succeeded"})[0] == 200
    assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
    # the next run: the sealed profile comes back logged in
    assert d.call("POST", "/v1/runs", {"run_id": "r2"})[0] == 201
    stage(d, "r2", "work")
    assert logged_in(d, "r2", origin) is True
    # the site ends every session on its side: the check sees it
    django(env, "from django.contrib.sessions.models import Session; Session.objects.all().delete()")
    assert logged_in(d, "r2", origin) is False
    assert d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})[0] == 200
    # the password never reached the guard's logs
    assert PASSWORD not in d.log.read_text(errors="replace")


def test_profile_login_by_live_view(admin_site):
    """The check says logged out; the runner opens a handoff; a person in a browser of their
    own signs in through the console's live-view page with forwarded clicks and keys only and
    presses Done; the guard's own check says logged in, and the next run still is."""
    a = admin_site
    d, origin = a.d, a.origin
    assert d.call("POST", "/v1/runs", {"run_id": "lv1"})[0] == 201
    stage(d, "lv1", "login", profile="django-lv", login_check=login_check(origin))
    assert logged_in(d, "lv1", origin, "django-lv") is False
    last_login = query(a.db, "SELECT last_login FROM auth_user WHERE username = 'operator'")
    status, handoff = d.call("POST", "/v1/runs/lv1/handoff", {
        "profile": "django-lv", "site": "admin.test", "reason": "sign in to the admin",
        "url": f"{origin}/admin/", "kind": "auto", "stage_id": "login"})
    assert status == 200 and handoff["kind"] == "live_view", handoff
    assert d.call("GET", "/v1/runs/lv1/handoff")[1]["state"] == "open"

    async def person() -> dict:
        async with Viewer() as v:
            await v.open_live_view(handoff["url"])
            login_page = await wait_address(v, f"{origin}/admin/login/")     # the site's next= redirect
            await sign_in_by_sight(v, "operator", PASSWORD, BUTTON_RGB)
            back = await wait_address(v, f"{origin}/admin/", other_than=login_page)
            return {"back": back, "result": await press_done(v)}

    out = asyncio.run(person())
    assert out["back"] == f"{origin}/admin/", out
    assert "The guard's login check says: logged in" in out["result"], out
    status, st = d.call("GET", "/v1/runs/lv1/handoff?wait=5")
    assert status == 200 and st["state"] == "done" and st["logged_in"] is True, st
    # the site itself signed the user in (its form, its CSRF check, its session)
    assert query(a.db, "SELECT last_login FROM auth_user WHERE username = 'operator'") != last_login
    assert d.call("POST", "/v1/runs/lv1/stages/login/end", {"outcome": "succeeded"})[0] == 200
    assert d.call("POST", "/v1/runs/lv1/end", {"outcome": "succeeded"})[0] == 200
    # the next run: unsealed, still logged in
    assert d.call("POST", "/v1/runs", {"run_id": "lv2"})[0] == 201
    stage(d, "lv2", "work", profile="django-lv")
    assert logged_in(d, "lv2", origin, "django-lv") is True
    assert d.call("POST", "/v1/runs/lv2/end", {"outcome": "succeeded"})[0] == 200
    token = handoff["url"].split("t=")[1]
    logs = d.log.read_text(errors="replace") + (d.home / "logs" / "decisions.log").read_text()
    assert PASSWORD not in logs and token not in logs


# -- the write-gate table on Django's admin ----------------------------------------------------

def group_id(a: Admin, name: str) -> int | None:
    rows = query(a.db, "SELECT id FROM auth_group WHERE name = ?", name)
    return rows[0][0] if rows else None


def deletes_received(a: Admin, gid: int) -> int:
    """The delete confirmations (POSTs) that reached the site for group `gid`."""
    path = f"/admin/auth/group/{gid}/delete/"
    return sum(1 for line in a.access_log.read_text().splitlines() if line.split()[-3:-1] == ["POST", path])


def deletions_logged(a: Admin, gid: int) -> int:
    """The deletions Django's admin itself recorded (its LogEntry, action DELETION) for `gid`."""
    return query(a.db, "SELECT count(*) FROM django_admin_log WHERE action_flag = 3 AND object_id = ?",
                 str(gid))[0][0]


def confirm_delete(s: dict, a: Admin, gid: int) -> None:
    """The stage opens the admin's delete page of group `gid` and confirms (its form's POST,
    with the CSRF token)."""
    assert as_stage(s, "open", f"{a.origin}/admin/auth/group/{gid}/delete/").returncode == 0
    assert "Are you sure you want to delete" in as_stage(s, "get", "text", "body").stdout
    as_stage(s, "click", "input[type=submit]", timeout=60)


def pending(d, bound: float = 20) -> list[dict]:
    status, body = d.call("GET", f"/v1/approvals?state=pending&wait={int(bound)}")
    assert status == 200, status
    return body["approvals"]


def until(predicate, bound: float = 20) -> bool:
    deadline = time.monotonic() + bound
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.2)
    return predicate()


def test_write_gate_table_on_the_admins_delete(admin_site):
    a = admin_site
    d = a.d
    ids = {name: group_id(a, name) for name in GROUPS}
    assert None not in ids.values(), ids
    assert d.call("POST", "/v1/runs", {"run_id": "wg"})[0] == 201
    # a stage signs in (its login form is a write too: allowed by default)
    sign_in_as_stage(stage(d, "wg", "login", profile="django-w")["env"], a.origin)
    assert d.call("POST", "/v1/runs/wg/stages/login/end", {"outcome": "succeeded"})[0] == 200

    def mode_stage(mode: str) -> dict:
        answer = stage(d, "wg", mode, profile="django-w", writes=mode)
        assert answer["writes"] == {"admin.test": mode}, answer["writes"]
        return answer["env"]

    # deny: refused at once, the page is told, the site never sees the POST
    gid = ids["deny-me"]
    s = mode_stage("deny")
    confirm_delete(s, a, gid)
    assert until(lambda: "refused" in as_stage(s, "get", "text", "body").stdout, 10)
    time.sleep(1.0)
    assert deletes_received(a, gid) == 0 and group_id(a, "deny-me") == gid and pending(d, 1) == []
    assert d.call("POST", "/v1/runs/wg/stages/deny/end", {"outcome": "succeeded"})[0] == 200

    # gate: held; nothing reaches the site; a denial leaves the object; an approval deletes it once
    gid = ids["gate-me"]
    s = mode_stage("gate")
    confirm_delete(s, a, gid)
    held = pending(d)
    assert [(x["method"], x["host"], x["path"], x["stage_id"]) for x in held] == [
        ("POST", "admin.test", f"/admin/auth/group/{gid}/delete/", "gate")]
    time.sleep(1.0)
    assert deletes_received(a, gid) == 0
    assert d.call("POST", f"/v1/approvals/{held[0]['id']}", {"decision": "deny"})[0] == 200
    assert until(lambda: "refused" in as_stage(s, "get", "text", "body").stdout, 10)
    time.sleep(1.0)
    assert deletes_received(a, gid) == 0 and group_id(a, "gate-me") == gid
    confirm_delete(s, a, gid)
    again = pending(d)
    assert [x["path"] for x in again] == [f"/admin/auth/group/{gid}/delete/"] and again[0]["id"] != held[0]["id"]
    assert deletes_received(a, gid) == 0
    status, decided = d.call("POST", f"/v1/approvals/{again[0]['id']}", {"decision": "approve"})
    assert status == 200 and decided["state"] == "approved", status
    assert until(lambda: group_id(a, "gate-me") is None)
    time.sleep(1.0)
    assert deletes_received(a, gid) == 1 and deletions_logged(a, gid) == 1       # exactly once
    assert d.call("POST", f"/v1/approvals/{again[0]['id']}", {"decision": "approve"})[0] == 409
    assert d.call("POST", "/v1/runs/wg/stages/gate/end", {"outcome": "succeeded"})[0] == 200

    # allow: the delete goes through at once
    gid = ids["allow-me"]
    s = mode_stage("allow")
    confirm_delete(s, a, gid)
    assert until(lambda: group_id(a, "allow-me") is None)
    # the site's access log line is written after its answer: wait for it, then count exactly
    until(lambda: deletes_received(a, gid) >= 1, 10)
    time.sleep(1.0)
    assert deletes_received(a, gid) == 1 and deletions_logged(a, gid) == 1 and pending(d, 1) == []
    assert d.call("POST", "/v1/runs/wg/end", {"outcome": "succeeded"})[0] == 200
    # the untouched group is still there; the decision log has each mode's verdict
    assert group_id(a, "deny-me") == ids["deny-me"]
    lines = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    verdicts = {(x["client"], x["decision"]) for x in lines
                if x.get("run") == "wg" and str(x.get("decision", "")).startswith("write_")}
    # (the allow stage's delete is not paused at all: once the deny and gate stages ended, no
    # stage of the browser guards admin.test, so the write gate no longer intercepts it)
    assert {("writes:deny", "write_refused"), ("writes:gate", "write_held"), ("writes:gate", "write_denied"),
            ("writes:gate", "write_approved")} <= verdicts, verdicts
