"""Unit tests of the CDP method policy (supervisor/gate/cdp_policy.py): table-driven, no browser."""
from __future__ import annotations

from pathlib import Path

import pytest

from sfguard.supervisor.gate import cdp_policy as p

OWN_TAB, OTHER_TAB, OWN_SESSION, OTHER_SESSION = "OWNTAB", "OTHERTAB", "OWNSESS", "OTHERSESS"


def ctx(tmp_path: Path | None = None, **kw) -> p.PolicyContext:
    c = p.PolicyContext(own_targets={OWN_TAB}, own_sessions={OWN_SESSION: OWN_TAB},
                        artifacts_dir=tmp_path / "artifacts" if tmp_path else None)
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def cmd(method: str, params: dict | None = None, session: str | None = None, msg_id: int = 1) -> dict:
    m = {"id": msg_id, "method": method, "params": params or {}}
    if session:
        m["sessionId"] = session
    return m


NEVER = [
    ("Target.createBrowserContext", {"proxyServer": "direct://"}, None),
    ("Target.disposeBrowserContext", {"browserContextId": "X"}, None),
    ("Storage.getCookies", {}, None),
    ("Storage.setCookies", {"cookies": []}, None),
    ("Storage.clearCookies", {}, None),
    ("Storage.getCookies", {}, OWN_SESSION),
    ("Network.getAllCookies", {}, OWN_SESSION),
    ("Network.getCookies", {}, OWN_SESSION),
    ("Network.setCookie", {"name": "a", "value": "b"}, OWN_SESSION),
    ("Network.setCookies", {"cookies": []}, OWN_SESSION),
    ("Network.clearBrowserCookies", {}, OWN_SESSION),
    ("Network.setRequestInterception", {"patterns": []}, OWN_SESSION),
    ("Fetch.enable", {"handleAuthRequests": True}, OWN_SESSION),
    ("Fetch.continueWithAuth", {}, OWN_SESSION),
    ("Browser.close", {}, None),
    ("Browser.crash", {}, None),
    ("SystemInfo.getInfo", {}, None),
    ("SystemInfo.getProcessInfo", {}, None),
    ("Target.exposeDevToolsProtocol", {"targetId": OWN_TAB}, None),
    ("Target.setRemoteLocations", {"locations": [{"host": "127.0.0.1", "port": 9}]}, None),
    ("Target.attachToBrowserTarget", {}, None),
    ("Target.sendMessageToTarget", {"message": "{}", "sessionId": OWN_SESSION}, None),
    ("Security.setIgnoreCertificateErrors", {"ignore": True}, None),
    ("DOM.setFileInputFiles", {"files": ["/etc/passwd"]}, OWN_SESSION),
    ("Tethering.bind", {"port": 9}, None),
    ("Browser.getBrowserCommandLine", {}, None),
]


@pytest.mark.parametrize("method,params,session", NEVER)
def test_never_pass_even_if_allowlisted(monkeypatch, method, params, session):
    monkeypatch.setitem(p.ALLOWED, method, "pretend someone allowlisted it")
    reason = p.check_command(cmd(method, params, session), ctx())
    assert reason is not None and reason != "not in the stage allowlist"


def test_allowlist_and_never_pass_do_not_overlap():
    for method in p.ALLOWED:
        assert p.never_pass_reason(method.replace(".*", ".x")) is None, method


# Methods agent-browser 0.41.2 sent for the stage skill's commands (see cdp_policy docstring).
OBSERVED = [
    ("Browser.getVersion", {}, None), ("Target.setDiscoverTargets", {"discover": True}, None),
    ("Target.getTargets", {}, None), ("Target.attachToTarget", {"targetId": OWN_TAB, "flatten": True}, None),
    ("Target.createTarget", {"url": "about:blank"}, None), ("Target.closeTarget", {"targetId": OWN_TAB}, None),
    ("Target.setAutoAttach", {"autoAttach": True, "flatten": True, "waitForDebuggerOnStart": True}, OWN_SESSION),
    ("Runtime.enable", {}, OWN_SESSION), ("Runtime.evaluate", {"expression": "location.href"}, OWN_SESSION),
    ("Runtime.callFunctionOn", {"functionDeclaration": "function(){}"}, OWN_SESSION),
    ("Runtime.runIfWaitingForDebugger", {}, OWN_SESSION), ("Page.enable", {}, OWN_SESSION),
    ("Page.navigate", {"url": "https://example.com/"}, OWN_SESSION), ("Page.getFrameTree", {}, OWN_SESSION),
    ("Page.captureScreenshot", {"format": "png"}, OWN_SESSION), ("Page.reload", {}, OWN_SESSION),
    ("Network.enable", {}, OWN_SESSION), ("DOM.enable", {}, OWN_SESSION),
    ("DOM.resolveNode", {"backendNodeId": 5}, OWN_SESSION), ("DOM.getBoxModel", {"backendNodeId": 5}, OWN_SESSION),
    ("DOM.scrollIntoViewIfNeeded", {"backendNodeId": 5}, OWN_SESSION),
    ("Accessibility.enable", {}, OWN_SESSION), ("Accessibility.getFullAXTree", {}, OWN_SESSION),
    ("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": 1, "y": 1}, OWN_SESSION),
    ("Input.dispatchKeyEvent", {"type": "keyDown"}, OWN_SESSION), ("Input.insertText", {"text": "x"}, OWN_SESSION),
    ("WebMCP.enable", {}, OWN_SESSION), ("Network.getResponseBody", {"requestId": "1"}, OWN_SESSION),
    ("Emulation.setDeviceMetricsOverride", {"width": 1, "height": 1}, OWN_SESSION),
]


@pytest.mark.parametrize("method,params,session", OBSERVED)
def test_agent_browser_methods_pass(method, params, session):
    assert p.check_command(cmd(method, params, session), ctx()) is None


@pytest.mark.parametrize("method", ["Profiler.enable", "Debugger.enable", "Overlay.enable", "Animation.enable",
                                    "Page.printToPDF", "Network.setUserAgentOverride", "Browser.getWindowForTarget"])
def test_not_allowlisted_is_refused(method):
    assert p.check_command(cmd(method, {}, OWN_SESSION), ctx()) == "not in the stage allowlist"


FOREIGN_TARGET = [
    ("Target.attachToTarget", {"targetId": OTHER_TAB, "flatten": True}),
    ("Target.closeTarget", {"targetId": OTHER_TAB}),
    ("Target.activateTarget", {"targetId": OTHER_TAB}),
    ("Target.getTargetInfo", {"targetId": OTHER_TAB}),
    ("Target.detachFromTarget", {"sessionId": OTHER_SESSION}),
]


@pytest.mark.parametrize("method,params", FOREIGN_TARGET)
def test_foreign_targets_refused(method, params):
    reason = p.check_command(cmd(method, params), ctx())
    assert reason in ("not a tab of this stage", "not a target of this stage", "not a session of this connection")


@pytest.mark.parametrize("method,params", [
    ("Target.attachToTarget", {"targetId": OWN_TAB, "flatten": True}),
    ("Target.closeTarget", {"targetId": OWN_TAB}),
    ("Target.activateTarget", {"targetId": OWN_TAB}),
    ("Target.getTargetInfo", {"targetId": OWN_TAB}),
    ("Target.detachFromTarget", {"sessionId": OWN_SESSION}),
])
def test_own_targets_pass(method, params):
    assert p.check_command(cmd(method, params), ctx()) is None


def test_non_flat_attach_refused():
    assert p.check_command(cmd("Target.attachToTarget", {"targetId": OWN_TAB}), ctx()) is not None


@pytest.mark.parametrize("session", [OTHER_SESSION, "", 5])
def test_foreign_session_refused(session):
    m = cmd("Runtime.evaluate", {"expression": "1"})
    m["sessionId"] = session
    assert p.check_command(m, ctx()) == "sessionId is not a session this connection attached"


def test_browser_level_auto_attach_refused():
    assert p.check_command(cmd("Target.setAutoAttach", {"autoAttach": True, "flatten": True}), ctx()) is not None


@pytest.mark.parametrize("behavior,path_kind,allowed", [
    ("allow", "inside", True),
    ("allowAndName", "inside_sub", True),
    ("allow", "artifacts", True),
    ("deny", None, True),
    ("allow", "outside", False),
    ("allow", "dotdot", False),
    ("allow", "relative", False),
    ("allow", None, False),
    ("default", None, False),
    ("allow", "prefix_sibling", False),
])
@pytest.mark.parametrize("method", ["Browser.setDownloadBehavior", "Page.setDownloadBehavior"])
def test_download_path_rule(tmp_path, method, behavior, path_kind, allowed):
    art = tmp_path / "artifacts"
    paths = {"inside": str(art / "dl"), "inside_sub": str(art / "a" / "b"), "artifacts": str(art),
             "outside": str(tmp_path / "elsewhere"), "dotdot": str(art / ".." / "elsewhere"),
             "relative": "artifacts/dl", "prefix_sibling": str(tmp_path / "artifacts2"), None: None}
    params = {"behavior": behavior}
    if paths[path_kind] is not None:
        params["downloadPath"] = paths[path_kind]
    session = OWN_SESSION if method.startswith("Page.") else None
    reason = p.check_command(cmd(method, params, session), ctx(tmp_path))
    assert (reason is None) == allowed, reason


def test_download_refused_without_artifacts_dir(tmp_path):
    reason = p.check_command(cmd("Browser.setDownloadBehavior",
                                 {"behavior": "allow", "downloadPath": str(tmp_path)}), ctx())
    assert reason is not None


@pytest.mark.parametrize("url,allowed", [
    ("https://example.com/x", True), ("http://127.0.0.1:8080/", True), ("about:blank", True),
    ("file:///etc/passwd", False), ("chrome://settings", False), ("javascript:alert(1)", False),
    ("data:text/html,hi", False), ("view-source:https://example.com", False), ("about:config", False),
    ("devtools://devtools/bundled/inspector.html", False), ("https:///nohost", False), (None, False),
])
def test_url_schemes(url, allowed):
    navigate = p.check_command(cmd("Page.navigate", {"url": url}, OWN_SESSION), ctx())
    assert (navigate is None) == allowed
    create = p.check_command(cmd("Target.createTarget", {"url": url}), ctx())
    assert (create is None) == allowed


def test_create_target_with_browser_context_refused():
    assert p.check_command(cmd("Target.createTarget", {"url": "about:blank", "browserContextId": "C"}), ctx()) \
        == "browser contexts belong to the guard"


@pytest.mark.parametrize("owned,pending,quota,allowed", [
    (0, 0, 8, True), (7, 0, 8, True), (8, 0, 8, False), (6, 2, 8, False), (1, 0, 1, False), (0, 0, 1, True),
])
def test_tab_quota(owned, pending, quota, allowed):
    c = ctx(own_targets={f"T{i}" for i in range(owned)}, pending_creates=pending, tab_quota=quota)
    reason = p.check_command(cmd("Target.createTarget", {"url": "about:blank"}), c)
    assert (reason is None) == allowed
    if not allowed:
        assert reason == f"tab quota reached ({quota})"


@pytest.mark.parametrize("msg,expected", [
    ("not a dict", "not a CDP command object"),
    ({"method": "Browser.getVersion"}, "a command needs an integer id"),
    ({"id": True, "method": "Browser.getVersion"}, "a command needs an integer id"),
    ({"id": 1, "method": "Storage.getCookies; rm -rf"}, "malformed method name"),
    ({"id": 1, "method": 5}, "malformed method name"),
    ({"id": 1, "method": "Browser.getVersion", "params": []}, "params must be an object"),
])
def test_malformed_commands(msg, expected):
    assert p.check_command(msg, ctx()) == expected


def test_refusal_message_keeps_session_and_names_guard():
    reply = p.refusal_message(7, "Storage.getCookies", "cookie dump", OWN_SESSION)
    assert reply == {"id": 7, "sessionId": OWN_SESSION, "error": {
        "code": -32000, "message": "sfguard: refused Storage.getCookies: cookie dump"}}
    assert "sessionId" not in p.refusal_message(7, "X.y", "r")
    assert p.refusal_message(1, "junk\nlog injection", "r")["error"]["message"] == "sfguard: refused <malformed>: r"


def test_filter_target_infos_shows_own_tabs_and_children():
    infos = [{"targetId": OWN_TAB, "type": "page"}, {"targetId": OTHER_TAB, "type": "page"},
             {"targetId": "ANCHOR", "type": "page"}, {"targetId": "CHILD", "type": "iframe"},
             {"targetId": "BROWSERUI", "type": "browser_ui"}, "junk"]
    visible = p.filter_target_infos(infos, {OWN_TAB}, {OWN_SESSION: OWN_TAB, "CS": "CHILD"})
    assert [i["targetId"] for i in visible] == [OWN_TAB, "CHILD"]


@pytest.mark.parametrize("info,own", [
    ({"targetId": "P", "type": "page", "openerId": OWN_TAB}, True),
    ({"targetId": "P", "type": "page", "openerId": OTHER_TAB}, False),
    ({"targetId": "P", "type": "page"}, False),
    ({"targetId": "W", "type": "worker", "openerId": OWN_TAB}, False),
])
def test_popups_of_own_pages_are_own(info, own):
    assert p.is_own_popup(info, {OWN_TAB}) is own


def test_redact_network_removes_cookies_and_auth():
    params = {"requestId": "1", "headers": {"Cookie": "sid=S", "cookie": "x", "Accept": "a",
                                            "Proxy-Authorization": "Basic Q"},
              "associatedCookies": [{"cookie": {"value": "S"}}], "headersText": "Set-Cookie: sid=S",
              "response": {"headers": {"Set-Cookie": "sid=S", "Content-Type": "t"}, "requestHeaders": {"Cookie": "S"}}}
    out = p.redact_network(params)
    assert out == {"requestId": "1", "headers": {"Accept": "a"},
                   "response": {"headers": {"Content-Type": "t"}, "requestHeaders": {}}}
