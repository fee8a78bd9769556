"""Faults and load with the real tools: `sfguard start`, headless Chromium, agent-browser,
mitmproxy and the fixture login site. Slow (tens of seconds each): run with `-m slow`."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import psutil
import pytest

from sfguard.supervisor.home import runtime_path
from tests.reliability.conftest import (
    as_stage,
    assert_promises,
    cookies_seen,
    guard_processes,
    hits,
    login_as_stage,
    request_stage,
    wait_for,
)
from tests.reliability.test_load_proxy import record_result

pytestmark = [pytest.mark.reliability, pytest.mark.browser, pytest.mark.slow]


def env_of(d, run, sid):
    st, body = request_stage(d, run, sid)
    assert st == 200, body
    return body["env"]


def chromium_mains(d) -> list[psutil.Process]:
    """Chromium main processes of this guard (not renderers/zygotes: no --type=)."""
    out = []
    for p in guard_processes(d.home):
        try:
            cmd = p.cmdline()
            exe = os.path.basename(cmd[0]).lower()
            if "chrom" in exe and "crashpad" not in exe and not any(a.startswith("--type=") for a in cmd):
                out.append(p)
        except psutil.Error:
            pass
    return out


def test_kill9_daemon_mid_stage_keeps_the_login(real_guard, site):
    d, a = real_guard, f"http://site-a.test:{site}"
    d.call("POST", "/v1/runs", {"run_id": "login"})
    env = env_of(d, "login", "s1")
    login_as_stage(env, a)
    assert d.call("POST", "/v1/runs/login/end", {"outcome": "succeeded"})[1]["ok"]
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    env = env_of(d, "r1", "s1")
    assert "sf_persist" in cookies_seen(env, a)
    d.stop(signal.SIGKILL)
    d.start(*d.start_args)
    assert_promises(d)
    d.call("POST", "/v1/runs", {"run_id": "after"})
    assert "sf_persist" in cookies_seen(env_of(d, "after", "s1"), a)   # the login still works
    d.call("POST", "/v1/runs/after/end", {"outcome": "succeeded"})


def proxy_record(d, run: str) -> dict:
    rec = json.loads((d.home / "runs" / f"{run}.json").read_text())
    (proxy,) = [p for p in rec["processes"] if p["kind"] == "proxy"]
    return proxy


def first_hit(port: int, host: str, path: str) -> float | None:
    """Wall-clock time of the first request for (host, path) at the fixture site, or None."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hits.json", timeout=10) as r:
        rows = json.load(r)["hits"]
    times = [r["first"] for r in rows if r["host"].split(":")[0] == host and r["path"] == path]
    return min(times, default=None)


def test_kill9_proxy_browser_gets_errors_never_a_direct_route(real_guard, site):
    """With the run's proxy killed, the browser's request fails, or (when the guard's restart
    came first, under load) goes through the restarted proxy: nothing reaches the site between
    the kill and the new proxy's start."""
    d, a = real_guard, f"http://site-a.test:{site}"
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    env = env_of(d, "r1", "s1")
    assert as_stage(env, "open", f"{a}/").returncode == 0
    old = proxy_record(d, "r1")
    before = hits(site, "site-a.test", "/account")
    assert before == 0   # so the first /account request is the one after the kill
    os.kill(old["pid"], signal.SIGKILL)
    r = as_stage(env, "open", f"{a}/account", timeout=60)
    url = as_stage(env, "get", "url").stdout.strip()
    wait_for(lambda: d.call("GET", "/v1/runs/r1")[1]["proxy"]["restarts"] >= 1, 30, 0.2, "proxy restart")
    # (the restart is counted before the new process starts; the run record names it after)
    wait_for(lambda: proxy_record(d, "r1")["pid"] != old["pid"], 30, 0.2, "the new proxy in the record")
    new = proxy_record(d, "r1")
    assert new["create_time"] >= old["create_time"]
    if hits(site, "site-a.test", "/account") == before:   # the proxy was still down: an error
        assert r.returncode != 0 or not url.endswith("/account") or "chrome-error" in url, (r.stdout, url)
    else:   # the request came after the restart, so through the new proxy
        at = first_hit(site, "site-a.test", "/account")
        assert at is not None and at >= new["create_time"], "reached the site while the proxy was down"
    ok = wait_for(lambda: as_stage(env, "open", f"{a}/account").returncode == 0
                  and hits(site, "site-a.test", "/account") > before, 30, 1, "browsing to work again")
    assert ok
    d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})


def test_kill9_anchor_chromium_is_restarted_with_the_same_profile(real_guard, site):
    d, a = real_guard, f"http://site-a.test:{site}"
    # log in in an earlier run, so the login is on disk (a SIGKILLed Chromium loses cookies it
    # had not flushed yet: that is Chromium, not the guard)
    d.call("POST", "/v1/runs", {"run_id": "login"})
    login_as_stage(env_of(d, "login", "s1"), a)
    assert d.call("POST", "/v1/runs/login/end", {"outcome": "succeeded"})[1]["ok"]
    d.call("POST", "/v1/runs", {"run_id": "r1"})
    env = env_of(d, "r1", "s1")
    assert "sf_persist" in cookies_seen(env, a)
    mains = chromium_mains(d)
    assert mains, "no anchor Chromium found"
    for p in mains:
        p.kill()
    wait_for(lambda: d.call("GET", "/v1/runs/r1")[1]["browsers"][0]["restarts"] >= 1, 60, 0.5,
             "the anchor to be restarted")
    # GET the stage again until its env works (during the relaunch the stage still answers
    # "ready" with an env that gets 502 from the gate: see docs/reliability.md, finding F5)
    def works():
        b = d.call("GET", "/v1/runs/r1/stages/s1")[1]
        if b.get("state") != "ready":
            return None
        r = as_stage(b["env"], "open", f"{a}/cookies")
        return b["env"] if r.returncode == 0 else None
    new_env = wait_for(works, 90, 1, "the stage env to work again")
    assert "sf_persist" in cookies_seen(new_env, a)      # same profile: still logged in
    assert all(not p.is_running() or p.status() == "zombie" for p in mains)
    d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})


def tree_rss(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss   # shared pages counted once
        except psutil.Error:
            pass
    return total


@pytest.mark.parametrize("n", [10])
def test_concurrent_runs_each_with_an_anchor(real_guard, site, n):
    d, a = real_guard, f"http://site-a.test:{site}"
    base = {p.pid for p in guard_processes(d.home)}
    runs = [f"c{i}" for i in range(n)]
    for r in runs:
        d.call("POST", "/v1/runs", {"run_id": r})
    answers: dict[str, tuple] = {}

    def ask(r):
        answers[r] = request_stage(d, r, "s1", profile=f"p{r}")
    t0 = time.monotonic()
    threads = [threading.Thread(target=ask, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    ready_s = time.monotonic() - t0
    bad = {r: a_ for r, a_ in answers.items() if a_[0] != 200}
    assert len(answers) == n and bad == {}, bad
    for r in runs:
        assert as_stage(answers[r][1]["env"], "open", f"{a}/").returncode == 0
    procs = [p for p in guard_processes(d.home) if p.pid not in base]
    rss = tree_rss({p.pid for p in procs})
    per_run = rss / n / (1024 * 1024)
    for r in runs:
        assert d.call("POST", f"/v1/runs/{r}/end", {"outcome": "succeeded"})[1]["ok"]
    time.sleep(1)
    left = [p for p in procs if p.is_running() and p.status() != "zombie"
            and p.pid not in {c.pid for c in psutil.Process(d.proc.pid).children(recursive=True)}]
    assert left == []
    assert not list((runtime_path(d.home) / "profiles").glob("*/*"))
    record_result(f"anchors_{n}_concurrent", runs=n, ready_seconds=round(ready_s, 1),
                  pss_total_mb=round(rss / 2**20), pss_per_run_mb=round(per_run))
    print(f"\n{n} concurrent anchors ready in {ready_s:.1f}s; PSS {rss / 2**20:.0f} MiB total, "
          f"{per_run:.0f} MiB per run")
