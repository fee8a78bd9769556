"""AddressGuard addon: every server connection goes to the address that was checked.

`ConnectGuard` resolved the host and checked every address with `policy.check_address`; it
remembered the allowed target per client connection. At `server_connect` this addon replaces
the server address with that checked IP, so the socket layer never looks the name up a second
time (no DNS-rebinding window). A destination that was not checked is refused (fail closed).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mitmproxy import addonmanager
from mitmproxy.proxy import server_hooks

from sfguard import policy
from sfguard.proxy_addons.state import GuardState, Target

if TYPE_CHECKING:  # the module is imported after _lean_import.install() by server.py only
    from mitmproxy.addons.proxyserver import Proxyserver

logger = logging.getLogger("sfguard.proxy.address")


class AddressGuard:
    def __init__(self, state: GuardState) -> None:
        self.s = state
        self._proxyserver: Proxyserver | None = None

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.server.error:
            return
        conn = self.s.conns.get(data.client.id)
        server_address = data.server.address
        target: Target | None = None
        if conn is not None and server_address is not None:
            host, port = server_address[0], server_address[1]
            try:
                target = conn.targets.get((policy.normalize_host(host), port))
            except policy.MalformedHost:
                target = None
        if target is None or server_address is None:
            logger.warning("refused a server connection that the guard did not check")
            data.server.error = "sfguard: destination not checked"
            return
        address = (target.address, server_address[1])
        if self._is_own_listener(address):
            logger.warning("refused a server connection to the guard's own listen address")
            data.server.error = "sfguard: destination is the guard itself"
            return
        data.server.address = address

    def load(self, loader: addonmanager.Loader) -> None:
        from mitmproxy import ctx
        self._proxyserver = ctx.master.addons.get("proxyserver")

    def _is_own_listener(self, address: tuple[str, int]) -> bool:
        ps = self._proxyserver
        if ps is None:
            return False
        for listen_host, listen_port, *_ in ps.listen_addrs():
            if listen_port == address[1] and (
                    listen_host in ("", "0.0.0.0", "::") or listen_host == address[0]):
                return True
        return False
