"""The WebSocket part of the write gate, without a browser: which ws:// and wss:// URLs each
host pattern's block rule covers (supervisor/writes/websockets.py), which rules a browser's write
gate asks for, and that the guard removes its extension's entry from a profile before a start."""
from __future__ import annotations

import json
import os
import re

import pytest

from sfguard.policy import parse_policy
from sfguard.supervisor.browsers.chromium import set_guard_prefs
from sfguard.supervisor.writes.intercept import WriteContext, WriteInterceptor
from sfguard.supervisor.writes.websockets import EXTENSION_ID, GET_ONLY_RULE, WORKER_RULE, dnr_rules, host_regex


@pytest.mark.parametrize("pattern, blocked, passed", [
    ("b.test", ["ws://b.test/x", "wss://b.test:8443/x?q=1", "ws://B.test./", "ws://u:p@b.test/"],
     ["ws://a.test/", "ws://xb.test/", "ws://sub.b.test/", "ws://b.test.evil/", "ws://b.test@evil.test/"]),
    ("*.b.test", ["ws://b.test/", "wss://pay.b.test/", "ws://a.pay.b.test:81/"], ["ws://xb.test/", "ws://b.tester/"]),
    ("b.test:8443", ["wss://b.test:8443/", "ws://b.test:8443/"], ["wss://b.test/", "ws://b.test:8080/"]),
    ("b.test:443", ["wss://b.test/", "ws://b.test:443/"], ["ws://b.test/", "wss://b.test:8443/"]),
    ("127.0.0.1", ["ws://127.0.0.1:9/", "ws://[::ffff:7f00:1]/"], ["ws://127.0.0.10/", "ws://localhost/"]),
    ("[::1]:8080", ["ws://[::1]:8080/"], ["ws://[::1]/", "ws://[::2]:8080/"]),
    # an address range cannot be a regex: every address literal, never a name
    ("10.0.0.0/8", ["ws://10.1.2.3/", "ws://192.0.2.1:81/", "ws://[2001:db8::1]/"], ["ws://b.test/"]),
])
def test_a_patterns_rule_covers_its_hosts_and_only_them(pattern, blocked, passed):
    rx = re.compile(host_regex(pattern), re.IGNORECASE)
    for url in blocked:
        assert rx.search(url), (pattern, url)
    for url in passed:
        assert not rx.search(url), (pattern, url)


def gate(modes: dict[str, str], floors: str = "", earlier=()) -> WriteInterceptor:
    rules = parse_policy("version: 1\n" + floors).writes
    return WriteInterceptor(None, WriteContext("r", "p", "s", 1, modes, earlier), rules=rules)


def test_the_rules_are_the_gate_and_deny_hosts_and_the_floors():
    # always: every request no tab made is refused (a service worker's), and every method but
    # GET and HEAD of the types the write gate does not pause, in every browser
    always = [GET_ONLY_RULE, WORKER_RULE]
    assert dnr_rules(None) == dnr_rules(gate({"a.test": "allow"})) == always
    assert WORKER_RULE["condition"] == {"tabIds": [-1]} and WORKER_RULE["action"] == {"type": "block"}
    assert GET_ONLY_RULE["action"] == {"type": "block"} and GET_ONLY_RULE["condition"] == {
        "resourceTypes": ["image", "script", "stylesheet", "font", "media"], "excludedRequestMethods": ["get", "head"]}
    rules = dnr_rules(gate({"a.test": "allow", "b.test": "deny", "c.test": "gate"},
                           'writes:\n  - pattern: "*.d.test"\n    mode: gate\n    reason: "r"\n'))
    assert rules[-2:] == always
    rules = rules[:-2]
    assert [r["id"] for r in rules] == [1, 2, 3]
    assert all(r["action"] == {"type": "block"} and r["condition"]["resourceTypes"] == ["websocket"] for r in rules)
    assert [r["condition"]["regexFilter"] for r in rules] == [host_regex(p) for p in ("b.test", "c.test", "*.d.test")]
    # a retry of a replay-unsafe stage that wrote before holds every write: every WebSocket is refused
    everything = dnr_rules(gate({"a.test": "allow"}, earlier=({"method": "POST"},)))
    assert everything == [{"id": 1, "priority": 1, "action": {"type": "block"},
                           "condition": {"resourceTypes": ["websocket"]}}, *always]


def test_the_extensions_entry_is_removed_from_a_profile_before_a_start(tmp_path):
    prefs = tmp_path / "Default" / "Preferences"
    prefs.parent.mkdir()
    other = {"path": "/somewhere", "location": 4}
    prefs.write_text(json.dumps({"credentials_enable_service": False, "profile": {"password_manager_enabled": False},
                                 "extensions": {"settings": {EXTENSION_ID: {"path": "/gone"}, "other": other}}}))
    set_guard_prefs(tmp_path)
    assert json.loads(prefs.read_text())["extensions"]["settings"] == {"other": other}


def test_the_extensions_files_are_readable_by_the_browser_users_group_whatever_the_umask(tmp_path):
    """Under the service unit's umask (0077) the browser user, another user in the group, must
    still read the extension (found by the unit's test once every browser loaded it)."""
    import stat

    from sfguard.supervisor.writes.websockets import extension_dir
    old = os.umask(0o077)
    try:
        folder = extension_dir(tmp_path, os.getgid())
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    files = sorted(folder.iterdir())
    assert [f.name for f in files] == ["manifest.json", "sw.js"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o640 and f.stat().st_gid == os.getgid() for f in files)
