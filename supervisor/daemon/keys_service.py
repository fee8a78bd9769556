"""The guard's keys and what they seal: checked at start, rotated on request.

- `check_keys` (before the start-up sweep, which reseals what a crash left): this host holds
  the store's current key version, else the guard does not start (a shared store's key file
  lacks the version another host rotated to; nothing is sealed with an older one).
- `at_start` (after the sweep): the audit chain verifies and every sealed profile
  authenticates (damage is reported, never reset), and a key rotation a crash interrupted is
  finished (supervisor/profiles/rotation.py).
- `rotate_keys`: `POST /v1/keys/rotate`, what `sfguard keys rotate` asks a running guard for.
  The rotation runs in a thread of its own at a lower CPU priority (ROTATION_NICE), not on the
  store's worker, so runs keep starting at their usual pace; a profile a run holds is resealed
  when the run ends (teardown, through rotation.close_profile).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from sfguard.supervisor.errors import Conflict, Unavailable, swallowed
from sfguard.supervisor.profiles import rotation
from sfguard.supervisor.profiles.key_versions import KeysBusy, KeyStateError
from sfguard.supervisor.profiles.keys import KeyMissing
from sfguard.supervisor.protocols import ProfileError, StoreUnavailable

if TYPE_CHECKING:
    from sfguard.supervisor.profiles.stores import Stores

log = logging.getLogger("sfguard.guard")

#: niceness of the rotation's thread (Linux applies it per thread): background work
ROTATION_NICE = 10


class KeysService:
    """Given the guard's stores (keys, store, lease, audit) and its scope."""

    def __init__(self, *, stores: Stores, scope: str):
        self.stores, self.scope = stores, scope

    def check_keys(self) -> None:
        """KeyMissing when this host has not got the current key version's material."""
        self.stores.keys.get_audit_key(create=False, version=self.stores.keys.current_version())

    def at_start(self, report: dict[str, Any]) -> Any:
        """Damaged state is reported, never silently reset; a rotation under way is finished.
        Returns the audit chain's check (the caller says it: logs and notifies)."""
        audit = self.stores.audit.verify()
        if not audit.ok:
            report["audit"] = str(audit)
        for info in self.stores.store.list(self.scope):
            try:
                self.stores.store.verify(info.key)
            except ProfileError as exc:
                log.error("profile %s: the sealed file is refused (%s); it is kept, and runs "
                          "that ask for it get an error", info.key.name, exc)
                report.setdefault("damaged_profiles", []).append(info.key.name)
        if self.stores.keys.rotation() is not None:
            done = rotation.rotate(self.stores, by="start")
            log.info("the key rotation to version %d was resumed at start: %d profile(s) resealed, "
                     "%s", done["to_version"], len(done["resealed"]),
                     "finished" if done["finished"] else f"{len(done['pending'])} wait for their runs")
            report["keys"] = done
        return audit

    async def _in_thread(self) -> dict[str, Any]:
        """rotation.rotate in a thread of its own (it ends with the rotation, so its lowered
        priority goes with it)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()

        def work() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ROTATION_NICE)
            except OSError as exc:      # not permitted here: it runs at the guard's priority
                log.info("the key rotation runs at the guard's priority (%s)", exc)
            try:
                result = rotation.rotate(self.stores, by="api")
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which decides
                hand(done.set_exception, exc)
            else:
                hand(done.set_result, result)

        def hand(setter: Any, value: Any) -> None:
            with swallowed(log, "answering a key rotation after the guard stopped", (RuntimeError,)):
                loop.call_soon_threadsafe(setter, value)
        threading.Thread(target=work, name="sfguard-key-rotation", daemon=True).start()
        return await done

    async def rotate_keys(self) -> dict[str, Any]:
        """Begin (or resume) a key rotation; answers once every profile at rest is resealed."""
        try:
            answer: dict[str, Any] = await self._in_thread()
        except KeysBusy as exc:
            raise Conflict("keys_busy", str(exc), None) from None
        except StoreUnavailable as exc:
            raise Unavailable("store_unreachable", str(exc), None) from None
        except KeyMissing as exc:
            raise Conflict("key_missing", str(exc), None) from None
        except KeyStateError as exc:
            raise Conflict("key_state", str(exc), None) from None
        return answer
