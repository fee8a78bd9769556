"""The guard-side login check against a real anchor (Chromium + agent-browser) and the fixture
login site: logged out -> False with the login URL; after a login -> True; the check's own tab
is always closed; selectors, unreachable pages and ambiguous patterns give clear answers."""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from sfguard.fixtures.login_server import start_login_server
from sfguard.supervisor.browsers import agent_browser as ab
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.browsers.host import AnchorSpec, LocalBrowserHost
from sfguard.supervisor.browsers.login import LoginCheckError, check_login
from sfguard.supervisor.gate.cdp_gate import CdpGate
from sfguard.supervisor.models import LoginCheck
from sfguard.supervisor.procs import scan_orphans, terminate_recorded
from tests.conftest import free_port

pytestmark = pytest.mark.browser


@pytest.fixture
async def site():
    runner, url = await start_login_server()
    yield url
    await runner.cleanup()


@pytest.fixture
async def anchor():
    ab_tool, br = tools.find_agent_browser(), tools.find_browser()
    if not (ab_tool.found and br.found):
        pytest.fail("agent-browser or Chromium missing: run ./dev setup")
    root = Path(tempfile.mkdtemp(prefix="sflc-", dir="/tmp"))   # short: unix socket limit
    host = LocalBrowserHost(ab_tool.path)
    spec = AnchorSpec(session=f"lc{uuid.uuid4().hex[:8]}", socket_dir=root / "s",
                      config_path=root / "cfg.json", browser_path=br.path,
                      profile_dir=root / "profile", allow_direct=True, proxy_url=None)
    a = await host.launch_anchor(spec)
    a.binary = ab_tool.path
    gate = CdpGate()
    await gate.start()
    # the anchor is driven like a stage drives it: agent-browser through the gate
    a.gate = gate
    a.env = ab.stage_env(session=f"lcs{uuid.uuid4().hex[:8]}", socket_dir=root / "s",
                         config_path=ab.write_pinned_config(root / "cfg.json"),
                         cdp_url=gate.add_stage("st", a.pipe))
    try:
        yield a
    finally:
        await host.close_stage_session(a.env)
        await gate.stop()
        await host.close_anchor(a)
        leftovers = scan_orphans([root])
        if leftovers:
            terminate_recorded(leftovers, 5)
        shutil.rmtree(root, ignore_errors=True)
        assert not leftovers, f"processes left behind: {leftovers}"


async def page_targets(pipe) -> list[dict]:
    infos = (await pipe.call("Target.getTargets"))["targetInfos"]
    return [t for t in infos if t["type"] == "page"]


async def login_with_agent_browser(anchor, site: str) -> None:
    env, binary = anchor.env, anchor.binary
    await ab.run_ok(env, "open", site + "/login", binary=binary)
    await ab.run_ok(env, "fill", "input[name=user]", "operator", binary=binary)
    await ab.run_ok(env, "fill", "input[name=password]", "correct-horse", binary=binary)
    await ab.run_ok(env, "click", "button[type=submit]", binary=binary)
    for _ in range(100):
        if (await ab.run_ok(env, "get", "url", binary=binary)).strip().endswith("/account"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the fixture login did not reach /account")


def account_check(site: str, **kw) -> LoginCheck:
    return LoginCheck(url=f"{site}/account", logged_in=f"{site}/account",
                      logged_out=[f"{site}/login*"], **kw)


async def test_logged_out_then_logged_in_and_the_check_tab_is_closed(anchor, site):
    before = await page_targets(anchor.pipe)

    out = await check_login(anchor.pipe, account_check(site))
    assert out.to_json() == {"logged_in": False, "url": f"{site}/login?next=…"}   # values hidden
    after = await page_targets(anchor.pipe)
    assert sorted(t["targetId"] for t in after) == sorted(t["targetId"] for t in before)

    await login_with_agent_browser(anchor, site)
    ok = await check_login(anchor.pipe, account_check(site))
    assert ok.to_json() == {"logged_in": True, "url": f"{site}/account"}

    # The selector must be found too; a missing one turns the answer into "logged out".
    assert (await check_login(anchor.pipe, account_check(site, selector="#signed-in"))).logged_in is True
    missing = await check_login(anchor.pipe, account_check(site, selector="#no-such-thing"))
    assert missing.logged_in is False and missing.url == f"{site}/account"
    # A selector with quotes is passed as data, not code.
    quoted = await check_login(anchor.pipe, account_check(site, selector='h1[id="signed-in"]'))
    assert quoted.logged_in is True
    # Only the anchor's own tab(s) remain; none of the check tabs is left.
    final = await page_targets(anchor.pipe)
    stage_tabs = anchor.gate.stage_targets("st")
    assert stage_tabs   # the stage session's tabs (agent-browser's own and its pinned one)
    assert {t["targetId"] for t in final} == {b["targetId"] for b in before} | stage_tabs
    # agent-browser's own session still works on its tab.
    assert (await ab.run_ok(anchor.env, "get", "url", binary=anchor.binary)).strip() == f"{site}/account"


async def test_ambiguous_invalid_and_unreachable_checks_fail_clearly(anchor, site):
    before = await page_targets(anchor.pipe)
    neither = LoginCheck(url=f"{site}/", logged_in=f"{site}/account", logged_out=[f"{site}/login*"])
    with pytest.raises(LoginCheckError, match="matches neither"):
        await check_login(anchor.pipe, neither)

    bad_selector = account_check(site, selector="h1[")
    with pytest.raises(LoginCheckError, match="not a valid CSS selector"):
        await check_login(anchor.pipe, bad_selector)

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LoginCheckError, match="could not be opened: net::ERR_CONNECTION_REFUSED"):
        await check_login(anchor.pipe, account_check(dead), timeout=20)
    assert len(await page_targets(anchor.pipe)) == len(before)
