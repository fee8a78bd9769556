"""The launch env of an anchor / stage session: exactly what the guard sets, nothing inherited."""
from __future__ import annotations

import sys
import time

import pytest

from supervisor import agent_browser as ab

AMBIENT = {
    "PATH": "/usr/bin:/bin", "HOME": "/home/op", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
    "DISPLAY": ":0", "XAUTHORITY": "/home/op/.Xauthority",
    "HTTP_PROXY": "http://evil:1", "https_proxy": "http://evil:2", "ALL_PROXY": "socks5://evil:3",
    "no_proxy": "*", "AGENT_BROWSER_USER_AGENT": "x", "AGENT_BROWSER_ALLOWED_DOMAINS": "a.test",
    "AGENT_BROWSER_CDP": "ws://127.0.0.1:1/x", "SECRET_TOKEN": "t", "PYTHONPATH": "/x",
}
PROXY = "http://run-1:tok3n@127.0.0.1:8123"


def make(**kw):
    args = dict(session="anc-1", socket_dir="/run/sfg/s", config_path="/run/sfg/cfg.json",
                browser_path="/usr/bin/chromium", profile_dir="/run/sfg/p/x", proxy_url=PROXY,
                headed=False, base_env=AMBIENT, as_root=False)
    args.update(kw)
    return ab.anchor_env(**args)


def test_anchor_env_is_exactly_the_guard_set_plus_plain_inherited_vars():
    env = make()
    assert env == {
        "PATH": "/usr/bin:/bin", "HOME": "/home/op", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
        "DISPLAY": ":0", "XAUTHORITY": "/home/op/.Xauthority",
        "AGENT_BROWSER_SESSION": "anc-1", "AGENT_BROWSER_SOCKET_DIR": "/run/sfg/s",
        "AGENT_BROWSER_CONFIG": "/run/sfg/cfg.json", "AGENT_BROWSER_EXECUTABLE_PATH": "/usr/bin/chromium",
        "AGENT_BROWSER_PROFILE": "/run/sfg/p/x", "AGENT_BROWSER_PROXY": PROXY,
        "AGENT_BROWSER_PROXY_BYPASS": "<-loopback>", "AGENT_BROWSER_IDLE_TIMEOUT_MS": "0",
        "AGENT_BROWSER_ARGS": "\n".join(ab.CHROME_ARGS), "AGENT_BROWSER_HEADED": "false",
        "AGENT_BROWSER_NO_XVFB": "1", "AGENT_BROWSER_NO_VERSION_CHECK": "1",
    }


def test_anchor_env_is_deterministic_for_identical_inputs():
    assert make() == make() and list(make()) == list(make())


@pytest.mark.parametrize("as_root,has_no_sandbox", [(True, True), (False, False)])
def test_no_sandbox_only_as_root(as_root, has_no_sandbox):
    args = make(as_root=as_root)["AGENT_BROWSER_ARGS"].split("\n")
    assert ("--no-sandbox" in args) is has_no_sandbox
    assert "--force-webrtc-ip-handling-policy=disable_non_proxied_udp" in args
    assert "--disable-quic" in args and "," not in "".join(args)


@pytest.mark.parametrize("headed,value", [(True, "true"), (False, "false")])
def test_headed_is_written_explicitly(headed, value):
    # agent-browser treats any value but "false" (even "0") as headed.
    assert make(headed=headed)["AGENT_BROWSER_HEADED"] == value


def test_without_proxy_no_proxy_variables_at_all():
    env = make(proxy_url=None)
    assert not any("PROXY" in k.upper() for k in env)


@pytest.mark.parametrize("field,value,message", [
    ("session", "../x", "session name"),
    ("session", "a b", "session name"),
    ("session", "", "session name"),
    ("socket_dir", "relative/s", "absolute"),
    ("socket_dir", "/tmp/" + "d" * 100, "103-byte"),
    ("profile_dir", "Default", "absolute"),
    ("config_path", "cfg.json", "absolute"),
    ("proxy_url", "http://127.0.0.1:8123", "credential"),
    ("proxy_url", "http://u:p@10.0.0.1:8123", "127.0.0.1"),
    ("proxy_url", "socks5://u:p@127.0.0.1:8123", "http://"),
    ("proxy_url", "http://u:p@127.0.0.1:8123/path", "path"),
    ("proxy_url", "http://u:p@127.0.0.1:notaport", "malformed"),
])
def test_invalid_inputs_are_refused_without_echoing_secrets(field, value, message):
    with pytest.raises(ValueError, match=message) as info:
        make(**{field: value})
    if field == "proxy_url":
        assert "p@" not in str(info.value) and value not in str(info.value)


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
