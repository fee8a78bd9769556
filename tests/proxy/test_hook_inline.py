"""Hooks run at once (proxy_addons/dispatch.py, `run_inline`) behave as mitmproxy's own
`handle_lifecycle` in a task: every handler in chain order, errors logged and the next handler
run, `AddonHalt` ending the hook, `update` after a flow hook, and a handler that must wait
finished later, with the handlers after it, before the layer goes on. The last test checks
the waiting case through the real guard: a plain request whose hook waits is answered only
once it finished."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from mitmproxy import exceptions, options
from mitmproxy.http import Response
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook
from mitmproxy.test import tflow

from sfguard.proxy_addons import dispatch

from .conftest import TOKEN_A, basic, in_process_guard


class Sync:
    def __init__(self, name: str, seen: list[str], fail: BaseException | None = None) -> None:
        self.name, self.seen, self.fail = name, seen, fail

    def requestheaders(self, flow) -> None:
        self.seen.append(self.name)
        if self.fail is not None:
            raise self.fail

    def update(self, flows) -> None:
        self.seen.append(f"update:{self.name}")


class Waits:
    """An async handler: runs up to its first wait at once, the rest after `go` is set."""

    name = "waits"

    def __init__(self, seen: list[str], go: asyncio.Event) -> None:
        self.seen, self.go = seen, go

    async def requestheaders(self, flow) -> None:
        self.seen.append("waits:before")
        await self.go.wait()
        self.seen.append("waits:after")


class NoWait:
    name = "nowait"

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    async def requestheaders(self, flow) -> None:
        self.seen.append("nowait")


async def manager(*addons) -> dispatch.CachedAddonManager:
    from mitmproxy.master import Master  # after the guard's set-up (_lean_import), as server.py
    master = Master(options.Options(), event_loop=asyncio.get_running_loop())
    dispatch.install(master)
    master.addons.add(*addons)
    assert isinstance(master.addons, dispatch.CachedAddonManager)
    return master.addons


async def test_handlers_that_do_not_wait_all_run_at_once_in_chain_order():
    seen: list[str] = []
    addons = await manager(Sync("a", seen), NoWait(seen), Sync("b", seen))
    assert addons.run_inline(HttpRequestHeadersHook(tflow.tflow())) is None
    assert seen == ["a", "nowait", "b", "update:a", "update:b"]


async def test_a_waiting_handler_and_those_after_it_finish_in_the_rest():
    seen: list[str] = []
    go = asyncio.Event()
    addons = await manager(Sync("a", seen), Waits(seen, go), Sync("b", seen))
    rest = addons.run_inline(HttpRequestHeadersHook(tflow.tflow()))
    assert rest is not None
    assert seen == ["a", "waits:before"]
    task = asyncio.create_task(addons.handle_lifecycle(dispatch.SfguardRestHook(rest)))
    await asyncio.sleep(0.05)
    assert seen == ["a", "waits:before"] and not task.done()
    go.set()
    await asyncio.wait_for(task, 5)
    assert seen == ["a", "waits:before", "waits:after", "b", "update:a", "update:b"]


async def test_an_error_is_logged_and_the_next_handler_runs(caplog):
    seen: list[str] = []
    addons = await manager(Sync("a", seen, fail=ValueError("boom")), Sync("b", seen))
    with caplog.at_level(logging.ERROR):
        assert addons.run_inline(HttpRequestHeadersHook(tflow.tflow())) is None
    assert seen == ["a", "b", "update:a", "update:b"]
    assert "boom" in caplog.text


async def test_addon_halt_ends_the_hook_but_not_update():
    seen: list[str] = []
    addons = await manager(Sync("a", seen, fail=exceptions.AddonHalt()), Sync("b", seen))
    assert addons.run_inline(HttpRequestHeadersHook(tflow.tflow())) is None
    assert seen == ["a", "update:a", "update:b"]


async def test_an_intercepted_flow_is_waited_for():
    class Intercept:
        def requestheaders(self, flow) -> None:
            flow.intercept()

    f = tflow.tflow()
    addons = await manager(Intercept())
    rest = addons.run_inline(HttpRequestHeadersHook(f))
    assert rest is not None
    task = asyncio.create_task(addons.handle_lifecycle(dispatch.SfguardRestHook(rest)))
    await asyncio.sleep(0.05)
    assert not task.done()
    f.resume()
    await asyncio.wait_for(task, 5)


async def test_a_cancelled_rest_cancels_the_waiting_handler():
    seen: list[str] = []
    go = asyncio.Event()
    addons = await manager(Waits(seen, go))
    rest = addons.run_inline(HttpRequestHeadersHook(tflow.tflow()))
    assert rest is not None
    task = asyncio.create_task(addons.handle_lifecycle(dispatch.SfguardRestHook(rest)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["waits:before"]


@contextlib.asynccontextmanager
async def guard_with(tmp_path, site, addon):
    """(proxy port, site port): an in-process guard that lets client `a` reach site-a.test
    (the loopback `site` handler), with `addon` added after the guard's own addons."""
    async with in_process_guard(tmp_path, site, addon=addon) as g:
        yield g.port, g.up


@pytest.mark.parametrize("answer", [None, 403])
async def test_through_the_guard_a_plain_request_waits_for_a_waiting_hook(tmp_path, answer):
    """An addon after the guard's own waits 0.2 s in `requestheaders`, then (403) answers
    the request itself. The client gets that answer and the site nothing, or (None) the
    site's answer after the wait."""
    received: list[bytes] = []

    async def site(reader, writer):
        received.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    class SlowJudge:
        async def requestheaders(self, flow) -> None:
            await asyncio.sleep(0.2)
            if answer is not None:
                flow.response = Response.make(answer, b"judged late", {"Connection": "close"})

    async with guard_with(tmp_path, site, SlowJudge()) as (port, up):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET http://site-a.test:{up}/x HTTP/1.1\r\nHost: site-a.test:{up}\r\n"
                     f"Proxy-Authorization: {basic('a', TOKEN_A)}\r\n\r\n".encode())
        start = asyncio.get_running_loop().time()
        got = await asyncio.wait_for(reader.read(), 5)
        waited = asyncio.get_running_loop().time() - start
        writer.close()
    assert waited >= 0.15  # the judge slept 0.2 s before the layer went on
    if answer is None:
        assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"ok") and len(received) == 1
    else:
        assert got.startswith(b"HTTP/1.1 403") and got.endswith(b"judged late") and received == []


@pytest.mark.parametrize("answer", [None, 403])
async def test_through_the_guard_a_connect_waits_for_a_waiting_hook(tmp_path, answer):
    """The same for a CONNECT: an addon's `http_connect` waits 0.2 s, then (403) refuses the
    tunnel. The client gets the refusal and the site no connection, or (None) a working
    tunnel after the wait."""
    connections: list[int] = []

    async def echo(reader, writer):
        connections.append(1)
        writer.write(await reader.read(100))
        await writer.drain()
        writer.close()

    class SlowJudge:
        async def http_connect(self, flow) -> None:
            await asyncio.sleep(0.2)
            if answer is not None:
                flow.response = Response.make(answer, b"judged late")

    async with guard_with(tmp_path, echo, SlowJudge()) as (port, up):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"CONNECT site-a.test:{up} HTTP/1.1\r\nHost: site-a.test:{up}\r\n"
                     f"Proxy-Authorization: {basic('a', TOKEN_A)}\r\n\r\n".encode())
        start = asyncio.get_running_loop().time()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        waited = asyncio.get_running_loop().time() - start
        if answer is None:
            writer.write(b"ping")
            echoed = await asyncio.wait_for(reader.readexactly(4), 5)
        writer.close()
    assert waited >= 0.15  # the judge slept 0.2 s before the layer went on
    if answer is None:
        assert head.startswith(b"HTTP/1.1 200") and echoed == b"ping" and connections == [1]
    else:
        assert head.startswith(b"HTTP/1.1 403") and connections == []
