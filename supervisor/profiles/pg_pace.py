"""The sites' pace on the shared PostgreSQL store: one pace per profile for every guard host.

A run's proxy process (supervisor/daemon/proxy_child.py) gets the store's connection string over
its stdin and counts every paced request here (`PgPaceStore.take`, the `PaceStore` of
proxy_addons/pacing.py): one call of `sfguard_pace_take` (pg_schema.py, migration 4) takes every
counter of the request at once or none, with the arithmetic of `policy.pace.admit` in SQL, on
the database's clock (no host's clock decides a wait). The database is on the request path of
paced requests only: one round trip per request (measured: tests/pg/test_pace.py). When it
cannot be reached a paced request is refused (`PaceUnavailable`, 503 `pace_unavailable`): the
guard does not guess a pace it cannot count.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from sfguard.policy.pace import Admission, Limit, Rate
from sfguard.proxy_addons.pacing import PaceUnavailable
from sfguard.supervisor.errors import swallowed
from sfguard.supervisor.profiles.pg_backend import redact_url

log = logging.getLogger("sfguard.pg_store")

CONNECT_TIMEOUT = 3.0
#: seconds a call may take before the request is refused (a stuck database slows no browser long)
CALL_TIMEOUT = 2.0
#: counters not used for this long are deleted (one in SWEEP_EVERY calls does it)
IDLE_DROP_S = 24 * 3600.0
SWEEP_EVERY = 5000
TAKE = "SELECT wait, refused, retry, worst FROM sfguard_pace_take(%s, %s, %s, %s, %s)"


class PgPaceStore:
    """One connection per proxy process (opened at the first paced request, again after a
    failure); calls are serialised on it."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.shown = redact_url(url)
        self._conn: Any = None          # psycopg.AsyncConnection, imported when first used
        self._lock = asyncio.Lock()
        self._calls = 0

    async def _connection(self) -> Any:
        import psycopg  # noqa: PLC0415
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self._url, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT),
                application_name="sfguard-pace")
        return self._conn

    async def take(self, limits: Sequence[tuple[str, Limit]], *, force: bool = False) -> Admission:
        rates = sorted(((k, lim) for k, lim in limits if isinstance(lim, Rate)), key=lambda x: x[0])
        if len(rates) != len(limits):
            raise PaceUnavailable("a budget total reached the shared store (it is counted on its host)")
        if not rates:
            return Admission(0.0)
        import psycopg  # noqa: PLC0415
        args = ([k for k, _ in rates], [r.interval for _, r in rates], [r.burst for _, r in rates],
                [r.wait_limit for _, r in rates], force)
        async with self._lock:
            try:
                conn = await asyncio.wait_for(self._connection(), CONNECT_TIMEOUT + 1)
                cur = await asyncio.wait_for(conn.execute(TAKE, args), CALL_TIMEOUT)
                wait, refused, retry, worst = await cur.fetchone()
                self._calls += 1
                if self._calls % SWEEP_EVERY == 0:
                    await conn.execute("DELETE FROM sfguard_pace WHERE updated < %s AND tat < %s",
                                       (time.time() - IDLE_DROP_S, time.time()))
            except (psycopg.Error, OSError, TimeoutError) as exc:
                await self._drop()
                raise PaceUnavailable(f"the shared store {self.shown} did not answer "
                                      f"({type(exc).__name__})") from None
        if refused:
            return Admission(0.0, rates[refused - 1][1], float(retry), due=float(worst))
        return Admission(max(0.0, float(wait)), due=float(worst))

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with swallowed(log, "closing the pace counters' connection"):
                await conn.close()

    async def close(self) -> None:
        await self._drop()
