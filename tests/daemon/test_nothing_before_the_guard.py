"""Nothing runs before the guard (issue 52): a profile that carries a saved session whose tab
POSTs, opens a WebSocket and keeps sending ("continue where you left off"), start-up pages
pointing at that tab, and an unpacked extension (developer mode on) whose worker POSTs when it
starts. The positive control starts a plain Chromium on a copy of that profile: the site
receives the hostile requests. Then the guard's run on it, its stage with `writes: deny`: the site receives
nothing from that profile at any time, the browser has no tab but its stage's (the run's
answer, read from the guard's pipe), the guard says what the profile carried, and the stage
browses as usual. Once more with the machine's two cores kept busy while the browser starts, and
once with a login check before the stage (the browser reaches the site before any stage's write
gate is in force)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from sfguard.supervisor.browsers import tools
from sfguard.supervisor.profiles.keys import FileKeyProvider
from sfguard.supervisor.profiles.local_store import LocalProfileStore
from sfguard.supervisor.protocols import ProfileKey

from .conftest import ROOT, Daemon
from .test_real_browser import as_stage
from .write_site import WriteSite

pytestmark = pytest.mark.browser

HOSTILE = """<!doctype html><title>left open</title><script>
const send = (p) => fetch(p, {method: 'POST', body: 'x=1'}).catch(() => 0);
send('/w/boot/post');
try { new WebSocket('ws://' + location.host + '/ws/boot'); } catch (e) {}
setInterval(() => send('/w/boot/tick'), 300);
</script><p>a page left open</p>"""


def extension(folder: Path, port: int) -> Path:
    """A person's unpacked extension whose worker POSTs to the site whenever it starts."""
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({
        "manifest_version": 3, "name": "a person's extension", "version": "1",
        "host_permissions": ["<all_urls>"], "background": {"service_worker": "sw.js"}}))
    (folder / "sw.js").write_text(
        "chrome.runtime.onStartup.addListener(() => 0);\n"
        f"fetch('http://wg.test:{port}/w/ext/post', {{method: 'POST', body: 'e=1', mode: 'no-cors'}})"
        ".catch(() => 0);\n")
    return folder


class Plain:
    """A plain Chromium (not the guard's) on a profile folder, as an unprivileged user when the
    tests run as root, with a DevTools port for the test and wg.test mapped to 127.0.0.1."""

    def __init__(self, data: Path, *extra: str):
        self.data = data
        prefix: list[str] = []
        if os.geteuid() == 0:
            for root, dirs, files in os.walk(data.parent):
                for name in [".", *dirs, *files]:
                    try:
                        os.chown(os.path.join(root, name), 65534, 65534, follow_symlinks=False)
                    except OSError:
                        pass
            prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", f"HOME={data.parent}"]
        (data / "DevToolsActivePort").unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [*prefix, str(tools.find_browser().path), "--headless=new", "--remote-debugging-port=0",
             f"--user-data-dir={data}", "--no-first-run", "--disable-background-networking",
             "--enable-unsafe-extension-debugging", "--host-resolver-rules=MAP wg.test 127.0.0.1",
             "--proxy-bypass-list=<-loopback>", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = data / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])

    def cdp(self, method: str, params: dict | None = None) -> dict:
        import aiohttp

        async def go() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/version", timeout=10) as r:
                ws = json.load(r)["webSocketDebuggerUrl"]
            async with aiohttp.ClientSession() as s, s.ws_connect(ws, max_msg_size=0) as c:
                await c.send_str(json.dumps({"id": 1, "method": method, "params": params or {}}))
                async with asyncio.timeout(30):
                    while True:
                        m = json.loads((await c.receive()).data)
                        if m.get("id") == 1:
                            return m
        return asyncio.run(go())

    def close(self) -> None:
        try:
            self.cdp("Browser.close")
            self.proc.wait(30)
        except Exception:  # noqa: BLE001 - a browser that will not close is ended
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def prepared(tmp_path_factory):
    """A guard home whose sealed profile `acct` carries what would run before the guard, the
    site, and what a plain Chromium did with a copy of that profile (the positive control)."""
    tmp = tmp_path_factory.mktemp("nbg")
    site = WriteSite(tmp, ("wg.test",))
    site.pages["/hostile"] = HOSTILE
    port = site.http_port
    policy = tmp / "sites.yaml"
    policy.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {port}]\nblock: []\nallow_always: [wg.test]\n"
                      "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT),
           "SFGUARD_KEY_PROVIDER": "file"}
    d = Daemon((tmp / "home").absolute(), env, tmp / "daemon.log")
    d.start("--policy", str(policy), "--resolve", "wg.test=127.0.0.1")
    assert d.call("POST", "/v1/runs", {"run_id": "r0"})[0] == 201          # the profile exists
    assert d.call("POST", "/v1/runs/r0/stages", {"stage_id": "s", "attempt": 1, "browser": {
        "profile": "acct", "headed": False, "allow_domains": ["wg.test"]}})[0] == 200
    assert d.call("POST", "/v1/runs/r0/end", {"outcome": "succeeded"})[0] == 200
    d.stop()
    # as a person or an earlier run would leave it: the hostile page open (a saved session),
    # start-up pages, a crash, and an extension loaded in developer mode
    store = LocalProfileStore(d.home, FileKeyProvider(d.home))     # the guard's (SFGUARD_KEY_PROVIDER=file)
    key = ProfileKey("local", "acct")
    unsealed = store.open(key)
    site_page = f"http://wg.test:{port}/hostile"
    ext = extension(Path(tempfile.mkdtemp(prefix="sfg-ext-", dir="/tmp")) / "ext", port)
    os.chmod(ext.parent, 0o755)
    # worked on in a folder of its own (a plain browser user cannot cross the guard's runtime
    # folder), then put back and sealed as the guard seals
    work = Path(tempfile.mkdtemp(prefix="sfg-prep-", dir="/tmp")) / "u"
    shutil.copytree(unsealed, work, symlinks=True)
    plain = Plain(work)
    assert "id" in plain.cdp("Extensions.loadUnpacked", {"path": str(ext)}).get("result", {})
    plain.cdp("Target.createTarget", {"url": site_page})
    time.sleep(3)
    plain.close()
    prefs_file = work / "Default" / "Preferences"
    prefs = json.loads(prefs_file.read_text())
    prefs.setdefault("session", {}).update({"restore_on_startup": 1, "startup_urls": [site_page]})
    prefs.setdefault("extensions", {}).setdefault("ui", {})["developer_mode"] = True
    prefs_file.write_text(json.dumps(prefs))
    assert (work / "Default" / "Sessions").is_dir()          # the saved session is there
    # the positive control: a plain Chromium on a copy of this profile runs all of it by itself
    copy = Path(tempfile.mkdtemp(prefix="sfg-copy-", dir="/tmp")) / "u"
    shutil.copytree(work, copy, symlinks=True, ignore=shutil.ignore_patterns("Singleton*"))
    before = len(site.got)
    plain = Plain(copy)
    deadline = time.monotonic() + 20
    def seen() -> set[str]:
        return {g.path for g in site.got[before:]}
    while time.monotonic() < deadline and not ({"/w/boot/post", "/w/boot/tick"} <= seen()
                                               and any(x.startswith("/ws/boot") for x in seen())):
        time.sleep(0.2)
    control = {g.path for g in site.got[before:]}
    plain.close()
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.rmtree(unsealed)
    shutil.copytree(work, unsealed, symlinks=True, ignore=shutil.ignore_patterns("Singleton*", "DevToolsActivePort"))
    shutil.rmtree(work.parent, ignore_errors=True)
    store.close(key, save=True)
    yield d, site, control, policy
    shutil.rmtree(ext.parent, ignore_errors=True)
    site.close()


def burn(seconds: float) -> list[subprocess.Popen]:
    """Two busy processes (the machine has two cores) for `seconds`."""
    return [subprocess.Popen([sys.executable, "-c", f"import time\nt = time.time() + {seconds}\n"
                              "while time.time() < t: pass"]) for _ in range(2)]


@pytest.mark.parametrize("load", ["quiet", "busy", "login-check-first"])
def test_a_guarded_browser_starts_with_only_what_the_guard_opens(prepared, load):
    d, site, control, policy = prepared
    # the positive control: a plain Chromium restores the page left open, which POSTs, opens its
    # WebSocket and keeps sending (the unpacked extension does not load by itself on Chromium 156,
    # developer mode on or off: measured; --disable-extensions-except keeps any other kind out)
    assert {"/hostile", "/w/boot/post", "/w/boot/tick"} <= control, control
    assert any(p.startswith("/ws/boot") for p in control), control
    d.start("--policy", str(policy), "--resolve", "wg.test=127.0.0.1")
    burners = burn(25) if load == "busy" else []
    try:
        before = len(site.got)
        run = f"r-{load}"
        assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
        if load == "login-check-first":
            # the runner checks the login before the stage: the browser starts for the check, and
            # its proxy lets it reach the site before any stage (and so any write gate) is there
            page = f"http://wg.test:{site.http_port}/page"
            status, res = d.call("POST", f"/v1/runs/{run}/login-check", {"profile": "acct", "login_check": {
                "url": page, "logged_in": page}})
            assert status == 200 and res["logged_in"] is True, res
            time.sleep(3)
        status, answer = d.call("POST", f"/v1/runs/{run}/stages", {"stage_id": "s", "attempt": 1, "browser": {
            "profile": "acct", "headed": False, "allow_domains": ["wg.test"], "writes": "deny"}})
        assert status == 200, answer
        env = answer["env"]
        # the stage works as usual: it reads the site
        assert as_stage(env, "open", f"http://wg.test:{site.http_port}/page").returncode == 0
        assert as_stage(env, "get", "title").stdout.strip() == "write site"
        time.sleep(8)
        got = [g.path for g in site.got[before:]]
        assert [p for p in got if p.startswith(("/w/boot", "/w/ext", "/ws/", "/hostile"))] == [], got
        browser = d.call("GET", f"/v1/runs/{run}")[1]["browsers"][0]
        # the stage's tab and the next stage's session started ahead (about:blank), nothing else
        assert browser["tabs"] == ["about:blank", f"http://wg.test:{site.http_port}"], browser
        assert browser["closed_tabs"] == [], browser
        carried = " ".join(browser["carried"])
        for what in ("session.restore_on_startup=1", "session.startup_urls", "extensions.ui.developer_mode",
                     "extensions ("):
            assert what in carried, (what, browser["carried"])
        assert "saved session" not in carried      # the seal left the saved session out already
        lines = [json.loads(x) for x in (d.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
        assert not [x for x in lines if x.get("run") == run and x.get("decision") == "allow"
                    and x.get("host") == "wg.test" and x.get("client", "").startswith("b-")
                    and x.get("method") == "POST"]
        assert d.call("POST", f"/v1/runs/{run}/end", {"outcome": "succeeded"})[0] == 200
        shown = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "profiles", "show", "acct", "--json",
                                "--home", str(d.home)], cwd=ROOT, env=d.env, capture_output=True, text=True,
                               timeout=60)
        assert "session.restore_on_startup" in json.loads(shown.stdout)["cleaned"], shown.stdout
    finally:
        for b in burners:
            b.kill()
            b.wait(10)
        d.stop()
