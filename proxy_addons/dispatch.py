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

`run_inline(hook)` lets a layer run a hook at once, inside the event that raised it, instead
of yielding it to the connection handler, which runs every hook as an asyncio task and then
passes its completion through the layer stack as a second event. The handlers, their order,
error handling, `AddonHalt`, the `update` hook after a flow hook and an intercepted flow's wait
are those of mitmproxy's `handle_lifecycle`. A handler that must wait (an `async` handler
awaiting something not done yet, e.g. a DNS answer) is left where it stopped, and the rest is
handed back as a coroutine: the layer raises it as `SfguardRestHook`, which the connection
handler runs like any hook (this manager's `trigger_event` awaits it), so the layer resumes
only once every handler finished. Measured per plain-HTTP request (docs/proxy.md, Performance).
Handlers must not depend on running in a task of their own (`asyncio.current_task()`, Python
3.11's `asyncio.timeout`) before their first wait.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, cast

from mitmproxy import addonmanager, exceptions, flow, hooks
from mitmproxy.proxy import commands

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from mitmproxy.master import Master  # imports mitmproxy.addons: see _lean_import

#: A hook handler of an addon (mitmproxy calls each with the hook's arguments).
Handler = Callable[..., Any]
#: What is left of a hook that `run_inline` could not finish at once.
Rest = Coroutine[Any, Any, None]


@dataclasses.dataclass
class SfguardRestHook(commands.StartHook):
    """The rest of a hook that `CachedAddonManager.run_inline` began but that had to wait. A
    layer raises it like any blocking hook; `CachedAddonManager.trigger_event` awaits `rest`."""

    rest: Rest


class _Resumed(Generator[Any, Any, Any]):
    """Awaitable that goes on with a coroutine (`it`, its `__await__` iterator) which already
    yielded `pending` outside any task: awaiting it hands `pending` to the awaiting task, then
    passes every result, and anything thrown in (cancellation), to the coroutine. It is its own
    iterator, which `await` delegates to as `yield from` does (send, throw, close): the
    coroutine's end (StopIteration) is the await's result, and nothing is caught here."""

    def __init__(self, it: Generator[Any, Any, Any], pending: Any) -> None:
        self.it, self.pending, self.handed = it, pending, False

    def __await__(self) -> Generator[Any, Any, Any]:
        return self

    def send(self, value: Any) -> Any:
        if not self.handed:      # the awaiting task's first step: what the coroutine yielded
            self.handed = True
            return self.pending
        return self.it.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        return self.it.throw(typ) if val is None and tb is None else self.it.throw(typ, val, tb)

    def close(self) -> None:
        self.it.close()


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

    def run_inline(self, hook: hooks.Hook) -> Rest | None:
        """Run `hook` now, as `handle_lifecycle` would in a task (see the module docstring).
        None: every handler finished. Otherwise the rest, to be awaited (`SfguardRestHook`)."""
        message = hook.args()[0]
        steps = [hook]
        if isinstance(message, flow.Flow) and self._handlers("update"):
            steps.append(hooks.UpdateHook([message]))
        return self._run_steps(steps, 0, 0, message)

    def _run_steps(self, steps: list[hooks.Hook], i: int, j: int, message: Any) -> Rest | None:
        """Call the handlers of `steps[i:]`, from handler `j` of `steps[i]`, until one waits."""
        while i < len(steps):
            funcs = self._handlers(steps[i].name)
            args = steps[i].args() if j < len(funcs) else []
            while j < len(funcs):
                func = funcs[j]
                j += 1
                try:
                    with addonmanager.safecall():
                        res = func(*args)
                        if res is not None and inspect.isawaitable(res):
                            it = res.__await__()
                            try:
                                pending = it.send(None)
                            except StopIteration:
                                continue
                            return self._finish(steps, i, j, message, it, pending)
                except exceptions.AddonHalt:
                    break
            i, j = i + 1, 0
        if isinstance(message, flow.Flow) and message.intercepted:
            return message.wait_for_resume()
        return None

    async def _finish(self, steps: list[hooks.Hook], i: int, j: int, message: Any,
                      it: Generator[Any, Any, Any], pending: Any) -> None:
        try:
            with addonmanager.safecall():
                await _Resumed(it, pending)
        except exceptions.AddonHalt:
            i, j = i + 1, 0
        rest = self._run_steps(steps, i, j, message)
        if rest is not None:
            await rest

    async def handle_lifecycle(self, event: hooks.Hook) -> None:
        """mitmproxy's, without building the hook's arguments and a coroutine per step for a
        hook no addon handles (a connection's server_connected, server_disconnected, ...)."""
        if not isinstance(event, SfguardRestHook) and self.unhandled(event.name):
            return
        await addonmanager.AddonManager.handle_lifecycle(self, event)

    async def trigger_event(self, event: hooks.Hook) -> None:
        if isinstance(event, SfguardRestHook):
            await event.rest
            return
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
