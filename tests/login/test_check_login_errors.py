"""Login check failures that need no browser."""
from __future__ import annotations

import asyncio
import os

import pytest

from sfguard.supervisor.browsers.login import LoginCheckError, check_login
from sfguard.supervisor.gate.cdp_pipe import CdpPipe
from sfguard.supervisor.models import LoginCheck


async def test_a_browser_whose_pipe_is_closed_is_a_clear_error():
    loop = asyncio.get_running_loop()
    r, w = os.pipe()            # what the "browser" writes
    r2, w2 = os.pipe()          # what the guard writes
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", 0))
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(w2, "wb", 0))
    pipe = CdpPipe(reader, transport)
    pipe._task = loop.create_task(pipe._read_loop())
    os.close(w)                                   # the "browser" end goes away: EOF
    await asyncio.wait_for(pipe.closed.wait(), 5)
    check = LoginCheck(url="http://127.0.0.1:1/account", logged_in="*/account", logged_out=["*/login*"])
    with pytest.raises(LoginCheckError, match="not running"):
        await check_login(pipe, check, timeout=4)
    await pipe.close()
    os.close(r2)


async def test_an_invalid_pattern_fails_before_any_browser_work():
    # the model refuses such a pattern at the edge; check_login refuses it too when handed one
    check = LoginCheck.model_construct(url="http://127.0.0.1:1/account", logged_in="re:(", logged_out=[],
                                       selector=None)
    with pytest.raises(ValueError, match="re:\\("):
        await check_login(None, check, timeout=2)
