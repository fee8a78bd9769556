"""How the guard starts a browser (command line, env) and a stage session's env: exactly what
the guard sets, nothing inherited."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from sfguard.supervisor.browsers import agent_browser as ab
from sfguard.supervisor.browsers import chromium

AMBIENT = {
    "PATH": "/usr/bin:/bin", "HOME": "/home/op", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
    "DISPLAY": ":0", "XAUTHORITY": "/home/op/.Xauthority",
    "HTTP_PROXY": "http://evil:1", "https_proxy": "http://evil:2", "ALL_PROXY": "socks5://evil:3",
    "no_proxy": "*", "AGENT_BROWSER_USER_AGENT": "x", "AGENT_BROWSER_ALLOWED_DOMAINS": "a.test",
    "AGENT_BROWSER_CDP": "ws://127.0.0.1:1/x", "SECRET_TOKEN": "t", "PYTHONPATH": "/x",
}
PROXY = "http://run-1:tok3n@127.0.0.1:8123"


def argv(**kw):
    args = dict(browser_path="/usr/bin/chromium", profile_dir=Path("/run/sfg/p/x"), proxy_port=8123,
                headed=False, no_sandbox=False)
    args.update(kw)
    return chromium.chromium_args(**args)


def test_browser_command_line_has_the_pipe_the_proxy_and_no_port_or_credential():
    a = argv()
    assert a[0] == "/usr/bin/chromium" and a[-1] == "about:blank"
    assert "--remote-debugging-pipe" in a and not any("remote-debugging-port" in x for x in a)
    assert "--user-data-dir=/run/sfg/p/x" in a and "--headless=new" in a
    assert "--proxy-server=http://127.0.0.1:8123" in a and "--proxy-bypass-list=<-loopback>" in a
    assert "--force-webrtc-ip-handling-policy=disable_non_proxied_udp" in a and "--disable-quic" in a
    assert "--password-store=basic" in a          # profiles made by earlier anchors stay readable
    assert not any("@" in x for x in a)
    assert argv() == a                            # deterministic


@pytest.mark.parametrize("kw,present,absent", [
    ({"no_sandbox": True}, ["--no-sandbox"], []),
    ({"no_sandbox": False}, [], ["--no-sandbox"]),
    ({"headed": True}, [], ["--headless=new"]),
    ({"proxy_port": None}, [], ["--proxy-bypass-list=<-loopback>"]),
])
def test_browser_command_line_options(kw, present, absent):
    a = argv(**kw)
    assert all(p in a for p in present) and not any(x in a for x in absent)
    if kw.get("proxy_port", 1) is None:
        assert not any(x.startswith("--proxy-server") for x in a)


def test_browser_env_is_scrubbed():
    env = chromium.browser_env({**AMBIENT, "HTTP_PROXY": "http://x:1", "AGENT_BROWSER_PROFILE": "/p",
                                "https_proxy": "http://x:1"})
    assert set(env) <= {"PATH", "HOME", "LANG", "TMPDIR", "XDG_RUNTIME_DIR", "DISPLAY",
                        "WAYLAND_DISPLAY", "XAUTHORITY"} and env["HOME"] == "/home/op"


@pytest.mark.parametrize("value,message", [
    ("http://127.0.0.1:8123", "credential"),
    ("http://u:p@10.0.0.1:8123", "127.0.0.1"),
    ("socks5://u:p@127.0.0.1:8123", "http://"),
    ("http://u:p@127.0.0.1:8123/path", "path"),
    ("http://u:p@127.0.0.1:notaport", "malformed"),
])
def test_invalid_proxy_urls_are_refused_without_echoing_secrets(value, message):
    with pytest.raises(ValueError, match=message) as info:
        ab.check_proxy_url(value)
    assert "p@" not in str(info.value) and value not in str(info.value)


@pytest.mark.parametrize("session", ["../x", "a b", ""])
def test_invalid_session_names_are_refused(session):
    with pytest.raises(ValueError, match="session name"):
        ab.check_session_name(session)


def test_stage_env_has_no_profile_proxy_or_browser_path():
    env = ab.stage_env(session="st-1", socket_dir="/run/sfg/s", config_path="/run/sfg/cfg.json",
                       cdp_url="ws://127.0.0.1:9/gate/tok", base_env=AMBIENT)
    assert {k for k in env if k.startswith("AGENT_BROWSER_")} == {
        "AGENT_BROWSER_CDP", "AGENT_BROWSER_SESSION", "AGENT_BROWSER_SOCKET_DIR",
        "AGENT_BROWSER_PIN_TAB", "AGENT_BROWSER_CONFIG", "AGENT_BROWSER_IDLE_TIMEOUT_MS",
        "AGENT_BROWSER_NO_VERSION_CHECK"}
    assert env["AGENT_BROWSER_PIN_TAB"] == "1" and env["AGENT_BROWSER_CDP"] == "ws://127.0.0.1:9/gate/tok"
    assert not any("PROXY" in k.upper() for k in env)


def test_pinned_config_is_written_0600_and_repaired(tmp_path):
    cfg = tmp_path / "cfg.json"
    ab.write_pinned_config(cfg)
    assert cfg.read_bytes() == b"{}\n" and cfg.stat().st_mode & 0o777 == 0o600
    cfg.write_text('{"profile": "./elsewhere"}')
    cfg.chmod(0o644)
    ab.write_pinned_config(cfg)
    assert cfg.read_bytes() == b"{}\n" and cfg.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("text", [
    "failed at ws://127.0.0.1:4444/devtools/browser/abc-def",
    "proxy http://run-1:tok3n@127.0.0.1:8123 refused",
])
def test_sanitize_masks_cdp_addresses_and_credentials(text):
    out = ab.sanitize(text)
    assert "abc-def" not in out and "tok3n" not in out and "4444" not in out


async def test_run_passes_exactly_the_env_and_kills_on_timeout(tmp_path):
    script = tmp_path / "tool"
    script.write_text(f"#!{sys.executable}\nimport os, sys, time, json\n"
                      "print(json.dumps(dict(os.environ)))\n"
                      "sys.stdout.flush()\n"
                      "time.sleep(float(sys.argv[1]))\n")
    script.chmod(0o700)
    rc, out, _ = await ab.run({"PATH": "/usr/bin:/bin", "AGENT_BROWSER_SESSION": "s"}, "0",
                              binary=script, timeout=20)
    import json
    env = json.loads(out)
    env.pop("LC_CTYPE", None)  # may be added by the Python runtime itself
    assert rc == 0 and env == {"PATH": "/usr/bin:/bin", "AGENT_BROWSER_SESSION": "s"}
    started = time.monotonic()
    with pytest.raises(ab.AgentBrowserError, match="timed out"):
        await ab.run({"PATH": "/usr/bin:/bin"}, "60", binary=script, timeout=0.5)
    assert time.monotonic() - started < 10
