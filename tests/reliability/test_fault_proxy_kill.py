"""`kill -9` of a run's proxy child: fail closed, then the guard's watchdog restarts it.

The browser side is played by urllib with the exact proxy URL (credentials included) the guard
gave the run's anchor: the fake agent-browser logs the env it was launched with. The real-browser
version of this case is in test_fault_real_browser.py.
"""
from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import psutil
import pytest

from tests.reliability.conftest import hits, request_stage, wait_for

pytestmark = pytest.mark.reliability


def fetch_via(proxy: str, url: str) -> tuple[int | None, str]:
    """GET url through proxy; (status, "") or (None, error class) when the proxy is unreachable."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy, "https": proxy}))
    try:
        with opener.open(url, timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError) as e:
        return None, type(getattr(e, "reason", e)).__name__


def proxy_record(d, run: str) -> dict:
    rec = json.loads((d.home / "runs" / f"{run}.json").read_text())
    (p,) = [p for p in rec["processes"] if p["kind"] == "proxy"]
    return p


def test_kill9_of_the_run_proxy_fails_closed_and_is_restarted(make_fake_guard, site):
    d = make_fake_guard()
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    assert request_stage(d, "r1", "s1")[0] == 200
    (proxy,) = d.proxy_urls()
    url = f"http://site-a.test:{site}/"
    assert fetch_via(proxy, url)[0] == 200
    assert hits(site, "site-a.test", "/") == 1
    port = d.call("GET", "/v1/runs/r1")[1]["proxy"]["port"]

    rec = proxy_record(d, "r1")
    os.kill(rec["pid"], signal.SIGKILL)
    # while it is down: a connection error, and the server is not reached by any route
    down = [fetch_via(proxy, url) for _ in range(3)]
    assert all(status is None for status, _ in down), down
    assert hits(site, "site-a.test", "/") == 1

    # the watchdog restarts it on the same port with the same clients
    def restarted():
        run = d.call("GET", "/v1/runs/r1")[1]
        return run if run["proxy"]["restarts"] >= 1 and run["proxy"]["alive"] else None
    run = wait_for(restarted, 20, 0.2, "the proxy to be restarted")
    assert run["proxy"]["port"] == port
    # the crash record names the new child (so a later daemon crash still cleans it)
    new = wait_for(lambda: (p := proxy_record(d, "r1"))["pid"] != rec["pid"] and p, 10, 0.1,
                   "the run record to name the new proxy")
    assert psutil.pid_exists(new["pid"])
    assert wait_for(lambda: fetch_via(proxy, url)[0] == 200, 10, 0.2, "requests to pass again")
    assert hits(site, "site-a.test", "/") == 2
    # and it still denies what the run may not reach
    assert fetch_via(proxy, f"http://site-b.test:{site}/")[0] == 403
    assert hits(site, "site-b.test") == 0
    # the run goes on: a new stage, then a clean end
    assert request_stage(d, "r1", "s2")[0] == 200
    st, body = d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})
    assert st == 200 and body["ok"], body
    assert not psutil.pid_exists(new["pid"]) or psutil.Process(new["pid"]).status() == "zombie"
