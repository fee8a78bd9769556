"""The control API of a Guard built in this process with the in-memory profile seams
(sfguard.supervisor.testing), driven through the real aiohttp app (api.build_app) with
aiohttp's test client. For what a real browser adds nothing to: runs, the lease table and
queue, profiles, and the error answers (status, code, field) of bad input and wrong state.

Another "process" of the fake lease (FakeProfileLease.for_process) stands for a run of another
guard that holds a profile, so a stage of ours waits for it without any browser starting."""
from __future__ import annotations

from typing import Any

import pytest

from sfguard.supervisor.daemon.api import build_app
from sfguard.supervisor.daemon.guard import Guard
from sfguard.supervisor.profiles.stores import Stores
from sfguard.supervisor.protocols import LOCAL_SCOPE, ProfileKey
from sfguard.supervisor.testing import FakeAuditSink, FakeKeyProvider, FakeProfileLease, FakeProfileStore

ALPHA = ProfileKey(LOCAL_SCOPE, "alpha")


class Api:
    """The guard's app on aiohttp's test server, and the fakes behind it."""

    def __init__(self, client: Any, guard: Guard, stores: Stores):
        self.client, self.guard, self.stores = client, guard, stores

    async def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None
                   ) -> tuple[int, dict[str, Any]]:
        kw: dict[str, Any] = {}
        if raw is not None:
            kw["data"] = raw
            kw["headers"] = {"Content-Type": "application/json"}
        elif body is not None:
            kw["json"] = body
        resp = await self.client.request(method, path, **kw)
        return resp.status, await resp.json()

    def other_guard(self) -> FakeProfileLease:
        """The lease as another guard process sees it (same lease state, other owner)."""
        lease: FakeProfileLease = self.stores.lease
        return lease.for_process()


@pytest.fixture
async def api(tmp_path, aiohttp_client, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    keys = FakeKeyProvider()
    stores = Stores("fake", "in-memory (test fakes)", keys,
                    FakeProfileStore(scopes=(LOCAL_SCOPE,), keys=keys), FakeProfileLease(),
                    FakeAuditSink())
    guard = Guard(tmp_path / "home", stores=stores)
    client = await aiohttp_client(build_app(guard))
    yield Api(client, guard, stores)
    await guard.stop()


def stage(stage_id: str, attempt: int = 1, **browser: Any) -> dict[str, Any]:
    return {"stage_id": stage_id, "attempt": attempt, "browser": {"headed": False, **browser}}


async def test_a_run_is_created_shown_and_ended(api):
    assert await api.call("POST", "/v1/runs", {"run_id": "r1", "pipeline": "/p/login.yaml"}) == (
        201, {"run_id": "r1", "state": "active"})
    status, run = await api.call("GET", "/v1/runs/r1")
    assert status == 200
    assert (run["run_id"], run["state"], run["outcome"], run["pipeline"]) == ("r1", "active", None, True)
    assert (run["stages"], run["browsers"], run["proxy"], run["problems"]) == ([], [], None, [])
    ended = await api.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
    assert ended == (200, {"ok": True, "outcome": "succeeded", "problems": []})
    status, run = await api.call("GET", "/v1/runs/r1")
    assert (status, run["state"], run["outcome"]) == (200, "ended", "succeeded")
    # ending an ended run answers its end again; it takes no new stage
    assert await api.call("POST", "/v1/runs/r1/end", {"outcome": "failed"}) == ended
    status, body = await api.call("POST", "/v1/runs/r1/stages", stage("s1"))
    assert (status, body["error"]["code"], body["error"]["field"]) == (409, "run_ended", "run_id")
    # the run is in the status, ended
    status, st = await api.call("GET", "/v1/status")
    assert [(r["run_id"], r["state"]) for r in st["runs"]] == [("r1", "ended")]


BAD = [
    # (method, path, body or raw bytes, status, code, field)
    ("POST", "/v1/runs", {"run_id": "../x"}, 400, "invalid_request", "run_id"),
    ("POST", "/v1/runs", {"run_id": "r9", "extra": 1}, 400, "invalid_request", "extra"),
    ("POST", "/v1/runs", b"{", 400, "invalid_json", None),
    ("POST", "/v1/runs", b"[1]", 400, "invalid_request", None),
    ("POST", "/v1/runs", {"run_id": "r1"}, 409, "run_exists", "run_id"),
    ("GET", "/v1/runs/nope", None, 404, "run_not_found", "run_id"),
    ("GET", "/v1/runs/a%20b", None, 400, "invalid_request", "run_id"),
    ("GET", "/v1/runs/r1/stages/nope", None, 404, "stage_not_found", "stage_id"),
    ("GET", "/v1/runs/r1/stages/nope/exec", None, 404, "stage_not_found", "stage_id"),
    ("DELETE", "/v1/runs/r1/stages/nope", None, 404, "stage_not_found", "stage_id"),
    ("POST", "/v1/runs/r1/stages/nope/end", {"outcome": "succeeded"}, 404, "stage_not_found", "stage_id"),
    ("POST", "/v1/runs/r1/stages/nope/end", {"outcome": "fine"}, 400, "invalid_request", "outcome"),
    ("GET", "/v1/runs/r1/stages/s?wait=99", None, 400, "invalid_request", "wait"),
    ("GET", "/v1/status?x=1", None, 400, "invalid_request", "x"),
    ("POST", "/v1/runs/r1/stages", stage("s", profile="@pipeline"), 400, "no_pipeline", "browser.profile"),
    ("POST", "/v1/runs/r1/stages", stage("s", profile="../etc"), 400, "invalid_request", "browser.profile"),
    ("POST", "/v1/runs/r1/stages", stage("s", allow_domains=["ok.example", "*"]), 400, "invalid_request",
     "browser.allow_domains.1"),
    ("POST", "/v1/runs/r1/stages", {"stage_id": "s", "attempt": 1, "browser": {"headed": True}}, 400,
     "no_display", "browser.headed"),
    ("POST", "/v1/runs/r1/stages", {"stage_id": "s", "attempt": 0, "browser": {}}, 400,
     "invalid_request", "attempt"),
    ("POST", "/v1/runs/r1/login-check/verify", {"profile": "alpha", "reported": {"logged_in": True, "url": "x"}},
     409, "no_login_check", "profile"),
    ("GET", "/v1/runs/r1/handoff", None, 404, "handoff_not_found", "run_id"),
    ("POST", "/v1/console/link", {"ttl_s": 60}, 409, "console_off", None),
    ("DELETE", "/v1/profiles/nope", None, 404, "profile_not_found", "name"),
    ("DELETE", "/v1/profiles/Bad!", None, 400, "invalid_request", "name"),
    ("PUT", "/v1/status", None, 405, "method_not_allowed", None),
    ("GET", "/v1/nothing", None, 404, "not_found", None),
]


@pytest.mark.parametrize("method,path,body,status,code,field", BAD,
                         ids=[f"{b[0]} {b[1]} {b[4]}" for b in BAD])
async def test_bad_input_and_wrong_state_are_answered_with_code_and_field(api, method, path, body,
                                                                          status, code, field):
    assert (await api.call("POST", "/v1/runs", {"run_id": "r1"}))[0] == 201
    got_status, got = await api.call(method, path, None if isinstance(body, bytes) else body,
                                     raw=body if isinstance(body, bytes) else None)
    assert (got_status, got["error"]["code"], got["error"]["field"]) == (status, code, field), got
    assert got["error"]["message"]


async def test_profiles_are_listed_and_deleted_unless_leased(api):
    api.stores.store.create(ALPHA)
    status, listed = await api.call("GET", "/v1/profiles")
    assert status == 200
    assert [(p["name"], p["scope"], p["leased_by"], p["size"]) for p in listed["profiles"]] == [
        ("alpha", LOCAL_SCOPE, None, 0)]
    other = api.other_guard()
    other.try_acquire(ALPHA, "their-run")
    assert [p["leased_by"] for p in (await api.call("GET", "/v1/profiles"))[1]["profiles"]] == ["their-run"]
    status, body = await api.call("DELETE", "/v1/profiles/alpha")
    assert (status, body["error"]["code"], body["error"]["field"]) == (409, "profile_leased", "name")
    assert "their-run" in body["error"]["message"]
    assert api.stores.store.exists(ALPHA)            # refused: still there
    other.release(ALPHA, "their-run")
    assert await api.call("DELETE", "/v1/profiles/alpha") == (200, {"ok": True})
    assert await api.call("GET", "/v1/profiles") == (200, {"profiles": []})
    assert not api.stores.store.exists(ALPHA)
    assert [(r["event"], r["fields"]["by"]) for r in api.stores.audit.records(profile="alpha")
            if r["event"] == "profile_deleted"] == [("profile_deleted", "api")]
    status, body = await api.call("DELETE", "/v1/profiles/alpha")
    assert (status, body["error"]["code"]) == (404, "profile_not_found")


async def test_a_stage_waits_in_the_queue_for_a_profile_another_run_holds(api):
    api.stores.store.create(ALPHA)
    other = api.other_guard()
    other.try_acquire(ALPHA, "their-run")
    assert (await api.call("POST", "/v1/runs", {"run_id": "r2"}))[0] == 201
    status, answer = await api.call("POST", "/v1/runs/r2/stages", stage("s1", profile="alpha"))
    assert status == 202
    assert (answer["state"], answer["holder_run"], answer["position"]) == ("waiting", "their-run", 1)
    # the same request again is a resume: the same answer; a long-poll that times out too
    assert (await api.call("POST", "/v1/runs/r2/stages", stage("s1", profile="alpha")))[0] == 202
    status, polled = await api.call("GET", "/v1/runs/r2/stages/s1?wait=0.3")
    assert (status, polled["state"], polled["holder_run"]) == (202, "waiting", "their-run")
    # a different request for an open stage is a conflict
    status, body = await api.call("POST", "/v1/runs/r2/stages", stage("s1", attempt=2, profile="alpha"))
    assert (status, body["error"]["code"], body["error"]["field"]) == (409, "stage_active", "stage_id")
    # the status shows the holder and our run in the queue; the run shows its waiting stage
    status, st = await api.call("GET", "/v1/status")
    assert status == 200
    lease = [row for row in st["leases"] if row["profile"] == "alpha"]
    assert [(row["holder_run"], [q["run"] for q in row["queue"]]) for row in lease] == [("their-run", ["r2"])]
    assert (st["guard"]["store"], st["guard"]["scope"], st["guard"]["store_error"]) == (
        "in-memory (test fakes)", LOCAL_SCOPE, None)
    assert (st["policy"]["state"], st["console"]) == ("ok", None)
    run = (await api.call("GET", "/v1/runs/r2"))[1]
    assert [(s["stage_id"], s["state"], s["holder_run"]) for s in run["stages"]] == [("s1", "waiting", "their-run")]
    assert run["browsers"] == [] and run["proxy"] is None       # nothing was started for it
    # withdrawn: it leaves the queue and ends cancelled; a second DELETE answers the same
    assert await api.call("DELETE", "/v1/runs/r2/stages/s1") == (200, {"state": "ended", "outcome": "cancelled"})
    assert await api.call("DELETE", "/v1/runs/r2/stages/s1") == (200, {"state": "ended", "outcome": "cancelled"})
    st = (await api.call("GET", "/v1/status"))[1]
    assert [(row["holder_run"], row["queue"]) for row in st["leases"] if row["profile"] == "alpha"] == [
        ("their-run", [])]
    assert await api.call("GET", "/v1/runs/r2/stages/s1") == (200, {"state": "ended", "outcome": "cancelled"})
    # the ended attempt cannot be used again; a new one queues again, and the run's end
    # takes it out of the queue
    status, body = await api.call("POST", "/v1/runs/r2/stages", stage("s1", profile="alpha"))
    assert (status, body["error"]["code"], body["error"]["field"]) == (409, "attempt_used", "attempt")
    assert (await api.call("POST", "/v1/runs/r2/stages", stage("s1", attempt=2, profile="alpha")))[0] == 202
    assert (await api.call("POST", "/v1/runs/r2/end", {"outcome": "cancelled"}))[0] == 200
    st = (await api.call("GET", "/v1/status"))[1]
    assert [row["queue"] for row in st["leases"] if row["profile"] == "alpha"] == [[]]
    run = (await api.call("GET", "/v1/runs/r2"))[1]
    assert [(s["state"], s["outcome"]) for s in run["stages"]] == [("ended", "cancelled")]


async def test_two_runs_queue_for_a_held_profile_in_order(api):
    """Two runs of this guard queue behind another guard's run; the first in line is first."""
    api.stores.store.create(ALPHA)
    other = api.other_guard()
    other.try_acquire(ALPHA, "their-run")
    for run_id in ("q1", "q2"):
        assert (await api.call("POST", "/v1/runs", {"run_id": run_id}))[0] == 201
        assert (await api.call("POST", f"/v1/runs/{run_id}/stages", stage("s", profile="alpha")))[0] == 202
    positions = [(await api.call("GET", f"/v1/runs/{r}/stages/s"))[1]["position"] for r in ("q1", "q2")]
    assert positions == [1, 2]
    st = (await api.call("GET", "/v1/status"))[1]
    assert [[q["run"] for q in row["queue"]] for row in st["leases"]] == [["q1", "q2"]]


async def test_start_checks_the_fake_seams_and_reports_damage(tmp_path, monkeypatch):
    """Guard.start over the fakes: their seals and audit chain are checked like the local ones;
    a broken chain and a profile whose scope key is gone are reported, never reset."""
    monkeypatch.setenv("SFGUARD_AGENT_BROWSER", "/nonexistent/agent-browser")
    keys = FakeKeyProvider()
    store = FakeProfileStore(scopes=(LOCAL_SCOPE,), keys=keys)
    audit = FakeAuditSink()
    store.create(ALPHA)
    audit.record("profile_created", profile="alpha")
    audit.record("profile_deleted", profile="beta")
    audit.entries[0]["fields"]["profile"] = "gamma"          # edited behind the chain's back
    guard = Guard(tmp_path / "home", stores=Stores("fake", "in-memory (test fakes)", keys, store,
                                                   FakeProfileLease(), audit))
    try:
        report = await guard.start()
        assert "record content does not match its hash" in report["audit"]
        assert "damaged_profiles" not in report
    finally:
        await guard.stop()
    keys.delete_key(LOCAL_SCOPE)                              # the seal can no longer open
    audit.entries[0]["fields"]["profile"] = "alpha"
    guard = Guard(tmp_path / "home2", stores=Stores("fake", "in-memory (test fakes)", keys, store,
                                                    FakeProfileLease(), audit))
    try:
        report = await guard.start()
        assert "audit" not in report
        assert report["damaged_profiles"] == ["alpha"]
    finally:
        await guard.stop()


# --- special addresses only with the reviewer's consent (issue 35, sections 1 and 6) ---------

# (allow_domains, status, code, the fields the message names, the first one in `field`);
# the guard's policy is its home's sites.yaml, made from the template: no private_networks
SPECIAL = [
    (["169.254.169.254"], 403, "reviewer_only_address", ["browser.allow_domains.0"]),
    (["fd00:ec2::254"], 403, "reviewer_only_address", ["browser.allow_domains.0"]),
    (["::ffff:169.254.169.254"], 403, "reviewer_only_address", ["browser.allow_domains.0"]),
    (["*.example.com", "127.0.0.0/8", "93.184.216.34", "10.0.0.0/8", "[::1]:8080"], 403,
     "reviewer_only_address",
     ["browser.allow_domains.1", "browser.allow_domains.3", "browser.allow_domains.4"]),
    # every bad pattern of a list is named, not only the first
    (["*.linkedin.com", "0.0.0.0/0", "*.com", "::/0"], 400, "invalid_request",
     ["browser.allow_domains.1", "browser.allow_domains.2", "browser.allow_domains.3"]),
]


@pytest.mark.parametrize("allow,status,code,fields", SPECIAL, ids=[",".join(s[0]) for s in SPECIAL])
async def test_a_stage_may_not_name_a_special_address(api, allow, status, code, fields):
    assert (await api.call("POST", "/v1/runs", {"run_id": "r1"}))[0] == 201
    got_status, got = await api.call("POST", "/v1/runs/r1/stages", stage("s", allow_domains=allow))
    assert (got_status, got["error"]["code"], got["error"]["field"]) == (status, code, fields[0]), got
    message = got["error"]["message"]
    named = [f"browser.allow_domains.{i}" for i in range(len(allow))
             if f"browser.allow_domains.{i}: " in message]
    assert named == fields, message
    if code == "reviewer_only_address":
        assert "only the security reviewer can" in message
        assert f"private_networks.allow of {api.guard.policy_path}" in message
    # nothing was started for it
    assert (await api.call("GET", "/v1/runs/r1/stages/s"))[0] == 404


async def test_the_reviewer_consents_in_the_live_policy(api):
    # the same stage is accepted once the home's policy lists the range (hot reload)
    path = api.guard.policy_path
    assert path == api.guard.home / "sites.yaml"
    assert (await api.call("POST", "/v1/runs", {"run_id": "r1"}))[0] == 201
    body = stage("s", allow_domains=["10.0.0.0/8", "93.184.216.34"])
    assert (await api.call("POST", "/v1/runs/r1/stages", body))[0] == 403
    path.write_text(path.read_text().replace("allow: []", 'allow: ["10.0.0.0/8"]'))
    api.guard.check_policy()
    assert api.guard.site_policy.private_networks
    status, got = await api.call("POST", "/v1/runs/r1/stages", body)
    assert status in (200, 202, 503), got      # past the policy (the fake browser may be away)
    assert got.get("error", {}).get("code") != "reviewer_only_address", got


@pytest.mark.parametrize("fault, status, code", [
    ("illegal_transition", 500, "internal"),
    ("browser_start", 503, "browser_failed"),
    ("os_error", 503, "browser_failed"),
])
async def test_a_bug_of_the_guard_is_an_internal_error_not_a_browser_failure(api, caplog, fault, status, code):
    """An IllegalTransition is a bug of the guard (daemon/runs.py): the runner gets a 500 and the
    guard's log the traceback, never `browser_failed` (which tells the runner to retry later)."""
    from sfguard.supervisor.daemon.runs import IllegalTransition, StageState
    from sfguard.supervisor.errors import BrowserStartError

    async def broken(run, stage, user=None):
        raise {"illegal_transition": IllegalTransition(StageState.READY, StageState.WAITING),
               "browser_start": BrowserStartError("the run's guard proxy did not start"),
               "os_error": OSError(5, "Input/output error")}[fault]

    api.guard.stages.supply.throwaway = broken
    assert (await api.call("POST", "/v1/runs", {"run_id": "r1"}))[0] == 201
    with caplog.at_level("ERROR", logger="sfguard"):
        got, body = await api.call("POST", "/v1/runs/r1/stages", stage("s1"))
    assert (got, body["error"]["code"]) == (status, code), body
    logged = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info]
    if fault == "illegal_transition":
        assert logged and "IllegalTransition" in repr(logged[0].exc_info[1].__class__)
    else:
        assert not logged
