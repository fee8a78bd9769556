"""Real-browser page load through the guard vs direct, on the guard's own launch path.

    .venv/bin/python bench/proxy_browser_bench.py [--loads 10] [--rounds 3]
    ./dev bench proxy_browser_bench [...]

Both browsers are started the way the daemon starts an anchor: `LocalBrowserHost.launch_anchor`
(Chromium with `--remote-debugging-pipe`, a throw-away profile). The guarded one gets the run
proxy the daemon would start for a run (`sfguard.supervisor.daemon.run_proxy.RunProxy`: `python -m
sfguard.supervisor.daemon.proxy_child`, its client over stdin, decisions to a log file) and answers the proxy's
credential challenge through the pipe (CDP Fetch), exactly as a run's anchor does. The direct
one is the same launch without a proxy (`allow_direct`, for tests and this benchmark only).

A page with 30 subresources (5 scripts and 5 images from each of 3 origins; no-store, so every
load fetches everything) is loaded in a tab of each browser over the pipe (Page.navigate, then
the navigation's loadEventEnd). Direct, the origins are 127.0.0.1 on three ports; through the
guard they are site-1.test .. site-3.test, which the run proxy resolves to 127.0.0.1. Each round
loads `--loads` times in each browser, in turn (after one warm-up load per browser); the ratio
guard / direct of the medians is taken per round and printed as median [min-max].
Target (issue 14): <= 1.15x.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sfguard.supervisor.browsers import tools  # noqa: E402
from sfguard.supervisor.browsers.host import AnchorSpec, LocalBrowserHost  # noqa: E402
from sfguard.supervisor.daemon.run_proxy import RunProxy  # noqa: E402
from sfguard.supervisor.gate.cdp_pipe import FETCH_ENABLE  # noqa: E402

GIF = base64.b64decode("R0lGODlhAQABAIAAAAAAAP///ywAAAAAAQABAAACAUwAOw==")
LOAD_TIMEOUT = 30.0
NAMES = ("direct", "direct-fetch", "guard")


def serve(page_fn) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path.endswith(".gif"):
                body, ctype = GIF, "image/gif"
            elif path.endswith(".js"):
                body, ctype = b"window.__n = (window.__n || 0) + 1;\n", "text/javascript"
            else:
                body, ctype = page_fn().encode(), "text/html; charset=utf-8"
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Cache-Control", "no-store")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def page(origins: list[str]) -> str:
    parts = ["<!doctype html><html><head><title>bench</title>"]
    for o in origins:
        parts += [f'<script src="{o}/s{i}.js"></script>' for i in range(5)]
    parts.append("</head><body>")
    for o in origins:
        parts += [f'<img src="{o}/i{i}.gif">' for i in range(5)]
    parts.append("</body></html>")
    return "".join(parts)




class Tab:
    """One tab of an anchor, driven over the anchor's pipe (as the guard's login check does)."""

    def __init__(self, anchor) -> None:
        self.anchor = anchor

    async def open(self) -> Tab:
        self.cdp = await self.anchor.pipe.session("bench")
        created = await self.cdp.call("Target.createTarget", {"url": "about:blank", "newWindow": True})
        self.target = created["targetId"]
        attached = await self.cdp.call("Target.attachToTarget", {"targetId": self.target, "flatten": True})
        self.session = attached["sessionId"]
        await self.cdp.call("Page.enable", session=self.session)
        await self.cdp.call("Runtime.runIfWaitingForDebugger", session=self.session)
        return self

    async def _eval(self, expression: str):
        res = await self.cdp.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                  session=self.session)
        return (res.get("result") or {}).get("value")

    async def load(self, url: str) -> float:
        """Navigate; return the navigation's loadEventEnd (ms) once all 15 scripts ran."""
        while not self.cdp.events.empty():
            self.cdp.events.get_nowait()
        nav = await self.cdp.call("Page.navigate", {"url": url}, session=self.session)
        if nav.get("errorText"):
            raise RuntimeError(f"{url}: {nav['errorText']}")
        deadline = time.monotonic() + LOAD_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{url}: no load event within {LOAD_TIMEOUT:.0f} s")
            ev = await asyncio.wait_for(self.cdp.events.get(), left)
            if ev.get("sessionId") == self.session and ev.get("method") == "Page.loadEventFired":
                break
        js = ("(() => { const n = performance.getEntriesByType('navigation')[0];"
              " return n && n.loadEventEnd > 0 ? n.loadEventEnd : -1; })()")
        for _ in range(50):
            value = await self._eval(js)
            if isinstance(value, (int, float)) and value > 0:
                break
            await asyncio.sleep(0.02)
        else:
            raise RuntimeError(f"{url}: no loadEventEnd")
        count = await self._eval("window.__n")
        if count != 15:
            raise RuntimeError(f"{url}: page incomplete: {count} of 15 scripts ran")
        return float(value)

    async def close(self) -> None:
        await self.cdp.call("Target.closeTarget", {"targetId": self.target})
        await self.cdp.close()


async def bench(args, tmp: Path, ports: list[int], direct_origins, named_origins, origin_state):
    browser = tools.find_browser().path
    assert browser is not None  # main() checked
    (tmp / "cfg.json").write_text("{}")
    host = LocalBrowserHost()
    policy = tmp / "sites.yaml"
    policy.write_text("version: 1\nmode: enforce\nports: [80, 443, "
                      + ", ".join(map(str, ports)) + "]\nallow_always: []\nblock: []\n"
                      'private_networks:\n  allow: ["127.0.0.1/32"]\n')
    proxy = RunProxy("bench-run", policy, tmp / "decisions.log",
                     {f"site-{i + 1}.test": "127.0.0.1" for i in range(3)})
    anchors = []
    tabs: dict[str, Tab] = {}
    try:
        await proxy.start()
        client = await proxy.add_client([f"site-{i + 1}.test" for i in range(3)])
        for name, proxy_url in (("direct", None), ("direct-fetch", None),
                                ("guard", proxy.url_for(client))):
            anchor = await host.launch_anchor(AnchorSpec(
                session=f"bb-{name}-{os.getpid()}", socket_dir=tmp / "s", config_path=tmp / "cfg.json",
                browser_path=browser, proxy_url=proxy_url, allow_direct=proxy_url is None,
                temp_root=tmp / "w"))
            anchors.append(anchor)
            if name == "direct-fetch":
                # What the pipe turns on for a proxied anchor, without a proxy: the cost of
                # the Fetch domain alone.
                await anchor.pipe.call("Fetch.enable", FETCH_ENABLE)
            tabs[name] = await Tab(anchor).open()
        urls = {"direct": direct_origins[0] + "/", "direct-fetch": direct_origins[0] + "/",
                "guard": named_origins[0] + "/"}
        times: dict[str, list[list[float]]] = {name: [] for name in NAMES}
        seq = 0
        for name in NAMES:  # warm-up: caches, connections, the proxy's credential
            origin_state["names"] = name == "guard"
            seq += 1
            await tabs[name].load(f"{urls[name]}?load={seq}")
        for _ in range(max(1, args.rounds)):
            for name in NAMES:
                origin_state["names"] = name == "guard"
                got = []
                for _ in range(args.loads):
                    seq += 1
                    got.append(await tabs[name].load(f"{urls[name]}?load={seq}"))
                times[name].append(got)
        return times
    finally:
        for tab in tabs.values():
            try:
                await asyncio.wait_for(tab.close(), 10)
            except Exception:
                pass
        for anchor in anchors:
            await host.close_anchor(anchor)
        await proxy.stop()

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", type=int, default=10, help="loads per browser per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not tools.find_browser().found:
        print("Chromium missing: skipped")
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="sfgbb-", dir="/tmp"))
    servers = []
    direct_origins: list[str] = []
    named_origins: list[str] = []
    origin_state = {"names": False}
    ports = []
    for i in range(3):
        srv, port = serve(lambda: page(named_origins if origin_state["names"] else direct_origins))
        servers.append(srv)
        ports.append(port)
        direct_origins.append(f"http://127.0.0.1:{port}")
        named_origins.append(f"http://site-{i + 1}.test:{port}")
    try:
        times = asyncio.run(bench(args, tmp, ports, direct_origins, named_origins, origin_state))
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        shutil.rmtree(tmp, ignore_errors=True)

    def p90(xs):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(len(xs) * 0.9))]

    every = {name: [x for r in rounds for x in r] for name, rounds in times.items()}
    print(f"\npage with 30 subresources from 3 loopback origins; {len(times['direct'])} round(s) of "
          f"{args.loads} loads per browser (loadEventEnd, ms; guard's own launch path)\n")
    print(f"{'':14}{'median':>10}{'p90':>10}{'min':>10}{'max':>10}")
    for name, xs in every.items():
        print(f"{name:14}{statistics.median(xs):10.1f}{p90(xs):10.1f}{min(xs):10.1f}{max(xs):10.1f}")
    print()
    for name in ("direct-fetch", "guard"):
        ratios = sorted(statistics.median(g) / statistics.median(d)
                        for d, g in zip(times["direct"], times[name], strict=True))
        target = " (target <= 1.15)" if name == "guard" else ""
        print(f"{name} / direct, median per round: {statistics.median(ratios):.2f}x "
              f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]{target}; rounds: "
              + ", ".join(f"{r:.2f}" for r in ratios))
    print("direct-fetch = no proxy, with the Fetch interception a guarded anchor has "
          "(the share of the gap that is Fetch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
