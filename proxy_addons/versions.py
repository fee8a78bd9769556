"""The mitmproxy and h11 versions the proxy was tested on, and the check that refuses any other.

The proxy's fast paths replace pieces of stock mitmproxy with the guard's own code for speed
(docs/proxy.md, Performance) and reach into names mitmproxy and h11 do not promise to keep
(`FAST_PATHS` lists each one, the private names it touches and the test that guards it). They
were written and tested against exactly the versions in `TESTED`, which requirements.lock and
pyproject.toml pin. On any other installed version a proxy refuses to start, and so does
`sfguard start`; `sfguard doctor` reports it as missing. It fails closed rather than running
stock mitmproxy's layers instead: measured on 11.0.2, those layers differ from the guard's in
what a security appliance must not change silently (request heads after the first and
response heads unbounded, `100 Continue` answered before the decision, a CONNECT served after
plain requests on one connection: docs/proxy.md, "Upgrading mitmproxy or h11").

This module imports nothing of mitmproxy: server.py reads it before mitmproxy is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

#: The versions the proxy was written for and tested on (requirements.lock, pyproject.toml).
TESTED: dict[str, str] = {"mitmproxy": "11.0.2", "h11": "0.14.0"}


@dataclass(frozen=True)
class FastPath:
    name: str
    where: str                      # module(s) of proxy_addons
    private: tuple[str, ...]        # the private names it touches
    test: str                       # the test that guards it


#: Every fast path: what to re-check, and with which test, before moving `TESTED`.
FAST_PATHS: tuple[FastPath, ...] = (
    FastPath("lean mitmproxy.addons import", "_lean_import.py",
             ('a stand-in sys.modules["mitmproxy.addons"] (the package __init__ would load every '
              "default addon)",), "tests/proxy/test_hook_inline.py"),
    FastPath("cached hook dispatch", "dispatch.py",
             ("master.addons.__class__ swapped for a caching AddonManager",
              "hooks.Hook.args replaced (field names read once per hook class)",
              "addonmanager.traverse, addonmanager.safecall, AddonManager.handle_lifecycle"),
             "tests/proxy/test_hook_inline.py"),
    FastPath("inline hooks", "dispatch.py, layers.py (BoundedHttpLayer), plain_http.py",
             ("commands.StartHook.blocking", "events.HookCompleted passed back into a layer",
              "HttpLayer._handle_event"), "tests/proxy/test_hook_inline.py"),
    FastPath("tunnel relay shortcut", "layers.py (BoundedHttpLayer._to_tunnel), layer_guard.py",
             ("TCPLayer._handle_event", "TCPLayer.relay_messages", "Layer._paused"),
             "tests/proxy/test_tunnel_relay.py"),
    FastPath("flat plain-HTTP layer", "plain_http.py (PlainHttpLayer), layer_guard.py",
             ("h11._readers.ChunkedReader, ContentLengthReader, Http10Reader",
              "h11._receivebuffer.ReceiveBuffer"),
             "tests/proxy/test_plain_relay.py, tests/proxy/test_plain_relay_framing.py"),
    FastPath("request-head bounds and checks", "layers.py (BoundedHttpLayer), request_head.py",
             ("mitmproxy.proxy.layers.http._http1.Http1Server (.buf, .state, .read_headers)",
              "HttpLayer.connections", "mitmproxy.net.http.http1.read._read_headers"),
             "tests/proxy/test_request_head.py, tests/proxy/test_smuggling.py"),
)


def installed_versions() -> dict[str, str]:
    """The installed version of each package in `TESTED` ("missing" when not installed)."""
    out = {}
    for name in TESTED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def untested() -> str | None:
    """None when every package is at its tested version; otherwise the one-line refusal."""
    other = [f"{k} {v} (tested: {TESTED[k]})" for k, v in installed_versions().items() if v != TESTED[k]]
    if not other:
        return None
    return ("the proxy runs only on the mitmproxy and h11 versions it was tested on; installed: "
            + ", ".join(other) + ". Install the pinned versions (pip install -r requirements.lock); "
            "docs/proxy.md, 'Upgrading mitmproxy or h11', says what to re-test before moving the pins")


def describe() -> str:
    """For banners and doctor: the installed versions and whether they are the tested ones."""
    return ", ".join(f"{k} {v}" for k, v in installed_versions().items()) + (
        " (tested)" if untested() is None else " (NOT the tested versions)")
