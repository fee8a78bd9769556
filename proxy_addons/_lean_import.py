"""Import mitmproxy's addon modules without mitmproxy's full default addon set.

`import mitmproxy.addons.proxyserver` first runs `mitmproxy/addons/__init__.py`, which imports
every default addon (flask, ldap3, passlib, ...): about 0.5 s and 15 MB the guard never uses.
`install()` registers a stand-in package object with the same search path, so submodules load
on their own. Any other use of the package (`mitmproxy.addons.default_addons`, ...) runs the
real `__init__` on first access, so nothing else breaks. Call it before importing mitmproxy.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


def install() -> None:
    if "mitmproxy.addons" in sys.modules:
        return
    spec = importlib.util.find_spec("mitmproxy.addons")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    pkg = types.ModuleType("mitmproxy.addons")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    pkg.__package__ = "mitmproxy.addons"
    pkg.__file__ = spec.origin
    loader = spec.loader
    state = {"loaded": False}

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"mitmproxy.addons.{name}") is not None:
            return importlib.import_module(f"mitmproxy.addons.{name}")  # a submodule
        if state["loaded"]:
            raise AttributeError(name)
        state["loaded"] = True
        loader.exec_module(pkg)  # the real __init__, on first foreign use
        return getattr(pkg, name)

    pkg.__dict__["__getattr__"] = __getattr__  # a module's __getattr__ (PEP 562)
    sys.modules["mitmproxy.addons"] = pkg
