"""No tab runs in a guarded browser that the guard or a stage did not open.

A page target comes from one of three places: a client of the browser's pipe asked for it
(`Target.createTarget`: the guard's own tabs, a stage's tabs through its gate), a page opened
it (a popup or a new tab: Chromium names its opener), or the browser opened it by itself (a
restored session, start-up pages, an extension). The warden closes the third kind: at start
every page but the one the guard's command line names, and afterwards every page target that
appears with no opener and that no client created (`Target.createTarget` answers may come after
the target's event, so a new page waits until the calls in flight are answered).

The pipe (cdp_pipe.CdpPipe) tells it what it sees; it closes through the pipe. Nothing here
reads a page's contents.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sfguard.cdp_pipe")


class TargetWarden:
    """`creating()` before a createTarget goes out, `created(tid)` / `answered()` when it is
    answered, `appeared(info)` for each target event; `close(tid, why)` is the pipe's close."""

    def __init__(self, close: Callable[[str, str], None]) -> None:
        self._close = close
        self.armed = False                    # from the start tab on
        self.created: set[str] = set()        # pages a client asked for
        self.in_flight = 0                    # createTarget calls not yet answered
        self.unclaimed: dict[str, str] = {}   # page -> its url, waiting for the calls in flight
        self.closed: list[str] = []           # what it closed (the url, for the log and tests)

    def arm(self, keep: str | None) -> None:
        """From now on police new pages; `keep` is the browser's own start tab."""
        if keep is not None:
            self.created.add(keep)
        self.armed = True

    def creating(self) -> None:
        self.in_flight += 1

    def answered(self, target_id: Any) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if isinstance(target_id, str):
            self.created.add(target_id)
            self.unclaimed.pop(target_id, None)
        if self.in_flight == 0:
            for tid, url in list(self.unclaimed.items()):
                self._stray(tid, url)
            self.unclaimed.clear()

    def appeared(self, info: dict) -> None:
        tid = info.get("targetId")
        if not self.armed or info.get("type") != "page" or not isinstance(tid, str) \
                or tid in self.created or info.get("openerId"):
            return
        if self.in_flight:
            self.unclaimed[tid] = str(info.get("url") or "")
        else:
            self._stray(tid, str(info.get("url") or ""))

    def gone(self, target_id: Any) -> None:
        self.unclaimed.pop(target_id, None)
        self.created.discard(target_id)

    def _stray(self, tid: str, url: str) -> None:
        self.closed.append(url)
        log.warning("closed a tab nobody opened (the browser's own: a restored session, a start-up "
                    "page, an extension): %s", scheme_host(url))
        self._close(tid, "a tab no stage or guard opened")


def scheme_host(url: str) -> str:
    """scheme://host of an address for a log line (never its path or query)."""
    head, sep, rest = url.partition("://")
    return f"{head}://{rest.split('/', 1)[0].rsplit('@', 1)[-1]}" if sep else url[:40]
