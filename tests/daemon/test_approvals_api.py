"""Write approvals over the control API (GET/POST /v1/approvals): a held write waits until a
person approves or denies it, once; identical writes pending at once are one approval; a
timeout or the stage's end denies it; password-like form values are masked; every transition
is in the audit chain with who decided. The guard is built in this process with the in-memory
seams and driven through the real aiohttp app; held writes come through the guard's own
approver (`guard.approvals`), as the browser's write gate hands them over."""
from __future__ import annotations

import asyncio

import pytest

from sfguard.supervisor.writes.held import HeldWrite

from .test_guard_fakes import api  # noqa: F401 (the fixture)


def held(n: int = 1, form=(("title", "hello"), ("password", "hunter2")), stage="s1", fp=None) -> HeldWrite:
    return HeldWrite("r1", stage, 1, "alpha", "POST", f"https://app.test/items?id={n}&key=v", "app.test", "/items",
                     tuple(form), 30, "application/x-www-form-urlencoded", None, fp or f"{n:064x}")


async def test_approve_releases_exactly_once_and_is_audited(api):  # noqa: F811
    g = api.guard
    assert (await api.call("POST", "/v1/runs", {"run_id": "r1"}))[0] == 201
    waiter = asyncio.create_task(g.approvals.decide(held(), 30))
    await asyncio.sleep(0.05)
    status, body = await api.call("GET", "/v1/approvals?state=pending")
    assert status == 200 and len(body["approvals"]) == 1
    ap = body["approvals"][0]
    assert (ap["method"], ap["host"], ap["path"], ap["state"]) == ("POST", "app.test", "/items", "pending")
    assert ap["form"] == [["title", "hello"], ["password", "********"]]       # masked when shown
    assert ap["url"] == "https://app.test/items?id=1&key=v"                  # whole, for the approver
    status, one = await api.call("GET", f"/v1/approvals/{ap['id']}")
    assert status == 200 and one["id"] == ap["id"]
    status, run = await api.call("GET", "/v1/runs/r1")          # the run shows what it holds
    assert status == 200 and [x["id"] for x in run["approvals"]] == [ap["id"]]
    status, done = await api.call("POST", f"/v1/approvals/{ap['id']}", {"decision": "approve"})
    assert status == 200 and done["state"] == "approved" and done["decided_by"] == "api"
    outcome = await asyncio.wait_for(waiter, 5)
    assert outcome.approved and outcome.by == "api"
    status, again = await api.call("POST", f"/v1/approvals/{ap['id']}", {"decision": "deny"})
    assert (status, again["error"]["code"]) == (409, "approval_decided")
    assert (await api.call("GET", "/v1/runs/r1"))[1]["approvals"] == []
    events = [r["event"] for r in api.stores.audit.records(run="r1") if r["event"].startswith("write_")]
    assert events == ["write_held", "write_approved"]
    assert "hunter2" not in repr(api.stores.audit.records(run="r1"))


async def test_deny_timeout_cancel_and_one_approval_per_request(api):  # noqa: F811
    g = api.guard
    a = asyncio.create_task(g.approvals.decide(held(2), 30))
    b = asyncio.create_task(g.approvals.decide(held(2), 30))            # identical: still two requests
    await asyncio.sleep(0.05)
    pending = (await api.call("GET", "/v1/approvals?state=pending"))[1]["approvals"]
    assert len(pending) == 2 and pending[0]["id"] != pending[1]["id"]
    await api.call("POST", f"/v1/approvals/{pending[0]['id']}", {"decision": "deny", "reason": "not today"})
    out_a = await asyncio.wait_for(a, 5)
    assert not out_a.approved and out_a.reason == "not today" and not b.done()   # one answer, one request
    await api.call("POST", f"/v1/approvals/{pending[1]['id']}", {"decision": "approve"})
    assert (await asyncio.wait_for(b, 5)).approved
    # a timeout is a denial
    out = await g.approvals.decide(held(3), 0.2)
    assert not out.approved and out.by == "timeout"
    # the stage's end denies what it still holds
    c = asyncio.create_task(g.approvals.decide(held(4, stage="s2"), 30))
    await asyncio.sleep(0.05)
    assert g.approvals.cancel("r1", "s2") == 1
    assert not (await c).approved
    states = sorted(x["state"] for x in (await api.call("GET", "/v1/approvals"))[1]["approvals"])
    assert states == ["approved", "cancelled", "denied", "timed_out"]
    # the audit chain keeps what was held, why, who decided and their words; never a value
    recs = [r["fields"] for r in api.stores.audit.records(run="r1") if r["event"] == "write_denied"]
    assert recs and recs[0]["note"] == "not today" and recs[0]["url"] == "https://app.test/items?id=...&key=..."
    assert recs[0]["fields"] == "title,password" and recs[0]["body_size"] == 30 and recs[0]["why"] == "stage_mode"
    assert "hunter2" not in repr(api.stores.audit.records(run="r1"))


async def test_long_poll_answers_when_a_write_is_held(api):  # noqa: F811
    g = api.guard
    poll = asyncio.create_task(api.call("GET", "/v1/approvals?state=pending&wait=5"))
    await asyncio.sleep(0.2)
    assert not poll.done()
    waiter = asyncio.create_task(g.approvals.decide(held(5), 30))
    status, body = await asyncio.wait_for(poll, 3)
    assert status == 200 and len(body["approvals"]) == 1
    g.approvals.cancel("r1")
    await waiter


@pytest.mark.parametrize("method, path, body, status, code", [
    ("GET", "/v1/approvals/ap_0123456789abcdef0123", None, 404, "approval_not_found"),
    ("GET", "/v1/approvals/nope", None, 400, "invalid_request"),
    ("POST", "/v1/approvals/ap_0123456789abcdef0123", {"decision": "approve"}, 404, "approval_not_found"),
    ("POST", "/v1/approvals/ap_0123456789abcdef0123", {"decision": "maybe"}, 400, "invalid_request"),
    ("GET", "/v1/approvals?state=odd", None, 400, "invalid_request"),
    ("GET", "/v1/approvals?run=../x", None, 400, "invalid_request"),
    ("GET", "/v1/approvals?who=me", None, 400, "invalid_request"),
])
async def test_bad_requests(api, method, path, body, status, code):  # noqa: F811
    got, answer = await api.call(method, path, body)
    assert (got, answer["error"]["code"]) == (status, code)


async def test_decided_approvals_outlive_the_guard_and_pending_ones_end_cancelled(api, tmp_path):  # noqa: F811
    """A decided approval is a record: listed and shown by the next guard on the same home (query
    values hidden), for the retention period; one pending when the guard stops ends cancelled."""
    from sfguard.supervisor.daemon.api import build_app
    from sfguard.supervisor.daemon.guard import Guard
    g = api.guard
    w = asyncio.create_task(g.approvals.decide(held(7), 30))
    pending_w = asyncio.create_task(g.approvals.decide(held(8), 30))
    await asyncio.sleep(0.05)
    first, second = (await api.call("GET", "/v1/approvals?state=pending"))[1]["approvals"]
    await api.call("POST", f"/v1/approvals/{first['id']}", {"decision": "approve", "reason": "checked the cart"})
    assert (await w).approved
    await g.stop()
    assert not (await pending_w).approved                      # the stop denied it: nothing is sent
    home = g.home
    assert oct((home / "approvals").stat().st_mode & 0o777) == "0o700"
    assert oct((home / "approvals" / "decided.jsonl").stat().st_mode & 0o777) == "0o600"
    again = Guard(home, stores=api.stores)
    try:
        app = build_app(again)
        from aiohttp.test_utils import TestClient, TestServer
        async with TestClient(TestServer(app)) as client:
            res = await client.get("/v1/approvals")
            listed = {a["id"]: a for a in (await res.json())["approvals"]}
            assert listed[first["id"]]["state"] == "approved" and listed[second["id"]]["state"] == "cancelled"
            one = await (await client.get(f"/v1/approvals/{first['id']}")).json()
            assert (one["decided_by"], one["reason"], one["method"], one["path"]) == (
                "api", "checked the cart", "POST", "/items")
            assert one["url"] == "https://app.test/items?id=...&key=..." and one["form"] == [
                ["title", "hello"], ["password", "********"]]
            status = (await client.post(f"/v1/approvals/{first['id']}", json={"decision": "deny"})).status
            assert status == 409
    finally:
        await again.stop()
    assert "hunter2" not in (home / "approvals" / "decided.jsonl").read_text()
