"""Single sign-on across two origins through the guard (issue 33, section 2): a real OpenID
Connect provider (npm oidc-provider) on idp.test and an app on app.test that signs in through
it, both over HTTPS from an authority given with --ca-file. Real `sfguard start`, Chromium and
agent-browser. The login stage allows both origins; the work stage allows only the app, and
when the app sends it back to the provider the guard refuses that, and the login check says
logged out (no hang, no reach to the provider)."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from sfguard.supervisor.browsers import trust
from tests.daemon.test_ca_file import start_guard
from tests.daemon.test_real_browser import as_stage
from tests.sso.sites import SsoSites
from tests.tls_site import make_ca

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(trust.certutil() is None or shutil.which("node") is None,
                                 reason="certutil and node come with ./dev setup")]


@pytest.fixture
def sso(tmp_path):
    ca = make_ca("sfguard sso authority")
    sites = SsoSites(ca, tmp_path)
    d = start_guard(tmp_path, "home", "--ca-file", str(ca.write(tmp_path / "ca.pem")),
                    "--resolve", "app.test=127.0.0.1", "--resolve", "idp.test=127.0.0.1",
                    ports=(sites.app.port, sites.idp_port))
    try:
        yield d, sites
    finally:
        d.finish()
        sites.close()


def stage(d, run: str, sid: str, allow: list[str]) -> dict:
    status, answer = d.call("POST", f"/v1/runs/{run}/stages",
                            {"stage_id": sid, "attempt": 1,
                             "browser": {"profile": "sso", "headed": False, "allow_domains": allow}})
    assert status == 200, answer
    return answer["env"]


def check(d, run: str, sites: SsoSites) -> dict:
    app, idp = sites.app.origin, sites.idp_origin
    body = {"profile": "sso", "login_check": {"url": f"{app}/account", "logged_in": f"{app}/account",
                                              "logged_out": [f"{app}/login*", f"{idp}/*"]}}
    status, answer = d.call("POST", f"/v1/runs/{run}/login-check", body)
    assert status == 200, answer
    return answer


def test_sign_in_through_the_provider_reuse_and_a_stage_that_may_not_reach_it(sso):
    d, sites = sso
    app = sites.app.origin
    assert d.call("POST", "/v1/runs", {"run_id": "r1"})[0] == 201
    s = stage(d, "r1", "login", ["app.test", "idp.test"])
    assert check(d, "r1", sites)["logged_in"] is False
    # the app sends the browser to the provider; its own login and consent pages; back to the app
    assert as_stage(s, "open", f"{app}/login").returncode == 0
    assert as_stage(s, "get", "url").stdout.strip().startswith(f"{sites.idp_origin}/interaction/")
    assert as_stage(s, "fill", "input[name=login]", "operator").returncode == 0
    assert as_stage(s, "fill", "input[name=password]", "anything").returncode == 0
    assert as_stage(s, "click", "button[type=submit]").returncode == 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        url = as_stage(s, "get", "url").stdout.strip()
        if url == f"{app}/account":
            break
        if "/interaction/" in url and as_stage(s, "click", "button[type=submit]").returncode == 0:  # consent
            continue
        time.sleep(0.3)
    assert as_stage(s, "get", "text", "#who").stdout.strip() == "signed in as operator"
    assert check(d, "r1", sites)["logged_in"] is True
    assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
    # the next run: the login comes back from the sealed profile; its work stage allows the app only
    assert d.call("POST", "/v1/runs", {"run_id": "r2"})[0] == 201
    w = stage(d, "r2", "work", ["app.test"])
    assert check(d, "r2", sites)["logged_in"] is True
    assert as_stage(w, "open", f"{app}/account").returncode == 0
    assert as_stage(w, "get", "text", "#who").stdout.strip() == "signed in as operator"
    # the app's session ends: it sends the work stage to the provider, which the stage may not reach
    sites.app.sessions.clear()
    t0 = time.monotonic()
    answer = check(d, "r2", sites)
    assert answer["logged_in"] is False and time.monotonic() - t0 < 30, answer
    assert answer["url"].startswith(f"{sites.idp_origin}/auth?"), answer      # where the app sent it
    opened = as_stage(w, "open", f"{app}/account")
    assert opened.returncode != 0 and "ERR_TUNNEL_CONNECTION_FAILED" in opened.stderr + opened.stdout
    assert "signed in" not in as_stage(w, "get", "text", "body").stdout
    log = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    refused = [x for x in log if x.get("run") == "r2" and x.get("host") == "idp.test"]
    assert refused and all(x["decision"] == "deny" for x in refused), refused
    assert d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})[0] == 200
