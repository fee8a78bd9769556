"""The write gate tried from outside, as an attacker and a reviewer would (issue 45): a real
`sfguard start`, real Chromium and agent-browser, a site over HTTP and HTTPS that records what it
receives. Every table below runs its positive control first (the same trigger with writes
allowed reaches the site), then shows that deny refuses and gate holds each of those requests,
whatever spelling of the host, whoever sends it, however many at once, on any attempt."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import ROOT, Daemon
from .test_real_browser import as_stage
from .write_site import WriteSite

pytestmark = pytest.mark.browser

HOSTS = ("wg.test", "ok.test", "pay.wg.test")
#: spellings of the guarded host wg.test (a browser sends each to that host)
SPELLINGS = {
    "plain": "{s}://wg.test:{p}",
    "userinfo": "{s}://user@wg.test:{p}",
    "userpass": "{s}://u:pw@wg.test:{p}",
    "dot": "{s}://wg.test.:{p}",
    "upper": "{s}://WG.TEST:{p}",
}
#: how a page sends a write: fetch, XHR, a form into a frame of its tab, a form into a new tab
SENDERS = ("fetch", "xhr", "form", "nav")
#: a browser never sends these (measured: fetch refuses an address with user info, a TypeError;
#: Chromium blocks a frame's navigation to one); the positive control checks that it does not
NEVER_SENT = {("userinfo", "fetch"), ("userpass", "fetch"), ("userinfo", "form"), ("userpass", "form")}
SEND_JS = """(() => { const send = (kind, url) => { try {
  if (kind === 'fetch') { fetch(url, {method: 'POST', body: 'x=1', mode: 'no-cors', credentials: 'include'})
                          .catch(() => 0); return; }
  if (kind === 'xhr') { const x = new XMLHttpRequest(); x.open('POST', url); x.withCredentials = true;
                        x.send('x=1'); return; }
  const f = document.createElement('form'); f.method = 'post'; f.action = url;
  const i = document.createElement('input'); i.name = 'msg'; i.value = kind; f.appendChild(i);
  if (kind === 'form') { const fr = document.createElement('iframe');
                         fr.name = 'fr' + Math.random().toString(36).slice(2); document.body.appendChild(fr);
                         f.target = fr.name; } else { f.target = '_blank'; }
  document.body.appendChild(f); f.submit(); } catch (e) {} };
  const cases = CASES; setTimeout(() => cases.forEach(c => send(c[0], c[1])), 50); return cases.length; })()"""


def policy_text(site: WriteSite, writes: str = "") -> str:
    return (f"version: 1\nmode: enforce\nports: [80, 443, {site.http_port}, {site.https_port}]\ntab_quota: 60\n"
            f"block: []\nprivate_networks:\n  allow: [127.0.0.1/32]\n" + (f"writes:\n{writes}" if writes else ""))


class Guard:
    """The module's real guard, its site and its live policy file."""

    def __init__(self, d: Daemon, site: WriteSite, policy: Path):
        self.d, self.site, self.policy = d, site, policy
        self.runs = 0

    def set_writes(self, writes: str) -> None:
        """Edit the live policy's writes section; return once the guard has reloaded it."""
        before = self.reloads()
        self.policy.write_text(policy_text(self.site, writes))
        assert until(lambda: self.reloads() > before, 15), "the guard did not reload the policy"

    def reloads(self) -> int:
        log = self.d.home / "audit.log"
        return log.read_text().count('"policy_reloaded"') if log.exists() else 0

    def stage(self, writes: str, allow: list[str], *, run: str | None = None, sid: str = "s1", attempt: int = 1,
              replay_safe: bool = True, profile: str = "acct") -> tuple[str, dict]:
        if run is None:
            self.runs += 1
            run = f"a{self.runs}"
            assert self.d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
        status, answer = self.d.call("POST", f"/v1/runs/{run}/stages", {
            "stage_id": sid, "attempt": attempt, "replay_safe": replay_safe,
            "browser": {"profile": profile, "headed": False, "allow_domains": allow, "writes": writes}})
        assert status == 200, answer
        return run, answer

    def end(self, run: str) -> None:
        assert self.d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[0] == 200

    def pending(self, run: str) -> list[dict]:
        status, body = self.d.call("GET", f"/v1/approvals?run={run}&state=pending")
        assert status == 200, body
        return body["approvals"]

    def decide_all(self, run: str, decision: str = "deny") -> None:
        for ap in self.pending(run):
            assert self.d.call("POST", f"/v1/approvals/{ap['id']}", {"decision": decision})[0] == 200


def until(cond: Callable[[], object], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return bool(cond())


def settled(count: Callable[[], int], quiet: float = 2.0, bound: float = 25.0) -> int:
    """The count once it has not changed for `quiet` seconds (bounded)."""
    deadline, last, since = time.monotonic() + bound, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(0.2)
    return last


def run_js(env: dict, script: str) -> str:
    done = as_stage(env, "eval", script)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@pytest.fixture(scope="module")
def g(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wga")
    site = WriteSite(tmp, HOSTS)
    policy = tmp / "sites.yaml"
    policy.write_text(policy_text(site))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    d = Daemon((tmp / "home").absolute(), env, tmp / "daemon.log")
    d.start("--policy", str(policy), "--ca-file", str(site.ca_file), "--write-gate-timeout", "120",
            *[a for h in HOSTS for a in ("--resolve", f"{h}=127.0.0.1")])
    yield Guard(d, site, policy)
    d.finish()
    site.close()


@pytest.fixture(autouse=True)
def runs_end(g):
    """Each test's runs end with it, passed or failed (a run left active keeps the profile)."""
    yield
    status, st = g.d.call("GET", "/v1/status")
    for run in st.get("runs", []) if status == 200 else []:
        if run.get("state") == "active":
            g.end(run["run_id"])
    if g.policy.read_text() != policy_text(g.site):
        g.set_writes("")


def cases(scheme: str, port: int, batch: str) -> list[tuple[str, str]]:
    """[(sender, address)] for every spelling and sender, each to a path of its own."""
    return [(kind, SPELLINGS[sp].format(s=scheme, p=port) + f"/w/{batch}/{sp}/{kind}")
            for sp in SPELLINGS for kind in SENDERS]


def reached(g: Guard, batch: str) -> set[tuple[str, str]]:
    return {(p.split("/")[3], p.split("/")[4].split("?")[0]) for p in g.site.paths(f"/w/{batch}/")}


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_every_spelling_of_a_host_is_refused_in_deny_and_held_in_gate(g, scheme):
    port = g.site.port(scheme)
    page = f"{scheme}://wg.test:{port}/page"
    expected = {(sp, kind) for sp in SPELLINGS for kind in SENDERS} - NEVER_SENT
    results = {}
    for mode in ("allow", "deny", "gate"):
        batch = f"sp-{scheme}-{mode}"
        run, answer = g.stage(mode, ["wg.test", "ok.test"])
        env = answer["env"]
        assert as_stage(env, "open", page).returncode == 0
        run_js(env, SEND_JS.replace("CASES", json.dumps(cases(scheme, port, batch))))
        if mode == "allow":       # the positive control: every way a browser sends it arrives
            settled(lambda batch=batch: len(g.site.paths(f"/w/{batch}/")))
            results[mode] = reached(g, batch)
            assert results[mode] == expected, sorted(expected ^ results[mode])
        elif mode == "deny":
            time.sleep(4)
            results[mode] = reached(g, batch)
            assert results[mode] == set()
        else:
            # one approval per request held, whatever the spelling; the site sees none of them
            assert until(lambda run=run: len(g.pending(run)) >= len(expected)), len(g.pending(run))
            time.sleep(1.5)
            held = g.pending(run)
            assert sorted((a["path"].split("/")[3], a["path"].split("/")[4]) for a in held) == sorted(expected)
            assert {a["host"] for a in held} == {"wg.test"} and {a["port"] for a in held} == {port}
            assert reached(g, batch) == set()
            g.decide_all(run, "deny")
            time.sleep(1.5)
            assert reached(g, batch) == set()
        g.end(run)


FLOORS = [
    # (the writes section, the stage's writes and allow_domains, the host written to, what must
    # happen to its POSTs). A floor's own spelling is what the gate must catch: the stage allows
    # the wider *.wg.test, and the floor names pay.wg.test inside it.
    ('  - pattern: "PAY.WG.TEST"\n    mode: deny\n    reason: "upper case"\n', "allow", ["*.wg.test"],
     "pay.wg.test", "refused"),
    ('  - pattern: "pay.wg.test."\n    mode: deny\n    reason: "trailing dot"\n', "allow", ["*.wg.test"],
     "pay.wg.test", "refused"),
    ('  - patterns: ["*.Pay.WG.Test."]\n    mode: gate\n    reason: "wildcard, odd spelling"\n', "allow",
     ["*.wg.test"], "pay.wg.test", "held"),
    ("", "deny", ["WG.TEST:{p}"], "wg.test", "refused"),
    ("", "gate", ["wg.test.", "OK.test"], "wg.test", "held"),
    ("", "allow", ["WG.TEST."], "wg.test", "reached"),     # the positive controls
    ('  - pattern: "PAY.WG.TEST"\n    mode: allow\n    reason: "upper case"\n', "allow", ["*.wg.test"],
     "pay.wg.test", "reached"),
]


@pytest.mark.parametrize("writes, mode, allow, host, what", FLOORS)
def test_floors_and_allow_domains_in_any_spelling_are_kept(g, writes, mode, allow, host, what):
    g.set_writes(writes)
    port = g.site.http_port
    allow = [a.format(p=port) for a in allow]
    run, answer = g.stage(mode, allow)
    # the stage answer names the canonical patterns, with the mode the gate enforces
    assert all(k == k.lower() and not k.split(":")[0].endswith(".") for k in answer["writes"]), answer["writes"]
    env = answer["env"]
    batch = f"fl-{len(g.site.got)}"
    assert as_stage(env, "open", f"http://{host}:{port}/page").returncode == 0
    run_js(env, SEND_JS.replace("CASES", json.dumps([("fetch", f"http://{host}:{port}/w/{batch}/x/fetch"),
                                                     ("form", f"http://{host}:{port}/w/{batch}/x/form")])))
    if what == "reached":
        assert until(lambda: len(g.site.paths(f"/w/{batch}/")) == 2)
    elif what == "held":
        assert until(lambda: len(g.pending(run)) == 2)
        assert g.site.paths(f"/w/{batch}/") == []
        g.decide_all(run)
    else:
        time.sleep(3)
        assert g.site.paths(f"/w/{batch}/") == [] and g.pending(run) == []
    g.end(run)


def screenshot(d: Daemon, approval: str) -> tuple[int, bytes]:
    """GET /v1/approvals/ID/screenshot over the control socket: (status, body)."""
    import http.client
    import socket as socketlib

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            self.sock.settimeout(30)
            self.sock.connect(str(d.home / "guard.sock"))
    conn = Conn("localhost")
    try:
        conn.request("GET", f"/v1/approvals/{approval}/screenshot")
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def test_a_write_follows_its_host_whichever_stage_of_the_browser_sends_it(g):
    """Two stages share the profile's browser: `poster` may write on its own site only (allow,
    ok.test), `payer` gates wg.test. A write from poster's tab to wg.test (fetch, a form in a
    frame, a form into a new tab) is held, labelled with poster, its tab pictured; with payer
    allowing wg.test (the positive control) the same writes arrive."""
    port = g.site.http_port
    for payer_mode in ("allow", "gate"):
        run, answer = g.stage("allow", ["ok.test"], sid="poster")
        g.stage(payer_mode, ["wg.test"], run=run, sid="payer")
        env = answer["env"]
        batch = f"sh-{payer_mode}"
        assert as_stage(env, "open", f"http://ok.test:{port}/page").returncode == 0
        sends = [(k, f"http://wg.test:{port}/w/{batch}/x/{k}") for k in SENDERS]
        run_js(env, SEND_JS.replace("CASES", json.dumps(sends)))
        if payer_mode == "allow":
            assert until(lambda batch=batch: len(g.site.paths(f"/w/{batch}/")) == len(SENDERS))
        else:
            assert until(lambda run=run: len(g.pending(run)) == len(SENDERS))
            time.sleep(1.0)
            held = g.pending(run)
            assert g.site.paths(f"/w/{batch}/") == []
            assert {a["stage_id"] for a in held} == {"poster"} and {a["why"] for a in held} == {"stage_mode"}
            for a in held:       # the tab that sent it (or opened the new tab) is pictured
                status, png = screenshot(g.d, a["id"])
                assert status == 200 and png.startswith(b"\x89PNG"), (a["path"], status)
            g.decide_all(run, "deny")
            time.sleep(1.0)
            assert g.site.paths(f"/w/{batch}/") == []
        g.end(run)


def test_one_approval_releases_one_request_and_shows_what_changes_its_meaning(g):
    """Five identical POSTs at once are five approvals; approving one sends one. A POST with an
    X-HTTP-Method-Override header is its own approval, which shows that header."""
    port = g.site.http_port
    run, answer = g.stage("gate", ["wg.test"])
    env = answer["env"]
    assert as_stage(env, "open", f"http://wg.test:{port}/page").returncode == 0
    run_js(env, "setTimeout(() => { for (let i = 0; i < 5; i++) fetch('/w/many/same', {method: 'POST', "
                "body: 'a=1'}).catch(() => 0); fetch('/w/many/same', {method: 'POST', body: 'a=1', "
                "headers: {'X-HTTP-Method-Override': 'DELETE'}}).catch(() => 0); }, 50); 1")
    assert until(lambda: len(g.pending(run)) == 6), g.pending(run)
    held = g.pending(run)
    overridden = [a for a in held if ["X-HTTP-Method-Override", "DELETE"] in a["headers"]]
    plain = [a for a in held if a not in overridden]
    assert len(overridden) == 1 and len(plain) == 5
    assert all(a["body_text"] == "a=1" or a["form"] == [["a", "1"]] for a in held)
    assert g.d.call("POST", f"/v1/approvals/{plain[0]['id']}", {"decision": "approve"})[0] == 200
    assert until(lambda: len(g.site.paths("/w/many/")) == 1)
    time.sleep(1.5)
    assert len(g.site.paths("/w/many/")) == 1 and len(g.pending(run)) == 5      # exactly one sent
    got = [x for x in g.site.got if x.path.startswith("/w/many/")]
    assert got[0].override == "" and "sid=logged-in" in got[0].cookie
    assert g.d.call("POST", f"/v1/approvals/{overridden[0]['id']}", {"decision": "approve"})[0] == 200
    assert until(lambda: len(g.site.paths("/w/many/")) == 2)
    time.sleep(1.0)
    assert [x.override for x in g.site.got if x.path.startswith("/w/many/")] == ["", "DELETE"]
    g.decide_all(run)
    time.sleep(1.0)
    assert len(g.site.paths("/w/many/")) == 2
    g.end(run)


RETRIES = [
    # (writes section, attempt 1's mode and host it writes to, attempt 2's mode, what attempt 2's
    # write to wg.test meets): attempt 1 always sends a write, so attempt 2 is a retry of a stage
    # that wrote; the last row is the control (a retry holds what it would have allowed)
    ("", "allow", "wg.test", "deny", "refused"),
    ('  - pattern: "wg.test"\n    mode: deny\n    reason: "a floor"\n', "allow", "ok.test", "allow", "refused"),
    ("", "allow", "wg.test", "allow", "held"),
]


@pytest.mark.parametrize("writes, first_mode, first_host, second_mode, second", RETRIES)
def test_a_retry_never_loosens_a_deny(g, writes, first_mode, first_host, second_mode, second):
    g.set_writes(writes)
    port = g.site.http_port
    batch = f"rt-{len(g.site.got)}"
    run, answer = g.stage(first_mode, ["wg.test", "ok.test"], sid="pay", replay_safe=False)
    assert as_stage(answer["env"], "open", f"http://{first_host}:{port}/page").returncode == 0
    run_js(answer["env"], f"setTimeout(() => fetch('/w/{batch}/1', {{method: 'POST', body: 'n=1'}}), 50); 1")
    assert until(lambda: len(g.site.paths(f"/w/{batch}/")) == 1)       # attempt 1 wrote
    assert g.d.call("POST", f"/v1/runs/{run}/stages/pay/end", {"outcome": "failed"})[0] == 200
    _, answer = g.stage(second_mode, ["wg.test", "ok.test"], run=run, sid="pay", attempt=2, replay_safe=False)
    assert as_stage(answer["env"], "open", f"http://wg.test:{port}/page").returncode == 0
    run_js(answer["env"], f"setTimeout(() => fetch('/w/{batch}/2', {{method: 'POST', body: 'n=2'}}), 50); 1")
    if second == "held":
        assert until(lambda: len(g.pending(run)) == 1)
        assert g.pending(run)[0]["why"] == "replay_unsafe_retry"
        g.decide_all(run)
    else:
        time.sleep(3)
        assert g.pending(run) == [] and g.site.paths(f"/w/{batch}/") == [f"/w/{batch}/1"]
        lines = [json.loads(x) for x in (g.d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
        assert any(x.get("run") == run and x.get("attempt") == 2 and x["decision"] == "write_refused"
                   for x in lines)
    g.end(run)


def test_the_person_sees_the_payload_and_never_its_secrets(g):
    """A login form's approval: its password input (type=password, any name), pw, mfa and
    credentials are masked; shipping_address and author are readable. Nothing secret reaches
    the decision log, the audit chain, the approvals record or the guard's log."""
    port = g.site.http_port
    run, answer = g.stage("gate", ["wg.test"])
    env = answer["env"]
    assert as_stage(env, "open", f"http://wg.test:{port}/page").returncode == 0
    run_js(env, "setTimeout(() => document.forms.login.submit(), 50); 1")
    assert until(lambda: len(g.pending(run)) == 1)
    ap = g.pending(run)[0]
    form = dict(ap["form"])
    assert form == {"user": "op", "f_secret": "********", "pw": "********", "mfa": "********",
                    "credentials": "********", "shipping_address": "1 Main St", "author": "ann"}
    status, png = screenshot(g.d, ap["id"])
    assert status == 200 and png.startswith(b"\x89PNG")
    assert g.d.call("POST", f"/v1/approvals/{ap['id']}", {"decision": "deny", "reason": "not this one"})[0] == 200
    g.end(run)
    seen = "".join(p.read_text(errors="replace") for p in (g.d.home / "logs" / "decisions.log",
                                                            g.d.home / "audit.log", g.d.log,
                                                            g.d.home / "approvals" / "decided.jsonl"))
    for secret in ("hunter2-pw", "pw-value-1", "mfa-424242", "cred-9"):
        assert secret not in seen, secret


LISTED = ('  - pattern: "wg.test"\n    mode: deny\n    reason: "signing out is a write"\n'
          '    writes:\n      - "GET /logout"\n      - request: "GET /admin/wipe"\n        ignore_case: true\n')
#: (path an <img> asks for, whether the write gate refuses it)
LISTED_PATHS = [
    ("/logout", True), ("/%6cogout", True), ("/%6Cogout", True), ("/logout/", True), ("/logout;x", True),
    ("/.//logout", True), ("/x/../logout", True), ("/./logout", True), ("/logout?next=/", True),
    ("/Admin/WIPE", True), ("/admin/wipe/", True), ("/ADMIN/%77ipe", True),
    # the controls: reads on the same host arrive
    ("/logoutx", False), ("/Logout", False), ("/read.gif", False), ("/admin/wiped", False),
]


def test_listed_gets_match_what_the_server_sees(g):
    """A GET the site policy names a write is caught in every spelling a server routes to it
    (percent-escapes of unreserved characters, dot segments, duplicate and trailing slashes,
    `;params`; any case where the pattern says `ignore_case`), from an <img> whose type the gate
    otherwise lets pass; the controls show reads on the same host still arrive."""
    g.set_writes(LISTED)
    port = g.site.http_port
    run, answer = g.stage("allow", ["wg.test"])
    assert as_stage(answer["env"], "open", f"http://wg.test:{port}/page").returncode == 0
    start = len(g.site.got)
    for n, (path, refused) in enumerate(LISTED_PATHS):
        before = len([x for x in g.site.got if x.method == "GET"])
        src = path + ("&" if "?" in path else "?") + f"n={n}"       # each its own address (no cache)
        run_js(answer["env"], f"setTimeout(() => {{ const i = new Image(); i.src = {json.dumps(src)}; "
                              f"document.body.appendChild(i); }}, 10); 1")
        if refused:
            time.sleep(1.2)
        else:
            assert until(lambda before=before: len([x for x in g.site.got if x.method == "GET"]) > before, 10), path
        got = [x.path.split("?n=")[0].split("&n=")[0] for x in g.site.got[-5:] if x.method == "GET"]
        assert (path in got) is (not refused), (path, got)
    # whatever the browser made of each spelling, no request the server routes to a listed GET arrived
    from sfguard.policy.writes import server_path
    routed = {server_path(x.path.split("?")[0]) for x in g.site.got[start:]}
    assert "/logout" not in routed and "/admin/wipe" not in {r.lower() for r in routed}, routed
    lines = [json.loads(x) for x in (g.d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    mine = [x for x in lines if x.get("run") == run and x.get("decision") == "write_refused"]
    assert {x["reason"] for x in mine} == {"site_write_get"} and all("rule" in x and x["rule"] for x in mine)
    assert len(mine) == sum(1 for _, r in LISTED_PATHS if r), [x["path"] for x in mine]
    g.end(run)
    g.set_writes("")


def test_every_approval_from_a_page_has_its_picture(g):
    """Writes from a frame of the stage's tab (same site, and another site's frame), a popup
    and an <a ping>: each held, attributed to the stage whose tab sent it, and pictured."""
    port = g.site.http_port
    run, answer = g.stage("gate", ["wg.test", "ok.test"], sid="st")
    env = answer["env"]
    assert as_stage(env, "open", f"http://ok.test:{port}/page").returncode == 0
    run_js(env, f"setTimeout(() => {{ const fr = document.createElement('iframe'); "
                f"fr.src = 'http://wg.test:{port}/frame?cross'; document.body.appendChild(fr); "
                f"fr.onload = () => fr.contentWindow.postMessage('go', '*'); "
                f"frames.inner.document.forms.f.submit(); window.open('/frame', 'popwin'); "
                f"setTimeout(() => {{ const f = document.createElement('form'); f.method = 'post'; "
                f"f.action = '/w/pic/popup'; f.target = 'popwin'; document.body.appendChild(f); f.submit(); }}, 400); "
                f"document.getElementById('ping').click(); }}, 50); 1")
    assert until(lambda: len(g.pending(run)) == 4), g.pending(run)
    held = {a["path"]: a for a in g.pending(run)}
    assert set(held) == {"/w/iframe/cross", "/w/iframe/form", "/w/pic/popup", "/w/ping/ping"}
    assert held["/w/iframe/cross"]["host"] == "wg.test" and held["/w/iframe/form"]["host"] == "ok.test"
    for a in held.values():
        assert a["stage_id"] == "st", a
        status, png = screenshot(g.d, a["id"])
        assert status == 200 and png.startswith(b"\x89PNG"), (a["path"], status)
    g.decide_all(run)
    g.end(run)


def test_decisions_and_approvals_are_records_that_outlive_the_guard(g):
    """Every write decision line names run, stage, attempt, method, host, port, path (query
    hidden), reason and, for a held one, its approval; the audit chain keeps what was held, why,
    who decided (the OS user of the CLI) and their reason; after a restart `approvals list
    --all` and `show` still know it, and one pending at the stop ends cancelled."""
    port = g.site.http_port
    run, answer = g.stage("gate", ["wg.test"], sid="rec")
    env = answer["env"]
    assert as_stage(env, "open", f"http://wg.test:{port}/page").returncode == 0
    run_js(env, "setTimeout(() => { fetch('/w/rec/a?token=s3cr3t-q', {method: 'POST', body: 'k=v'}); "
                "fetch('/w/rec/b', {method: 'PUT', body: 'k=w'}); }, 50); 1")
    assert until(lambda: len(g.pending(run)) == 2)
    first = next(a for a in g.pending(run) if a["path"] == "/w/rec/a")
    assert first["url"].endswith("/w/rec/a?token=s3cr3t-q")            # the approver sees the query
    cli = [sys.executable, "-m", "sfguard.cli.main"]
    done = subprocess.run([*cli, "approvals", "approve", first["id"], "--reason", "checked by hand",
                           "--home", str(g.d.home)], cwd=ROOT, env=g.d.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert until(lambda: "/w/rec/a?token=s3cr3t-q" in g.site.paths("/w/rec/"))
    lines = [json.loads(x) for x in (g.d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    mine = [x for x in lines if x.get("run") == run and str(x.get("decision")).startswith("write_")]
    held_line = next(x for x in mine if x["decision"] == "write_held" and x["path"].startswith("/w/rec/a"))
    assert (held_line["stage"], held_line["attempt"], held_line["method"], held_line["host"], held_line["port"],
            held_line["path"], held_line["reason"]) == ("rec", 1, "POST", "wg.test", port, "/w/rec/a?...", "stage_mode")
    assert held_line["approval"] == first["id"]
    assert any(x["decision"] == "write_approved" and x.get("approval") == first["id"] for x in mine)
    audit = subprocess.run([*cli, "audit", "show", "--run", run, "--json", "--home", str(g.d.home)], cwd=ROOT,
                           env=g.d.env, capture_output=True, text=True, timeout=60)
    recs = [json.loads(x) for x in audit.stdout.splitlines() if x.strip().startswith("{")]
    approved = next(r for r in recs if r["event"] == "write_approved")["fields"]
    import pwd
    assert approved["by"] == f"user:{pwd.getpwuid(os.getuid()).pw_name}" and approved["note"] == "checked by hand"
    assert approved["url"] == f"http://wg.test:{port}/w/rec/a?token=..." and approved["why"] == "stage_mode"
    # a restart: the decided approval is still listed and shown; the pending one ended cancelled
    second = next(a for a in g.pending(run) if a["path"] == "/w/rec/b")
    g.d.stop()
    g.d.start(*g.d.last_args)
    listed = subprocess.run([*cli, "approvals", "list", "--all", "--json", "--home", str(g.d.home)], cwd=ROOT,
                            env=g.d.env, capture_output=True, text=True, timeout=60)
    states = {a["id"]: a["state"] for a in json.loads(listed.stdout)["approvals"]}
    assert states[first["id"]] == "approved" and states[second["id"]] == "cancelled"
    shown = subprocess.run([*cli, "approvals", "show", first["id"], "--home", str(g.d.home)], cwd=ROOT,
                           env=g.d.env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "checked by hand" in shown.stdout and "s3cr3t-q" not in shown.stdout
    for path in (g.d.home / "logs" / "decisions.log", g.d.home / "audit.log", g.d.home / "approvals" / "decided.jsonl"):
        assert "s3cr3t-q" not in path.read_text(), path
