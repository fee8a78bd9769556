"""Login check failures that need no browser."""
from __future__ import annotations

import pytest

from supervisor.login import LoginCheckError, check_login
from supervisor.models import LoginCheck
from tests.conftest import free_port


async def test_an_unreachable_cdp_address_is_an_error_without_the_address():
    port = free_port()
    url = f"ws://127.0.0.1:{port}/devtools/browser/secret-id"
    check = LoginCheck(url="http://127.0.0.1:1/account", logged_in="*/account", logged_out=["*/login*"])
    with pytest.raises(LoginCheckError) as exc:
        await check_login(url, check, timeout=4)
    assert str(port) not in str(exc.value) and "secret-id" not in str(exc.value)


async def test_an_invalid_pattern_fails_before_any_browser_work():
    # the model refuses such a pattern at the edge; check_login refuses it too when handed one
    check = LoginCheck.model_construct(url="http://127.0.0.1:1/account", logged_in="re:(", logged_out=[],
                                       selector=None)
    with pytest.raises(ValueError, match="re:\\("):
        await check_login("ws://127.0.0.1:1/devtools/browser/x", check, timeout=2)
