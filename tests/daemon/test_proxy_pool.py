"""The run-proxy pool: the spare starts at a low CPU priority and gets the guard's back when a
run takes it; a run that finds the spare still starting waits for it instead of starting a
second proxy. Real proxy children, forked from the zygote as the guard does and started as
processes of their own (`python -m sfguard.supervisor.daemon.proxy_child`)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sfguard.supervisor.daemon.proxy_zygote import Zygote
from sfguard.supervisor.daemon.run_proxy import SPARE_PROXY_NICE, ProxyPool, RunProxy, can_renice

pytestmark = pytest.mark.asyncio


def thread_nice(pid: int) -> set[int]:
    """The niceness of every thread of `pid` (Linux keeps one per thread)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:
            continue   # the thread ended meanwhile
    return out


@pytest.fixture(params=["zygote", "own-process"])
async def made(tmp_path: Path, request):
    """(pool(spare_nice=None), proxies): pools on real proxy children; every pool and proxy
    made is stopped at the end."""
    policy = tmp_path / "sites.yaml"
    policy.write_text("version: 1\nmode: enforce\nports: [80, 443]\nallow_always: []\nblock: []\n")
    proxies: list[RunProxy] = []
    pools: list[ProxyPool] = []
    zygote = Zygote(policy, tmp_path / "decisions.log") if request.param == "zygote" else None

    def make() -> RunProxy:
        p = RunProxy(None, policy, tmp_path / "decisions.log", zygote=zygote)
        proxies.append(p)
        return p

    def pool(spare_nice: int | None = None) -> ProxyPool:
        pools.append(ProxyPool(make, spare_nice))
        return pools[-1]
    yield pool, proxies
    for pl in pools:
        await pl.stop()
    for p in proxies:
        await p.stop()
    if zygote is not None:
        await zygote.stop()


async def wait_spare(pool: ProxyPool, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while pool._spare is None:
        assert loop.time() < deadline, "no spare proxy started"
        await asyncio.sleep(0.05)


@pytest.mark.skipif(not can_renice(SPARE_PROXY_NICE), reason="this user may not raise a priority back")
async def test_the_spare_runs_at_the_lowest_priority_until_a_run_takes_it(made):
    new_pool, proxies = made
    guard_nice = os.getpriority(os.PRIO_PROCESS, 0)
    pool = new_pool()
    pool.refill()
    await wait_spare(pool)
    (spare,) = proxies
    assert spare.proc is not None
    assert thread_nice(spare.proc.pid) == {SPARE_PROXY_NICE}
    taken = await pool.take("run-1")
    assert taken is spare and taken.run_id == "run-1"
    assert thread_nice(spare.proc.pid) == {guard_nice}
    # it serves: a client is pushed and acknowledged
    name = await taken.add_client(["example.test"])
    assert taken.url_for(name).startswith("http://")


async def test_a_run_waits_for_the_spare_under_way_instead_of_starting_another(made):
    new_pool, proxies = made
    pool = new_pool()
    pool.refill()
    await asyncio.sleep(0)          # the spare's start has begun, it is not ready
    assert pool._spare is None
    taken = await pool.take("run-1")
    assert len(proxies) == 1 and taken is proxies[0]
    assert taken.alive()
    assert thread_nice(taken.proc.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}


async def test_without_a_spare_a_run_starts_its_own_at_the_guards_priority(made):
    new_pool, proxies = made
    taken = await new_pool().take("run-1")
    assert len(proxies) == 1 and taken.alive()
    assert thread_nice(taken.proc.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}


async def test_a_pool_that_may_not_raise_priorities_starts_spares_at_the_guards(made):
    new_pool, proxies = made
    pool = new_pool(spare_nice=0)
    pool.refill()
    await wait_spare(pool)
    assert thread_nice(proxies[0].proc.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}
