"""10,000 runs created and ended through the control API of one guard (issue 35, section 3):
its memory (tracemalloc of sfguard's code, RSS), its run table and `status --json` stay flat.
The 1,000-run version is in the default suite (tests/daemon/test_run_retention.py), with the
run records on; here they are off: each run's record is a folder, a timeline and an index sealed
with fsync, which made these 10,000 runs take minutes of the CI budget (the records' memory is
checked by the 1,000 runs)."""
from __future__ import annotations

import pytest

from sfguard.supervisor.record.recorder import RecordSettings
from tests.daemon.test_run_retention import assert_flat, make_api, memory_stays_flat  # noqa: F401

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


async def test_ten_thousand_runs_leave_the_guard_flat(make_api):  # noqa: F811
    api = await make_api(record=RecordSettings(level="off"))   # else the defaults: 200 ended runs, 24 h
    got = await memory_stays_flat(api, 10_000, 4_000)
    print(f"10000 runs: {got}")
    assert_flat(got, 10_000, 200, records=False)
    assert got["rss_growth"] < 8 * 2**20, got
