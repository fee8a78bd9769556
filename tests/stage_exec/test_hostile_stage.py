"""The hostile stage of issue 13, with the real tools (Chromium, agent-browser, mitmproxy, the
fixture site): the attacks run from INSIDE `sfguard stage-exec` as the stage would, and again as
a different OS user without stage-exec. Positive controls: inside, agent-browser works through
the gate and an allowed site through the proxy; a forbidden one gets the guard's 403."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

from sfguard.supervisor.browsers import tools
from sfguard.supervisor.home import runtime_path
from sfguard.supervisor.stage.stage_bridge import bridge_root_for
from tests.daemon.conftest import ROOT, Daemon
from tests.daemon.test_real_browser import as_stage
from tests.daemon.test_stage_sessions import pinned_tab, tab_ids
from tests.stage_exec.conftest import STAGE_PYTHON, stage_exec

pytestmark = pytest.mark.browser
HERE = Path(__file__).resolve().parent


@pytest.fixture
def guard(tmp_path, site):
    home = (tmp_path / "home").absolute()
    pol = tmp_path / "sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {site}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / "daemon.log")
    d.start("--policy", str(pol), "--resolve", "site-a.test=127.0.0.1",
            "--resolve", "site-b.test=127.0.0.1")
    yield d
    d.finish()


def hits(port, host):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hits.json", timeout=10) as r:
        rows = json.load(r)["hits"]
    return sum(r["count"] for r in rows if r["host"].split(":")[0] == host)


def request(d, run, sid, profile, allow):
    if d.call("GET", f"/v1/runs/{run}")[0] == 404:
        assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    browser = {"headed": False, "allow_domains": allow}
    if profile:
        browser["profile"] = profile
    status, answer = d.call("POST", f"/v1/runs/{run}/stages",
                            {"stage_id": sid, "attempt": 1, "browser": browser})
    assert status == 200, answer
    return answer["env"]


def guard_pids(d) -> list[int]:
    """Browsers and agent-browser daemons of this guard (its runtime dir in their args)."""
    marks = (str(d.home), str(runtime_path(d.home)))
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(m in " ".join(p.info["cmdline"] or []) for m in marks):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def attack_target(d, ws: Path, site: int, full_scan: bool) -> Path:
    rt = runtime_path(d.home)
    secrets_files = [p for p in rt.rglob("*") if p.name in ("Cookies", "Login Data", "Local State")]
    assert secrets_files, "the run's profile should be unsealed in the runtime folder"
    paths = [str(d.home), str(d.home / "keys"), str(d.home / "runs"), str(d.home / "logs"),
             str(rt), str(bridge_root_for(rt))] + [str(p) for p in secrets_files]
    paths += [str(p) for p in bridge_root_for(rt).iterdir()]
    socks = [str(d.home / "guard.sock")] + [str(p) for p in bridge_root_for(rt).rglob("*.sock")]
    socks += [str(p) for p in rt.rglob("*.sock")]
    target = {"paths": paths, "sockets": socks, "pids": guard_pids(d),
              "direct": [["127.0.0.1", site], ["1.1.1.1", 80]], "full_scan": full_scan}
    path = ws / "target.json"
    path.write_text(json.dumps(target))
    shutil.copy(HERE / "hostile.py", ws / "hostile.py")
    for p in (path, ws / "hostile.py"):
        p.chmod(0o644)
    return path


def test_hostile_stage_inside_stage_exec(guard, site, workspace):
    d = guard
    request(d, "run1", "s1", "acct", ["site-a.test"])
    other = request(d, "run2", "other", None, ["site-b.test"])       # another run, throw-away
    other_token = other["AGENT_BROWSER_CDP"].rsplit("/", 1)[1]
    info = d.call("GET", "/v1/runs/run1/stages/s1/exec")[1]
    bridges = {info["bridges"]["gate_port"], info["bridges"]["proxy_port"]}
    target = attack_target(d, workspace, site, full_scan=True)

    r = stage_exec(d.home, workspace, "run1", "s1", STAGE_PYTHON, "hostile.py", target.name,
                   timeout=300)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    # the only reachable things are its bridges; no DevTools endpoint at all
    assert set(found["open_ports"]) == bridges, found["open_ports"]
    assert set(found["listening"]) == bridges
    assert found["devtools"] == []
    # no guard file, key, run record, unsealed profile or bridge folder is readable
    assert found["files"] and all(v != "READ" for v in found["files"].values()), found["files"]
    assert found["sockets"] and all(v != "CONNECTED" for v in found["sockets"].values()), found["sockets"]
    # no other process is visible: no other run's token, no browser memory
    assert other_token not in r.stdout
    argv0 = {os.path.basename(c.split("\x00")[0]) for c in found["cmdlines"].values()
             if c and not c.startswith("ERR")}
    assert argv0 <= {"bwrap", "sh", "socat", os.path.basename(STAGE_PYTHON)}, argv0
    assert all(v != "OPENED" for v in found["mem"].values())
    assert set(found["direct"].values()) <= {"ConnectionRefusedError", "OSError", "TimeoutError"}, found["direct"]
    assert found["uid"] != 0

    # positive controls: the stage's tools work through its gate and its proxy, and no further
    ab = tools.find_agent_browser().path
    a, b = f"http://site-a.test:{site}", f"http://site-b.test:{site}"
    script = (f"{ab} open {a}/login >/dev/null && {ab} snapshot && {ab} get url && "
              f"curl -sS -o /dev/null -w 'allowed=%{{http_code}}\\n' {a}/ && "
              f"curl -sS -D - -o /dev/null {b}/ && "
              f"{STAGE_PYTHON} -c \"import urllib.request as u; print('py', u.urlopen('{a}/', timeout=20).status)\"")
    r = stage_exec(d.home, workspace, "run1", "s1", "sh", "-c", script, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "Sign in" in r.stdout and f"{a}/login" in r.stdout
    assert "allowed=200" in r.stdout and "py 200" in r.stdout
    assert "403" in r.stdout and "X-Sfguard-Decision: deny; reason=not_allowed" in r.stdout
    assert hits(site, "site-b.test") == 0
    client = info["env"]["HTTP_PROXY"].split("//", 1)[1].split(":", 1)[0]
    log = [json.loads(l) for l in (d.home / "logs" / "decisions.log").read_text().splitlines()]
    assert any(e.get("host") == "site-b.test" and e.get("decision") == "deny"
               and e.get("client") == client for e in log), log[-5:]
    assert any(e.get("host") == "site-a.test" and e.get("decision") == "allow"
               and e.get("client") == client for e in log)
    assert info["env"]["HTTP_PROXY"].split("@")[0] not in (d.home / "logs" / "decisions.log").read_text()

    # a throw-away (profile-less) stage works confined too, held to its own allow_domains
    r = stage_exec(d.home, workspace, "run2", "other", "sh", "-c",
                   f"{ab} open {b}/ >/dev/null && {ab} get url && "
                   f"curl -sS -o /dev/null -w 'b=%{{http_code}} ' {b}/ && "
                   f"curl -sS -o /dev/null -w 'a=%{{http_code}}' {a}/", timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"{b}/" in r.stdout and "b=200" in r.stdout and "a=403" in r.stdout


def _as_other_user(d, workspace, site, full_scan):
    if os.geteuid() != 0:
        pytest.skip("needs root to run the attack as a different OS user")
    env = request(d, "run1", "s1", "acct", ["site-a.test"])
    other = request(d, "run2", "other", None, ["site-b.test"])       # another run, throw-away
    target = attack_target(d, workspace, site, full_scan=full_scan)
    nobody = 65534
    r = subprocess.run([STAGE_PYTHON, str(workspace / "hostile.py"), str(target)],
                       env={"PATH": "/usr/bin:/bin", **env}, cwd=workspace, user=nobody,
                       group=nobody, extra_groups=[], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return other, json.loads(r.stdout)


def test_other_os_user_without_stage_exec_is_held_by_the_uid(guard, site, workspace):
    d = guard
    other, found = _as_other_user(d, workspace, site, full_scan=False)
    assert found["uid"] == 65534
    assert found["files"] and all(v != "READ" for v in found["files"].values()), found["files"]
    assert found["sockets"] and all(v != "CONNECTED" for v in found["sockets"].values()), found["sockets"]
    guard_side = [str(p) for p in guard_pids(d)]
    assert guard_side
    for pid in guard_side:
        assert found["environ"][pid].startswith("ERR"), pid
        assert found["mem"][pid] != "OPENED"
    # another run's gate token is nowhere it could read
    assert other["AGENT_BROWSER_CDP"].rsplit("/", 1)[1] not in json.dumps(found)


def not_foreign(ports: list[int], d) -> list[int]:
    """The ports of `ports` that this guard's processes (the daemon and its descendants) may
    hold, or whose owner is unknown: a DevTools endpoint of some other Chromium on the machine
    (another suite's, a developer's) is not the guard's and would make the test fail for it."""
    guard = psutil.Process(d.proc.pid)
    ours = {guard.pid} | {c.pid for c in guard.children(recursive=True)}
    keep = []
    for port in ports:
        owners = {c.pid for c in psutil.net_connections(kind="tcp")
                  if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
        if not owners or None in owners or owners & ours:
            keep.append(port)
    return keep


def test_other_os_user_finds_no_devtools_endpoint_on_loopback(guard, site, workspace):
    _, found = _as_other_user(guard, workspace, site, full_scan=False)
    assert not_foreign(found["devtools"], guard) == []


def test_stage_exec_works_in_the_stages_own_tab(guard, site, workspace):
    """A daemon started inside is bound to the stage's pinned tab (the exec answer's `tab`): the
    page one stage-exec opened is the page the next one and the stage's session outside see,
    and no tab is made per stage-exec."""
    d = guard
    env = request(d, "run1", "s1", "acct", ["site-a.test"])
    pinned = pinned_tab(env)
    assert d.call("GET", "/v1/runs/run1/stages/s1/exec")[1]["tab"] == pinned
    ab = tools.find_agent_browser().path
    a = f"http://site-a.test:{site}"
    r = stage_exec(d.home, workspace, "run1", "s1", "sh", "-c",
                   f"{ab} open {a}/login >/dev/null && {ab} get url", timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.strip() == f"{a}/login"
    r = stage_exec(d.home, workspace, "run1", "s1", ab, "get", "url", timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, f"{a}/login"), r.stderr
    assert tab_ids(env) == {pinned}
    assert as_stage(env, "get", "url").stdout.strip() == f"{a}/login"

