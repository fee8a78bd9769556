"""Scraping needs no power (issue 45, item 8): with `--metrics-token-file`, the TCP listener
takes a second bearer token that opens GET /metrics and the health probes and nothing else.
Every route the API serves is called with it (403 token_scope everywhere but /metrics and
health), with the full token (never refused for its token), and with none (401, but the probes).
A bad token file stops the start."""
from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import subprocess
import sys

import pytest

from sfguard.supervisor.daemon.api import ROUTES, build_app
from tests.daemon.conftest import ROOT

PARAMS = {"run_id": "r1", "stage_id": "s1", "name": "acct", "approval_id": "ap_" + "0" * 20}


def served_routes() -> list[tuple[str, str]]:
    app = build_app(object())
    return sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})


def call(port: int, method: str, path: str, token: str | None) -> tuple[int, str, str | None]:
    """(status, content type, error code)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        body = None
        if method in ("POST", "PUT"):
            body, headers["Content-Type"] = b"{}", "application/json"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data, ctype = resp.read(), resp.getheader("Content-Type", "")
        is_error = resp.status >= 400 and ctype.startswith("application/json")
        code = json.loads(data)["error"]["code"] if is_error else None
        return resp.status, ctype, code
    finally:
        conn.close()


def test_the_metrics_token_opens_metrics_and_health_only(daemon, tmp_path):
    d = daemon
    d.stop()
    full_file, scrape_file = tmp_path / "token", tmp_path / "scrape.token"
    scrape = secrets.token_hex(32)
    scrape_file.write_text(scrape + "\n")
    scrape_file.chmod(0o640)                      # Prometheus's group may read it
    d.start("--tcp", "0", "--token-file", str(full_file), "--metrics-token-file", str(scrape_file))
    port = int(re.search(r"API on http://127\.0\.0\.1:(\d+) ", d.banner).group(1))
    full = full_file.read_text().strip()
    assert "GET /metrics and the health routes only" in d.banner and scrape not in d.banner

    routes = served_routes()
    assert {(r.method, r.path) for r in ROUTES} | {("GET", "/metrics"), ("GET", "/v1/openapi.json")} == set(routes)
    opened = []
    for method, template in routes:
        path = template.format(**PARAMS)
        with_scrape, with_full, with_none = (call(port, method, path, t) for t in (scrape, full, None))
        assert with_full[2] not in ("unauthorized", "token_scope"), (method, path, with_full)
        if template.startswith("/v1/health/"):
            assert with_scrape[0] == with_none[0] == with_full[0] == 200, (path, with_scrape, with_none)
            opened.append(template)
        elif template == "/metrics":
            assert with_scrape[0] == 200 and with_scrape[1].startswith("text/plain"), with_scrape
            assert with_none[:1] == (401,) and with_full[0] == 200
            opened.append(template)
        else:
            assert (with_scrape[0], with_scrape[2]) == (403, "token_scope"), (method, path, with_scrape)
            assert (with_none[0], with_none[2]) == (401, "unauthorized"), (method, path, with_none)
    assert sorted(opened) == ["/metrics", "/v1/health/live", "/v1/health/ready"]
    # an unknown route wants the full token too
    assert call(port, "GET", "/v1/nothing", scrape)[:1] == (403,)
    assert call(port, "GET", "/v1/nothing", full)[0] == 404
    assert scrape not in d.log.read_text() and full not in d.log.read_text()
    assert d.stop() == 0
    assert scrape_file.read_text().strip() == scrape      # the operator's file: kept as it is


@pytest.mark.parametrize("content,mode,extra,needle", [
    (None, 0o600, ("--tcp", "0"), "cannot read"),
    ("x" * 64, 0o644, ("--tcp", "0"), "readable or writable by others"),
    ("x" * 64, 0o620, ("--tcp", "0"), "readable or writable by others"),
    ("short", 0o600, ("--tcp", "0"), "at least 32 characters"),
    ("x" * 64, 0o600, (), "needs --tcp"),
], ids=["missing", "world-readable", "group-writable", "short", "no-tcp"])
def test_a_bad_metrics_token_file_stops_the_start(tmp_path, content, mode, extra, needle):
    path = tmp_path / "scrape.token"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(tmp_path / "home"),
                           "--metrics-token-file", str(path), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "x" * 32 not in proc.stderr



def test_the_guide_gives_prometheus_the_metrics_token():
    from tests.webhook_receiver import GUIDE
    guide = GUIDE.read_text()
    metrics = guide[guide.index("## 12. Metrics"):guide.index("## 13.")]
    assert "--metrics-token-file /etc/prometheus/sfguard.token" in metrics
    assert "credentials_file: /etc/prometheus/sfguard.token}   # the --metrics-token-file" in metrics
    assert "# the --token-file" not in metrics
