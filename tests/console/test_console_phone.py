"""The console's sign-in pages and every page on a phone-sized screen (issue 46): a real
Chromium at 390x844 with a mobile viewport, against a real `sfguard start` with the fake browser.
Each page fits: the layout stays 390 px wide and nothing is wider. Screenshots go to
.ci-artifacts/console/ (git-ignored). The approvals page with a held write, and its buttons, is
checked in test_approvals_page.py (it needs a real guarded browser to hold one)."""
from __future__ import annotations

import asyncio

import pytest

from sfguard.supervisor.console.viewer import Viewer
from tests.console.conftest import ARTIFACTS, PHONE, assert_fits_a_phone, link, phone_fit

pytestmark = pytest.mark.browser


def test_sign_in_and_approvals_pages_fit_a_phone(fake_guard):
    d = fake_guard()
    spent = link(d)

    async def person() -> dict[str, dict]:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        seen: dict[str, dict] = {}
        async with Viewer(width=PHONE[0], height=PHONE[1], mobile=True) as v:
            pages = [
                ("not-signed-in", d.console + "/approvals", "Not signed in"),
                ("signed-in", spent, None),                        # moves on to the overview
                ("link-not-valid", spent, "Link not valid"),       # the same link again
                ("approvals", d.console + "/approvals", "No write is waiting"),
                *((page, f"{d.console}/{page}", heading) for page, heading in (
                    ("decisions", "Decisions"), ("profiles", "Profiles"), ("audit", "Audit"))),
            ]
            for name, url, words in pages:
                await v.goto(url)
                if words is None:
                    await v.wait_for("location.pathname === '/'", 20, "the overview after sign-in")
                else:
                    await v.wait_for(f"document.body.innerText.includes({words!r})", 20, words)
                seen[name] = await phone_fit(v)
                await v.screenshot(ARTIFACTS / f"phone-{name}.png")
        return seen

    seen = asyncio.run(person())
    assert list(seen) == ["not-signed-in", "signed-in", "link-not-valid", "approvals", "decisions",
                          "profiles", "audit"]
    for name, fit in seen.items():
        try:
            assert_fits_a_phone(fit)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
