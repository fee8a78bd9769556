"""A real web application's own login through the guard (issue 33, section 3): Django's admin
site over HTTPS (hypercorn, an authority given with --ca-file), with its CSRF-protected login
form, a Secure; SameSite=None session cookie, `next=` redirects and server-side logout. Real
`sfguard start`, Chromium and agent-browser; the site is on loopback as admin.test."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

from sfguard.supervisor.browsers import trust
from tests.conftest import free_port
from tests.tls_site import issue, make_ca

from .test_ca_file import start_guard
from .test_real_browser import as_stage

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(trust.certutil() is None, reason="certutil comes with ./dev setup (libnss3-tools)")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PASSWORD = "correct-horse-" + secrets.token_hex(4)


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
                "from django.contrib.auth.models import User\n"
                f"User.objects.create_superuser('operator', 'op@admin.test', {PASSWORD!r})")
    ca = make_ca("sfguard django authority")
    cert, key = issue(ca, "admin.test", tmp)
    site = subprocess.Popen([sys.executable, "-m", "hypercorn", "--certfile", str(cert), "--keyfile", str(key),
                             "--bind", f"127.0.0.1:{port}", "tests.django_site.asgi:application"],
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
        yield d, f"https://admin.test:{port}", env
    finally:
        d.finish()
        site.terminate()
        site.wait(10)


def logged_in(d, run: str, origin: str) -> bool:
    check = {"url": f"{origin}/admin/", "logged_in": f"{origin}/admin/", "logged_out": [f"{origin}/admin/login/*"]}
    status, body = d.call("POST", f"/v1/runs/{run}/login-check", {"profile": "django", "login_check": check})
    assert status == 200, body
    return body["logged_in"]


def stage(d, run: str, sid: str) -> dict:
    status, answer = d.call("POST", f"/v1/runs/{run}/stages",
                            {"stage_id": sid, "attempt": 1,
                             "browser": {"profile": "django", "headed": False, "allow_domains": ["admin.test"]}})
    assert status == 200, answer
    return answer["env"]


def test_login_check_reuse_across_runs_and_logout(admin_site):
    d, origin, env = admin_site
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    s = stage(d, "r1", "login")
    assert logged_in(d, "r1", origin) is False
    assert as_stage(s, "open", f"{origin}/admin/login/?next=/admin/").returncode == 0
    assert as_stage(s, "fill", "#id_username", "operator").returncode == 0
    assert as_stage(s, "fill", "#id_password", PASSWORD).returncode == 0
    assert as_stage(s, "click", "input[type=submit]").returncode == 0     # a CSRF-protected POST
    as_stage(s, "wait", "1000")
    assert as_stage(s, "get", "url").stdout.strip() == f"{origin}/admin/"
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
