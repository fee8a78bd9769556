"""How much a record keeps: the guard's level, each site's (sites.yaml `recording`), the size
cap; and where entries come from, fed as the guard's sources feed them (issue 48)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from sfguard.policy import parse_policy
from sfguard.supervisor.record import files
from sfguard.supervisor.record.recorder import Recorder, RecordSettings

POLICY = """version: 1
recording:
  - pattern: bank.test
    level: decisions
    reason: statements on screen
  - patterns: ["*.health.test"]
    level: "off"
    reason: medical records
"""
PARSED = parse_policy(POLICY)


class Pipe:
    def __init__(self, urls: dict[str, str]):
        self.targets = {t: {"targetId": t, "type": "page", "url": u} for t, u in urls.items()}


class Audit:
    def __init__(self):
        self.records = []

    def record(self, event, **fields):
        self.records.append((event, fields))


@dataclass
class Held:
    run_id: str = "r1"
    stage_id: str = "s1"
    attempt: int = 1
    method: str = "POST"
    host: str = "shop.test"
    port: int = 443
    path: str = "/buy"
    why: str = "stage_mode"
    rule: str | None = None
    tab_url: str = "https://shop.test/cart?id=7"
    screenshot: bytes | None = b"\x89PNG picture"


@dataclass
class Approval:
    id: str
    held: Held
    by: str | None = None
    reason: str = ""


async def recorder(tmp_path, level="full", **kw):
    r = Recorder(tmp_path / "records", RecordSettings(level=level, **kw), policy=lambda: PARSED,
                 audit=Audit())
    r.loop = asyncio.get_running_loop()
    r.run_started("r1", "/home/me/pipes/p.yaml")
    r.stage("r1", "s1", 1, "requested", profile="acct")
    r.stage("r1", "s1", 1, "ready")
    return r


async def settled():
    """The gate's observer writes its entries on the loop's next turn."""
    for _ in range(3):
        await asyncio.sleep(0)


def entries(r, run="r1"):
    folder = r.root / run
    return files.read_entries(folder)[0]


def nav(url, tab="T1"):
    return {"id": 1, "method": "Page.navigate", "params": {"url": url}, "sessionId": "S"}


async def test_a_site_recorded_as_decisions_keeps_only_the_guards_decisions(tmp_path):
    r = await recorder(tmp_path)
    bank = Pipe({"T1": "https://bank.test/statement"})
    r.command("r1/s1/1", {"id": 2, "method": "Runtime.evaluate", "params": {"expression": "document.title"}},
              "T1", bank, None)
    r.command("r1/s1/1", {"id": 3, "method": "Storage.getCookies"}, "T1", bank, "cookie dump")
    r.proxy_line({"run": "r1", "client": "b1", "method": "CONNECT", "host": "bank.test", "port": 443,
                  "decision": "allow", "reason": "allowed_by_run", "ts": "2030-01-01T00:00:00.000Z"})
    await settled()
    kinds = [(e["kind"], e.get("method")) for e in entries(r)]
    assert ("command", "Runtime.evaluate") not in kinds
    assert ("command", "Storage.getCookies") in kinds and ("proxy", "CONNECT") in kinds
    assert {"kind": "level", "level": "decisions", "host": "bank.test"}.items() <= next(
        e for e in entries(r) if e["kind"] == "level").items()


async def test_a_site_recorded_off_leaves_nothing_of_it_not_even_its_name(tmp_path):
    r = await recorder(tmp_path)
    clinic = Pipe({"T1": "https://www.health.test/patient?id=42"})
    r.command("r1/s1/1", nav("https://www.health.test/patient?id=42"), "T1", clinic, None)
    r.command("r1/s1/1", {"id": 3, "method": "Storage.getCookies"}, "T1", clinic, "cookie dump")
    r.proxy_line({"run": "r1", "client": "b1", "method": "CONNECT", "host": "www.health.test", "port": 443,
                  "decision": "allow", "reason": "allowed_by_run"})
    r.write_decision({"run": "r1", "stage": "s1", "decision": "write_refused", "host": "www.health.test",
                      "method": "POST", "port": 443, "path": "/x"})
    await settled()
    text = (r.root / "r1" / files.TIMELINE).read_text()
    assert "health" not in text and "patient" not in text
    assert any(e["kind"] == "level" and e["level"] == "off" for e in entries(r))


async def test_the_guards_level_is_a_ceiling_over_every_site(tmp_path):
    r = await recorder(tmp_path, level="decisions")
    shop = Pipe({"T1": "https://shop.test/"})
    r.command("r1/s1/1", nav("https://shop.test/cart"), "T1", shop, None)
    r.command("r1/s1/1", {"id": 4, "method": "Target.createBrowserContext"}, None, shop, "contexts are the guard's")
    await settled()
    kinds = [e["kind"] for e in entries(r)]
    assert "command" in kinds and not any(e.get("method") == "Page.navigate" for e in entries(r))


async def test_off_at_the_guard_records_no_run(tmp_path):
    r = Recorder(tmp_path / "records", RecordSettings(level="off"), policy=lambda: PARSED)
    r.loop = asyncio.get_running_loop()
    r.run_started("r1", None)
    assert not (tmp_path / "records").exists() and r.runs == {}


async def test_a_held_write_keeps_its_picture_and_its_decision_links_back(tmp_path):
    r = await recorder(tmp_path)
    held = Approval("ap_" + "1" * 20, Held())
    r.approval("write_held", held)
    held.by, held.reason = "console:ana", "looks right"
    r.approval("write_approved", held)
    await asyncio.sleep(0.2)            # the picture is written in the background
    w = [e for e in entries(r) if e["kind"] == "write"]
    assert [e["verdict"] for e in w] == ["held", "approved"]
    assert w[1]["links"]["held"] == w[0]["seq"] and w[1]["by"] == "console:ana"
    shot = w[0]["links"]["shot"]
    assert (r.root / "r1" / files.SHOTS / shot).read_bytes() == b"\x89PNG picture"
    assert w[0]["page"] == "https://shop.test/cart?id=..."


async def test_the_size_cap_keeps_decisions_then_stops(tmp_path):
    r = await recorder(tmp_path, max_run_mb=1, max_total_mb=10)
    shop = Pipe({"T1": "https://shop.test/"})
    big = {"id": 9, "method": "Runtime.evaluate", "params": {"expression": "x" * 150}}
    for _ in range(5000):
        r.command("r1/s1/1", big, "T1", shop, None)
    r.command("r1/s1/1", {"id": 10, "method": "Storage.getCookies"}, "T1", shop, "cookie dump")
    await settled()
    got = entries(r)
    capped = next(i for i, e in enumerate(got) if e["kind"] == "record_capped")
    after = got[capped + 1:]
    assert after and all(e.get("refused") for e in after), after[:3]
    assert r.runs["r1"].dropped > 0
    await r.run_ended("r1", "succeeded")
    index = files.read_index(r.root / "r1")
    assert index["capped"] is True and index["dropped"] > 0 and index["bytes"] < 1.2 * 1024 * 1024


async def test_sealing_puts_the_index_digest_in_the_audit_chain(tmp_path):
    r = await recorder(tmp_path)
    await r.run_ended("r1", "succeeded")
    (event, fields), = [x for x in r.audit.records if x[0] == "run_recorded"]
    assert fields["record"] == "r1" and fields["count"] == len(entries(r))
    assert files.check(r.root / "r1", fields["record_sha256"]) == []
    assert json.loads((r.root / "r1" / files.INDEX).read_text())["pipeline"] == "p.yaml"


async def test_a_record_left_open_is_sealed_as_abandoned_at_the_next_start(tmp_path):
    r = await recorder(tmp_path)
    r.runs["r1"].writer.close()          # the guard was killed: nothing sealed
    again = Recorder(tmp_path / "records", RecordSettings(), policy=lambda: PARSED, audit=Audit())
    assert again.recover() == ["r1"]
    index = files.read_index(tmp_path / "records" / "r1")
    assert index["state"] == "abandoned" and index["entries"] == 3
    sha = again.audit.records[0][1]["record_sha256"]
    assert files.check(tmp_path / "records" / "r1", sha) == []


@pytest.mark.parametrize("bad", [dict(level="some"), dict(keep_days=0), dict(max_run_mb=0.5),
                                 dict(shot_interval=0.5), dict(max_total_mb=1, max_run_mb=2)])
def test_settings_are_checked(bad):
    with pytest.raises(ValueError):
        RecordSettings(**bad).check()


class Camera:
    """A browser view that takes pictures (what tabs.TabWatcher does with a real tab)."""

    def __init__(self, pipe):
        self.pipe, self.taken = pipe, []

    def ensure(self, target):
        pass

    async def capture(self, target, quality=50):
        self.taken.append(target)
        return b"\xff\xd8jpeg"

    async def close(self):
        pass


async def test_a_busy_stage_is_pictured_at_most_every_interval_and_an_idle_one_not(tmp_path, monkeypatch):
    from sfguard.supervisor.record import core
    monkeypatch.setattr(core, "QUIET_S", 0.05)
    r = await recorder(tmp_path, shot_interval=1)
    shop = Pipe({"T1": "https://shop.test/"})
    camera = Camera(shop)
    r.runs["r1"].watchers[id(shop)] = camera
    for _ in range(3):                          # busy: commands, the interval passes
        r.command("r1/s1/1", {"id": 1, "method": "Runtime.evaluate", "params": {"expression": "1"}}, "T1", shop, None)
        await settled()
        r._interval_shots()
        await asyncio.sleep(0.3)
    assert len(camera.taken) == 1               # once in the interval, however busy
    await asyncio.sleep(1.0)
    r._interval_shots()
    await asyncio.sleep(0.3)
    assert len(camera.taken) == 2               # it was busy after that picture
    await asyncio.sleep(1.1)
    r._interval_shots()
    await asyncio.sleep(0.3)
    assert len(camera.taken) == 2               # idle since: no new picture
    r.command("r1/s1/1", {"id": 2, "method": "Runtime.evaluate", "params": {"expression": "2"}}, "T1", shop, None)
    await settled()
    r._interval_shots()
    await asyncio.sleep(0.3)
    assert len(camera.taken) == 3
    shots = [e for e in entries(r) if e["kind"] == "screenshot"]
    assert {s["why"] for s in shots} == {"interval"} and shots[0]["url"] == "https://shop.test/"


async def test_no_picture_of_a_site_recorded_below_full_nor_while_a_handoff_is_open(tmp_path):
    r = await recorder(tmp_path, shot_interval=1)
    bank = Pipe({"T1": "https://bank.test/statement"})
    camera = Camera(bank)
    run = r.runs["r1"]
    run.watchers[id(bank)], run.profile_of[id(bank)] = camera, "acct"
    st = run.stages["s1"]
    st.pipe, st.last_tab = bank, "T1"
    r.shoot("r1", "s1", "T1", "navigation", None)
    await asyncio.sleep(0.1)
    assert camera.taken == []                   # bank.test: decisions only
    bank.targets["T1"]["url"] = "https://shop.test/"
    run.paused.add("acct")                      # a person logs in on this browser
    r.shoot("r1", "s1", "T1", "interval", None)
    await asyncio.sleep(0.1)
    assert camera.taken == []
    r.shoot("r1", "s1", "T1", "handoff_start", None, handoff=True)
    await asyncio.sleep(0.1)
    assert camera.taken == ["T1"]               # the one picture as the handoff opens
