"""Real Chromium (driven by agent-browser) through the guard proxy, against loopback sites.

site-a.test is allowed; site-b.test is not. Neither a navigation to site-b nor an in-page fetch
or WebSocket from site-a may reach site-b's server (it records every hit).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.browsers import agent_browser

from .conftest import TOKEN_A, write_policy

PAGE_A = """<!doctype html><html><head><title>Site A</title></head><body>
<h1>Site A loaded</h1><p id="fetch">pending</p><p id="ws">pending</p>
<script>
fetch("http://site-b.test:%(b)d/leak?x=1").then(r => r.text())
  .then(t => { document.getElementById("fetch").textContent = "got:" + t; })
  .catch(e => { document.getElementById("fetch").textContent = "blocked"; });
try {
  const ws = new WebSocket("ws://site-b.test:%(b)d/ws");
  ws.onopen = () => { document.getElementById("ws").textContent = "open"; };
  ws.onerror = () => { document.getElementById("ws").textContent = "blocked"; };
} catch (e) { document.getElementById("ws").textContent = "blocked"; }
</script></body></html>"""


class Site:
    """A loopback HTTP server that records the paths it was asked for."""

    def __init__(self, body_fn):
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hits.append(self.path)
                body = body_fn().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Access-Control-Allow-Origin", "*")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.browser
def test_chromium_through_guard_reaches_only_the_allowed_site(proxies, tmp_path, browser_env):
    site_b = Site(lambda: "<title>Site B</title><h1>Site B secret</h1>")
    site_a = Site(lambda: PAGE_A % {"b": site_b.port})
    pol = write_policy(tmp_path / "sites.yaml", private_allow=["127.0.0.1/32"],
                       ports=(80, 443, site_a.port, site_b.port))
    log = tmp_path / "decisions.jsonl"
    guard = proxies(["--allow", "site-a.test", "--policy", str(pol), "--client", f"a:{TOKEN_A}",
                     "--resolve", "site-a.test=127.0.0.1", "--resolve", "site-b.test=127.0.0.1",
                     "--decision-log", str(log)])
    sock_dir = tempfile.mkdtemp(prefix="sfgab-", dir="/tmp")
    config = tmp_path / "ab-config.json"
    config.write_text("{}")
    env = {k: v for k, v in browser_env.items() if k != "SFGUARD_AGENT_BROWSER_BIN"}
    env.update({
        "AGENT_BROWSER_PROXY": f"http://a:{TOKEN_A}@127.0.0.1:{guard.port}",
        "AGENT_BROWSER_PROXY_BYPASS": "<-loopback>",
        "AGENT_BROWSER_SOCKET_DIR": sock_dir,
        "AGENT_BROWSER_SESSION": f"sfg-proxy-{os.getpid()}",
        "AGENT_BROWSER_CONFIG": str(config),
        # the flags every guarded browser gets (no first-run, no background networking, ...)
        "AGENT_BROWSER_ARGS": agent_browser.chrome_args(as_root=os.geteuid() == 0),
    })
    ab = browser_env["SFGUARD_AGENT_BROWSER_BIN"]

    def run(*args, timeout=60):
        return subprocess.run([ab, *args], env=env, capture_output=True, text=True,
                              timeout=timeout)

    def evaluate(js: str) -> str:
        r = run("eval", js)
        return r.stdout.strip().strip('"')

    recorded: list[int] = []  # agent-browser daemon and its Chromium processes

    try:
        r = run("open", f"http://site-a.test:{site_a.port}/")
        assert r.returncode == 0, r.stderr
        pid_file = Path(sock_dir) / f"{env['AGENT_BROWSER_SESSION']}.pid"
        if pid_file.exists():
            daemon = psutil.Process(int(pid_file.read_text().strip()))
            recorded += [daemon.pid] + [c.pid for c in daemon.children(recursive=True)]
        # Chromium may open its own start tab (seen: start.duckduckgo.com, denied by the guard)
        # and agent-browser then follows it: switch back to site A's tab when that happens.
        for _ in range(50):
            title = run("get", "title").stdout.strip()
            if title == "Site A":
                break
            tabs = run("tab", "list").stdout
            m = re.search(r"\[(t?\d+)\][^\n]*site-a\.test", tabs)
            if m:
                run("tab", m.group(1))
            subprocess.run(["sleep", "0.2"], timeout=5)
        assert title == "Site A", (run("tab", "list").stdout, site_a.hits)
        # Give the page's fetch and WebSocket time to settle (bounded polling).
        for _ in range(50):
            states = (evaluate("document.getElementById('fetch').textContent"),
                      evaluate("document.getElementById('ws').textContent"))
            if "pending" not in states:
                break
            subprocess.run(["sleep", "0.2"], timeout=5)
        assert states == ("blocked", "blocked"), states

        r = run("open", f"http://site-b.test:{site_b.port}/")
        text = run("get", "text", "body").stdout
        assert "Site B secret" not in text
        r = run("open", f"https://site-b.test:{site_b.port}/")
        assert "Site B secret" not in run("get", "text", "body").stdout

        assert site_b.hits == []                   # nothing ever reached site-b
        assert site_a.hits and site_a.hits[0] == "/"
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        denied_b = [x for x in lines if x["host"] == "site-b.test" and x["decision"] == "deny"]
        assert denied_b and all(x["client"] == "a" for x in denied_b)
        assert any(x["host"] == "site-a.test" and x["decision"] == "allow" for x in lines)
        assert TOKEN_A not in log.read_text() and TOKEN_A not in guard.stderr()
    finally:
        run("close", timeout=30)
        for pid in recorded:  # whatever `close` left behind, by recorded pid only
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        site_a.close()
        site_b.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
