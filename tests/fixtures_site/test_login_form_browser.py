"""The fixture login form says how it was sent, in a real Chromium: a pointer on the Sign in
button is `click`, Enter in the password field is `keyboard` (the live-view tests rely on the
difference), and the button has the colour the scripted person looks for."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from sfguard.fixtures.login_server import SIGN_IN_RGB, start_login_server
from sfguard.supervisor.console import viewer
from sfguard.supervisor.console.viewer import Viewer

pytestmark = pytest.mark.browser


def test_the_scripted_person_looks_for_the_fixture_buttons_colour():
    assert viewer.SIGN_IN_RGB == SIGN_IN_RGB


@pytest.mark.parametrize("how,via", [("click", "click"), ("enter", "keyboard")])
def test_the_form_reports_a_click_or_the_keyboard(how, via):
    asyncio.run(_submit(how, via))


async def _submit(how: str, via: str) -> None:
    runner, url = await start_login_server()
    try:
        async with Viewer(width=1000, height=700) as v:
            await v.goto(f"{url}/login")
            await v.click_selector("input[name=user]")
            await v.type_text("operator")
            await v.click_selector("input[name=password]")
            await v.type_text("correct-horse")
            if how == "click":
                await v.click_selector("#sign-in")
            else:
                await v.key("Enter", 13)
            await v.wait_for("location.pathname === '/account'", 20, "the account page")
        submits = await asyncio.to_thread(_json, f"{url}/submits.json")
        assert submits == {"submits": [{"host": url.split("//")[1], "via": via, "ok": True}]}
    finally:
        await runner.cleanup()


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)
