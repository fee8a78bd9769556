"""Hook dispatch without mitmproxy's per-event walk over every addon.

mitmproxy's `AddonManager.trigger_event` visits every addon of the chain for every event (a
tunnel raises about a dozen: client_connected, next_layer, http_connect, server_connect, tcp_*,
update, ...), and for each one enters a context manager, creates a coroutine and looks the
hook up by name, whether or not the addon has it. Profiling the guard (cProfile, 2,000 CONNECT
tunnels) put that walk at about a tenth of the proxy's CPU time.

`install(master)` makes the master's addon manager keep, per hook name, the list of handlers
that exist (in chain order, children included, as `traverse` yields them) and call only those,
with the hook's arguments built once. Behaviour is the same: errors of one handler are logged
and the next one still runs (`safecall`), `AddonHalt` stops the event, awaitables are awaited.
The cache is dropped whenever an addon is added or removed. `Hook.args` (called for every
hook, also by mitmproxy's own lifecycle code) reads the field names of each hook class once.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from mitmproxy import addonmanager, exceptions, hooks

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from mitmproxy.master import Master  # imports mitmproxy.addons: see _lean_import

#: A hook handler of an addon (mitmproxy calls each with the hook's arguments).
Handler = Callable[..., Any]


class CachedAddonManager(addonmanager.AddonManager):
    _hook_cache: dict[str, list[Handler]]

    def _handlers(self, name: str) -> list[Handler]:
        cache: dict[str, list[Handler]] = self.__dict__.setdefault("_hook_cache", {})
        found = cache.get(name)
        if found is None:
            found = []
            for a in addonmanager.traverse(self.chain):
                func = getattr(a, name, None)
                if func and callable(func) and not isinstance(func, types.ModuleType):
                    found.append(func)
            cache[name] = found
        return found

    def unhandled(self, name: str) -> bool:
        """True when no addon handles hook `name` and none handles `update` (which mitmproxy
        raises after every flow hook): completing such a hook at once changes nothing."""
        return not self._handlers(name) and not self._handlers("update")

    async def trigger_event(self, event: hooks.Hook) -> None:
        funcs = self._handlers(event.name)
        if not funcs:
            return
        args = event.args()
        for func in funcs:
            try:
                with addonmanager.safecall():
                    res = func(*args)
                    if res is not None and inspect.isawaitable(res):
                        await res
            except exceptions.AddonHalt:
                return

    # The base class named, not super(): mypy's untyped_calls_exclude (pyproject) does not reach
    # calls through super().
    def register(self, addon: Any) -> Any:
        self.__dict__.pop("_hook_cache", None)
        return addonmanager.AddonManager.register(self, addon)

    def add(self, *addons: Any) -> None:
        self.__dict__.pop("_hook_cache", None)
        addonmanager.AddonManager.add(self, *addons)

    def remove(self, addon: Any) -> None:
        self.__dict__.pop("_hook_cache", None)
        addonmanager.AddonManager.remove(self, addon)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _hook_args(self: hooks.Hook) -> list[Any]:
    """`Hook.args` with the field names looked up once per hook class (mitmproxy's version
    calls `dataclasses.fields` on every call: several times per event)."""
    names = _FIELD_NAMES.get(type(self))
    if names is None:
        fields = dataclasses.fields(cast("DataclassInstance", self))  # every Hook is a dataclass
        names = _FIELD_NAMES[type(self)] = tuple(f.name for f in fields)
    return [getattr(self, n) for n in names]


def install(master: Master) -> None:
    """Switch `master.addons` to the cached dispatch (before addons are added), and build hook
    arguments from cached field names (same list, same order)."""
    if type(master.addons) is addonmanager.AddonManager:
        master.addons.__class__ = CachedAddonManager
    if hooks.Hook.args is not _hook_args:
        # replacing the method on purpose (same result, see _hook_args)
        hooks.Hook.args = _hook_args  # type: ignore[method-assign]
