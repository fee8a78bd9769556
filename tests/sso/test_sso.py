"""Single sign-on across two origins through the guard (issue 33, section 2): a real OpenID
Connect provider (npm oidc-provider) on idp.test and an app on app.test that signs in through
it, both over HTTPS from an authority given with --ca-file. Real `sfguard start`, Chromium and
agent-browser. The login stage allows both origins; the work stage allows only the app, and
when the app sends it back to the provider the guard refuses that, and the login check says
logged out (no hang, no reach to the provider)."""
from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time

import pytest

from sfguard.supervisor.browsers import trust
from sfguard.supervisor.console.viewer import Viewer
from tests.daemon.test_ca_file import start_guard
from tests.daemon.test_real_browser import as_stage
from tests.live_person import click_focused_button, press_done, sign_in_by_sight, wait_address
from tests.sso.sites import SsoSites
from tests.tls_site import make_ca

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(trust.certutil() is None or shutil.which("node") is None,
                                 reason="certutil and node come with ./dev setup")]

#: the provider's Sign-in and Continue buttons (oidc-provider's own pages)
IDP_BUTTON_RGB = (0x4D, 0x90, 0xFE)


@pytest.fixture(scope="module")
def sso(tmp_path_factory):
    """The provider, the app and a guard for the module (each test signs in with a profile of its
    own)."""
    tmp_path = tmp_path_factory.mktemp("sso")
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


def login_check(sites: SsoSites) -> dict:
    app, idp = sites.app.origin, sites.idp_origin
    return {"url": f"{app}/account", "logged_in": f"{app}/account", "logged_out": [f"{app}/login*", f"{idp}/*"]}


def stage(d, run: str, sid: str, allow: list[str], profile: str = "sso", **browser) -> dict:
    status, answer = d.call("POST", f"/v1/runs/{run}/stages",
                            {"stage_id": sid, "attempt": 1,
                             "browser": {"profile": profile, "headed": False, "allow_domains": allow, **browser}})
    assert status == 200, answer
    return answer["env"]


def check(d, run: str, sites: SsoSites, profile: str = "sso") -> dict:
    body = {"profile": profile, "login_check": login_check(sites)}
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
    # the login and consent pages share one address: the consent page is told by its heading
    # (clicking while the login page is still there would send the login twice)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        url = as_stage(s, "get", "url").stdout.strip()
        if url == f"{app}/account":
            break
        if "/interaction/" in url and as_stage(s, "get", "text", "h1").stdout.strip() == "Authorize":
            as_stage(s, "click", "button[type=submit]")
            continue
        time.sleep(0.3)
    assert url == f"{app}/account", url
    as_stage(s, "wait", "#who")            # the account page has loaded (bounded by agent-browser)
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
    assert "state=…" in answer["url"] and "code_challenge=…" in answer["url"], answer   # values hidden
    opened = as_stage(w, "open", f"{app}/account")
    assert opened.returncode != 0 and "ERR_TUNNEL_CONNECTION_FAILED" in opened.stderr + opened.stdout
    assert "signed in" not in as_stage(w, "get", "text", "body").stdout
    log = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    refused = [x for x in log if x.get("run") == "r2" and x.get("host") == "idp.test"]
    assert refused and all(x["decision"] == "deny" for x in refused), refused
    assert d.call("POST", "/v1/runs/r2/end", {"outcome": "succeeded"})[0] == 200


def test_profile_login_by_live_view_through_the_provider_and_its_consent_page(sso):
    """The login a person does: the check says logged out, the runner opens a handoff, a person
    in a browser of their own signs in through the console's live-view page (the provider's
    login page, then its consent page: two origins), presses Done; the guard's own check says
    logged in, and the next run, after seal and unseal, still is."""
    d, sites = sso
    app, idp = sites.app.origin, sites.idp_origin
    password = "idp-" + secrets.token_hex(6)
    assert d.call("POST", "/v1/runs", {"run_id": "lv1"})[0] == 201
    stage(d, "lv1", "login", ["app.test", "idp.test"], profile="sso-lv", login_check=login_check(sites))
    assert check(d, "lv1", sites, "sso-lv")["logged_in"] is False
    status, handoff = d.call("POST", "/v1/runs/lv1/handoff", {
        "profile": "sso-lv", "site": "app.test", "reason": "sign in through the provider",
        "url": f"{app}/login", "kind": "auto", "stage_id": "login"})
    assert status == 200 and handoff["kind"] == "live_view", handoff
    assert d.call("GET", "/v1/runs/lv1/handoff")[1]["state"] == "open"
    before = set(sites.app.sessions)

    async def person() -> dict:
        async with Viewer() as v:
            await v.open_live_view(handoff["url"])
            login_page = await wait_address(v, f"{idp}/interaction/")
            await sign_in_by_sight(v, "person", password, IDP_BUTTON_RGB)
            consent_page = await wait_address(v, f"{idp}/interaction/", other_than=login_page)
            await click_focused_button(v, IDP_BUTTON_RGB)
            back = await wait_address(v, f"{app}/account")
            return {"pages": [login_page, consent_page, back], "result": await press_done(v)}

    out = asyncio.run(person())
    assert "The guard's login check says: logged in" in out["result"], out
    status, st = d.call("GET", "/v1/runs/lv1/handoff?wait=5")
    assert status == 200 and st["state"] == "done" and st["logged_in"] is True, st
    # the app signed the person in through the provider (a code exchanged for this user)
    assert sorted(sites.app.sessions[s] for s in set(sites.app.sessions) - before) == ["person"]
    # the login tab went through both origins, each through the run's proxy
    log = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    hosts = {x["host"] for x in log if x.get("run") == "lv1" and x["decision"] == "allow"}
    assert {"app.test", "idp.test"} <= hosts, hosts
    assert d.call("POST", "/v1/runs/lv1/stages/login/end", {"outcome": "succeeded"})[0] == 200
    assert d.call("POST", "/v1/runs/lv1/end", {"outcome": "succeeded"})[0] == 200
    # the next run: the sealed profile comes back signed in; its work stage allows the app only
    assert d.call("POST", "/v1/runs", {"run_id": "lv2"})[0] == 201
    w = stage(d, "lv2", "work", ["app.test"], profile="sso-lv")
    assert check(d, "lv2", sites, "sso-lv")["logged_in"] is True
    assert as_stage(w, "open", f"{app}/account").returncode == 0
    assert as_stage(w, "get", "text", "#who").stdout.strip() == "signed in as person"
    assert d.call("POST", "/v1/runs/lv2/end", {"outcome": "succeeded"})[0] == 200
    # what the person typed and the link's token never reached the guard's logs
    token = handoff["url"].split("t=")[1]
    logs = d.log.read_text(errors="replace") + (d.home / "logs" / "decisions.log").read_text()
    assert password not in logs and token not in logs
