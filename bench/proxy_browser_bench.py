"""Real-browser page load through the guard proxy vs no proxy (Chromium via agent-browser).

    .venv/bin/python bench/proxy_browser_bench.py [--loads 10]

A page with 30 subresources (10 scripts/images from each of 3 loopback origins; no-store, so
every load fetches everything) is loaded `--loads` times per setup, after one warm-up load.
Reported: median and p90 of the navigation's loadEventEnd (ms), and the ratio guard / direct.
Without a proxy the origins are 127.0.0.1 on three ports; through the guard they are
site-1.test .. site-3.test (resolved with --resolve to 127.0.0.1 and allowed).
"""
from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor import agent_browser, tools  # noqa: E402

TOKEN = "bench-browser-token-0123456789"
GIF = base64.b64decode("R0lGODlhAQABAIAAAAAAAP///ywAAAAAAQABAAACAUwAOw==")


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


def run_loads(env: dict, url: str, loads: int) -> list[float]:
    ab = tools.find_agent_browser().path

    def run(*args):
        return subprocess.run([ab, *args], env=env, capture_output=True, text=True, timeout=60)

    times: list[float] = []
    warmed = False
    try:
        for i in range(3 * loads + 3):  # bounded: a load lost to a tab switch is repeated
            if len(times) >= loads:
                break
            r = run("open", f"{url}?load={i}")
            if r.returncode != 0:
                raise RuntimeError(f"open failed: {r.stderr.strip()[:200]}")
            js = ("(() => { const n = performance.getEntriesByType('navigation')[0];"
                  " return n.loadEventEnd > 0 ? n.loadEventEnd : -1; })()")
            value = -1.0
            for _ in range(50):
                out = run("eval", js).stdout.strip()
                try:
                    value = float(out)
                except ValueError:
                    value = -1.0
                if value > 0:
                    break
                time.sleep(0.1)
            count = run("eval", "window.__n").stdout.strip()
            if count != "15":
                # Chromium may open its own start tab and agent-browser follows it: go back.
                m = re.search(r"\[(t?\d+)\][^\n]*" + re.escape(url.split("//", 1)[1].split("/")[0]),
                              run("tab", "list").stdout)
                if m:
                    run("tab", m.group(1))
                    continue
            if count != "15":
                raise RuntimeError(f"page incomplete: {count} of 15 scripts ran")
            if warmed:  # the first complete load is a warm-up
                times.append(value)
            warmed = True
    finally:
        run("close")
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", type=int, default=10)
    args = ap.parse_args()
    if not (tools.find_agent_browser().found and tools.find_browser().found):
        print("agent-browser or Chromium missing: skipped")
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="sfgbb-", dir="/tmp"))
    (tmp / "cfg.json").write_text("{}")
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

    base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
                "AGENT_BROWSER_EXECUTABLE_PATH": tools.find_browser().path,
                "AGENT_BROWSER_ARGS": agent_browser.chrome_args(as_root=os.geteuid() == 0),
                "AGENT_BROWSER_SOCKET_DIR": str(tmp), "AGENT_BROWSER_CONFIG": str(tmp / "cfg.json")}
    guard = None
    try:
        env = dict(base_env, AGENT_BROWSER_SESSION=f"sfgbb-direct-{os.getpid()}")
        direct = run_loads(env, direct_origins[0] + "/", args.loads)

        policy = tmp / "sites.yaml"
        policy.write_text("version: 1\nmode: enforce\nports: [80, 443, "
                          + ", ".join(map(str, ports)) + "]\nallow_always: []\nblock: []\n"
                          'private_networks:\n  allow: ["127.0.0.1/32"]\n')
        cmd = [sys.executable, "-m", "cli.proxy_cmd", "--policy", str(policy),
               "--allow", ",".join(f"site-{i + 1}.test" for i in range(3)),
               "--client", f"bench:{TOKEN}"]
        for i in range(3):
            cmd += ["--resolve", f"site-{i + 1}.test=127.0.0.1"]
        guard = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
        ready = guard.stdout.readline().split()
        if len(ready) != 2 or ready[0] != "ready":
            raise RuntimeError("guard did not start")
        port = ready[1].rsplit(":", 1)[1]
        origin_state["names"] = True
        env = dict(base_env, AGENT_BROWSER_SESSION=f"sfgbb-guard-{os.getpid()}",
                   AGENT_BROWSER_PROXY=f"http://bench:{TOKEN}@127.0.0.1:{port}",
                   AGENT_BROWSER_PROXY_BYPASS=agent_browser.PROXY_BYPASS)
        guarded = run_loads(env, named_origins[0] + "/", args.loads)
    finally:
        if guard is not None:
            guard.terminate()
            guard.wait(10)
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        shutil.rmtree(tmp, ignore_errors=True)

    def p90(xs):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(len(xs) * 0.9))]

    print(f"\npage with 30 subresources from 3 loopback origins, {args.loads} loads each "
          "(loadEventEnd, ms)\n")
    print(f"{'':8}{'median':>10}{'p90':>10}")
    print(f"{'direct':8}{statistics.median(direct):10.1f}{p90(direct):10.1f}")
    print(f"{'guard':8}{statistics.median(guarded):10.1f}{p90(guarded):10.1f}")
    print(f"\nguard / direct median: {statistics.median(guarded) / statistics.median(direct):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
