"""Ended runs leave the guard's memory after a retention (issue 35, section 3): count and age.
Their record stays on disk (`<home>/runs/ended/<id>.json`) and GET /v1/runs/{id} answers it;
`status` lists the active runs and the most recently ended ones. Driven through the real
control API (api.build_app) of a Guard with the in-memory profile seams: runs without a browser
stage are the fast path, so thousands of them take seconds."""
from __future__ import annotations

import gc
import json
import os
import time
import tracemalloc
from typing import Any

import psutil
import pytest

from sfguard.supervisor.daemon.api import build_app
from sfguard.supervisor.daemon.guard import Guard
from sfguard.supervisor.daemon.settings import GuardSettings
from sfguard.supervisor.profiles.stores import Stores
from sfguard.supervisor.protocols import LOCAL_SCOPE
from sfguard.supervisor.testing import FakeAuditSink, FakeKeyProvider, FakeProfileLease, FakeProfileStore
from tests.daemon.conftest import ROOT


class Api:
    def __init__(self, client: Any, guard: Guard):
        self.client, self.guard = client, guard

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        # the client's session itself: the test client would keep every response it made
        async with self.client.session.request(method, self.client.make_url(path), json=body) as resp:
            return resp.status, await resp.json()

    async def run_and_end(self, run_id: str, outcome: str = "succeeded") -> None:
        assert (await self.call("POST", "/v1/runs", {"run_id": run_id}))[0] == 201
        assert (await self.call("POST", f"/v1/runs/{run_id}/end", {"outcome": outcome}))[0] == 200


@pytest.fixture
async def make_api(tmp_path, aiohttp_client, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    guards: list[Guard] = []

    async def make(**keep: Any) -> Api:
        keys = FakeKeyProvider()
        stores = Stores("fake", "in-memory (test fakes)", keys,
                        FakeProfileStore(scopes=(LOCAL_SCOPE,), keys=keys), FakeProfileLease(),
                        FakeAuditSink())
        guard = Guard(tmp_path / "home", stores=stores, settings=GuardSettings(**keep))
        guards.append(guard)
        return Api(await aiohttp_client(build_app(guard)), guard)
    yield make
    for g in guards:
        await g.stop()


async def test_ended_runs_leave_memory_by_count_and_stay_answerable(make_api, tmp_path):
    api = await make_api(keep_ended_runs=3)
    assert (await api.call("POST", "/v1/runs", {"run_id": "live"}))[0] == 201
    for i in range(1, 6):
        await api.run_and_end(f"r{i}", "failed" if i == 1 else "succeeded")
    # status: the active run, then the 3 most recently ended, newest first; the rest retired
    status, st = await api.call("GET", "/v1/status")
    assert [(r["run_id"], r["state"]) for r in st["runs"]] == [
        ("live", "active"), ("r5", "ended"), ("r4", "ended"), ("r3", "ended")]
    assert st["runs"][1]["ended"] is not None and st["runs"][0]["ended"] is None
    assert st["runs_summary"] == {"active": 1, "ended_shown": 3, "ended_in_memory": 3, "retired": 2,
                                  "keep_ended_runs": 3, "keep_ended_hours": 24.0}
    # a retired run: its record from disk (0600), marked retired
    status, run = await api.call("GET", "/v1/runs/r1")
    assert status == 200, run
    assert (run["run_id"], run["state"], run["outcome"], run["retired"]) == ("r1", "ended", "failed", True)
    rec = tmp_path / "home" / "runs" / "ended" / "r1.json"
    assert rec.stat().st_mode & 0o777 == 0o600
    status, run3 = await api.call("GET", "/v1/runs/r3")
    assert (status, run3.get("retired", False)) == (200, False)
    # ending it again answers its end again; it takes no stage; its stages are not served
    assert await api.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"}) == (
        200, {"ok": True, "outcome": "failed", "problems": []})
    status, body = await api.call("POST", "/v1/runs/r1/stages",
                                  {"stage_id": "s", "attempt": 1, "browser": {"headed": False}})
    assert (status, body["error"]["code"]) == (409, "run_ended")
    status, body = await api.call("GET", "/v1/runs/r1/stages/s")
    assert (status, body["error"]["code"]) == (404, "run_not_found")
    assert "left this guard's memory" in body["error"]["message"]
    assert "newest 3" in body["error"]["message"]
    # a run whose record is gone too: a 404 that names the retention
    rec.unlink()
    status, body = await api.call("GET", "/v1/runs/r1")
    assert (status, body["error"]["code"]) == (404, "run_not_found")
    assert "ended runs leave the guard's memory after the newest 3" in body["error"]["message"]


async def test_ended_runs_leave_memory_by_age(make_api):
    api = await make_api(keep_ended_runs=100, keep_ended_seconds=0.3)
    await api.run_and_end("old")
    time.sleep(0.4)
    await api.run_and_end("new")
    status, st = await api.call("GET", "/v1/status")
    assert [r["run_id"] for r in st["runs"]] == ["new"]
    assert st["runs_summary"]["retired"] == 1
    status, run = await api.call("GET", "/v1/runs/old")
    assert (status, run["retired"]) == (200, True)


async def churn(api: Api, start: int, count: int) -> None:
    for i in range(start, start + count):
        await api.run_and_end(f"churn-{i}")


def rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def guard_bytes(diffs: list[tracemalloc.StatisticDiff]) -> int:
    """The growth allocated by sfguard's own code (and the dataclass __init__s it runs):
    aiohttp's and yarl's bounded caches of the test client are not the guard's."""
    def ours(name: str) -> bool:
        return name == "<string>" or (name.startswith(str(ROOT)) and "/.venv/" not in name
                                      and "/tests/" not in name)
    return sum(d.size_diff for d in diffs if ours(d.traceback[0].filename))


async def memory_stays_flat(api: Api, total: int, measured: int) -> dict[str, Any]:
    """Create and end `total` runs; over the last `measured` of them, the memory sfguard's code
    holds (tracemalloc), the guard's run table and the size of `status --json` stay flat."""
    t0 = time.monotonic()
    await churn(api, 0, total - measured)
    status_warm = len(json.dumps((await api.call("GET", "/v1/status"))[1], indent=2))
    tracemalloc.start()
    try:
        gc.collect()
        before, rss_before = tracemalloc.take_snapshot(), rss()
        audit = api.guard.stores.audit._sink       # the in-memory audit store (the test's database)
        sealed = len(audit.entries)
        await churn(api, total - measured, measured)
        sealed = len(audit.entries) - sealed
        del audit.entries[:-1]     # what a store keeps is not the guard's memory: each run's record sealed
        gc.collect()
        after, rss_after = tracemalloc.take_snapshot(), rss()
    finally:
        tracemalloc.stop()
    diffs = after.compare_to(before, "filename")
    status_end = len(json.dumps((await api.call("GET", "/v1/status"))[1], indent=2))
    return {"seconds": round(time.monotonic() - t0, 1), "runs_in_memory": len(api.guard.runs),
            "measured": measured, "guard_growth": guard_bytes(diffs), "all_growth": sum(d.size_diff for d in diffs),
            "rss_growth": rss_after - rss_before, "status_warm": status_warm,
            "status_end": status_end, "on_disk": len(list((api.guard.runs_dir / "ended").iterdir())),
            "sealed": sealed}


def assert_flat(got: dict[str, Any], total: int, keep: int, records: bool = True) -> None:
    assert got["runs_in_memory"] == keep, got
    assert got["on_disk"] == total, got
    # each run's record sealed in the audit chain (none with the records off)
    assert got["sealed"] == (got["measured"] if records else 0), got
    # no Run, stage or record kept per ended run: a Run with its dicts and asyncio lock is
    # about 2 KB (measured on the code that kept them: over 1 MB for 500 runs). What remains is
    # bounded caches (aiohttp's and yarl's URL caches hold run ids from our frames) that fill up
    assert got["guard_growth"] < 300 * got["measured"], got
    assert abs(got["status_end"] - got["status_warm"]) < 200, got


async def test_a_thousand_runs_leave_the_guard_flat(make_api):
    api = await make_api(keep_ended_runs=50)
    got = await memory_stays_flat(api, 1000, 500)
    print(f"1000 runs: {got}")
    assert_flat(got, 1000, 50)
