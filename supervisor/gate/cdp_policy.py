"""CDP method policy of the gate: the ONE place that says what a stage may send to its browser.

The CDP gate (`supervisor/gate/cdp_gate.py`) relays a stage's agent-browser to the anchor browser and
asks this module about every message. Nothing here does I/O: the functions take a parsed message
and a `PolicyContext` (what this stage owns) and return a refusal reason or None, or filter what
the browser sends back. Order of checks in `check_command`:

  1. the message shape (id, method, params, sessionId);
  2. the sessionId, if any, must be a session this connection attached itself (to one of its own
     targets or their child frames/workers);
  3. NEVER_PASS (exact names and domain prefixes): refused whatever the allowlist says;
  4. ALLOWED (exact names, or "Domain.*"): everything else is refused;
  5. the parameter rules of the allowed method (own target ids, tab quota, URL scheme, download
     folder inside the stage's artifacts dir).

Each entry of NEVER_PASS and ALLOWED says why. How the allowlist was found (the methods
agent-browser was measured to send through the gate): docs/decisions/0025-cdp-allowlist-from-agent-browser.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# ---------------------------------------------------------------------------------------------
# Never pass, whatever ALLOWED says. Keys ending in "." are whole domains.
NEVER_PASS: dict[str, str] = {
    "Target.createBrowserContext": "a new browser context can set its own proxy (direct://) and bypass the guard proxy",
    "Target.disposeBrowserContext": "browser contexts belong to the guard",
    "Target.getBrowserContexts": "browser contexts belong to the guard",
    "Target.exposeDevToolsProtocol": "would hand a page the raw browser protocol",
    "Target.setRemoteLocations": "would make the browser connect to other debugging endpoints",
    "Target.attachToBrowserTarget": "a browser-wide session would escape the per-stage checks",
    "Target.sendMessageToTarget": "non-flat sessions are not supported; attach with flatten=true",
    "Target.autoAttachRelated": "only own sessions may auto-attach (use setAutoAttach in a page session)",
    "Storage.": "cookie and storage dumps or changes (every Storage method)",
    "Network.getAllCookies": "cookie dump",
    "Network.getCookies": "cookie dump (includes HttpOnly cookies)",
    "Network.setCookie": "cookie change",
    "Network.setCookies": "cookie change",
    "Network.deleteCookies": "cookie change",
    "Network.clearBrowserCookies": "cookie change",
    "Network.setRequestInterception": ("interception sees every request header (HttpOnly cookies, proxy auth) "
                                       "and can rewrite requests"),
    "Network.setExtraHTTPHeaders": "could inject headers (Proxy-Authorization, Cookie) into every request",
    "Network.loadNetworkResource": "fetches outside the page (file: and other schemes)",
    "Fetch.": ("interception sees every request header (HttpOnly cookies, proxy credentials via authRequired) "
               "and can rewrite requests"),
    "Browser.close": "the browser belongs to the guard",
    "Browser.crash": "the browser belongs to the guard",
    "Browser.crashGpuProcess": "the browser belongs to the guard",
    "Browser.resetPermissions": "browser-wide setting",
    "Browser.grantPermissions": "browser-wide setting",
    "Browser.setPermission": "browser-wide setting",
    "Browser.getBrowserCommandLine": "reveals the launch command line (profile path, proxy)",
    "Browser.executeBrowserCommand": "browser-wide command",
    "SystemInfo.": "host system details",
    "Tethering.": "would open listening ports on the host",
    "Security.": "certificate checks stay on (Security.setIgnoreCertificateErrors and friends)",
    "Page.crash": "crashes the renderer",
    "Page.close": "close tabs with Target.closeTarget (own tabs only)",
    "DOM.setFileInputFiles": "would upload local files of the host into a page",
    "IO.": "reads browser-side streams and blobs",
    "Tracing.": "traces include other tabs and request headers",
    "ServiceWorker.": "service workers are shared by every stage of the profile",
    "CacheStorage.": "site storage dump",
    "IndexedDB.": "site storage dump",
    "DOMStorage.": "site storage dump",
    "Audits.": "issues include cookie details",
    "Extensions.": "extensions are browser-wide",
    "PWA.": "installs apps browser-wide",
    "HeapProfiler.": "not needed by the stage commands",
    "Memory.": "not needed by the stage commands",
}

# ---------------------------------------------------------------------------------------------
# Allowed methods, one per line with the reason. "Domain.*" allows a whole domain.
ALLOWED: dict[str, str] = {
    # Browser
    "Browser.getVersion": "agent-browser's liveness check before every command",
    "Browser.setDownloadBehavior": "downloads, only into the stage's artifacts folder (rule below)",
    # Target: all results and events are filtered to this stage's own tabs by the gate
    "Target.setDiscoverTargets": "tab tracking; events are filtered to own tabs",
    "Target.getTargets": "tab list; the result is filtered to own tabs",
    "Target.getTargetInfo": "own targets only",
    "Target.createTarget": "tab new / the session's pinned tab; tab quota, http(s)/about:blank only",
    "Target.attachToTarget": "attach to own tabs only (flatten=true)",
    "Target.detachFromTarget": "own sessions only",
    "Target.closeTarget": "tab close, own tabs only",
    "Target.activateTarget": "tab switch, own tabs only",
    "Target.setAutoAttach": "child frames/workers of own pages, only inside an own page session",
    # Runtime: page scripts can already read non-HttpOnly cookies; HttpOnly ones stay protected
    "Runtime.enable": "execution contexts for evaluate",
    "Runtime.disable": "counterpart of enable",
    "Runtime.evaluate": "get url/title/text, scroll, back/forward, wait, element lookup",
    "Runtime.callFunctionOn": "fill/type/get text on a resolved element",
    "Runtime.getProperties": "reading resolved objects",
    "Runtime.releaseObject": "frees remote objects",
    "Runtime.releaseObjectGroup": "frees remote objects",
    "Runtime.runIfWaitingForDebugger": "resumes new own tabs and auto-attached children",
    "Runtime.addBinding": "page-to-agent callbacks used by waits",
    # Page
    "Page.enable": "load events",
    "Page.disable": "counterpart of enable",
    "Page.navigate": "open; http(s)/about:blank only",
    "Page.reload": "reload",
    "Page.stopLoading": "stop a navigation",
    "Page.getFrameTree": "frame ids for snapshot and navigation",
    "Page.captureScreenshot": "screenshot",
    "Page.getLayoutMetrics": "full-page screenshot, scroll",
    "Page.getNavigationHistory": "back/forward",
    "Page.navigateToHistoryEntry": "back/forward",
    "Page.bringToFront": "tab switch of an own tab",
    "Page.setLifecycleEventsEnabled": "wait for load states",
    "Page.handleJavaScriptDialog": "alert/confirm dialogs of own pages",
    "Page.addScriptToEvaluateOnNewDocument": "agent-browser's helper scripts in own pages",
    "Page.removeScriptToEvaluateOnNewDocument": "counterpart",
    "Page.createIsolatedWorld": "helper scripts without touching the page's globals",
    "Page.setDownloadBehavior": "downloads, only into the stage's artifacts folder (rule below)",
    # Network: events are redacted by the gate (no Cookie/Set-Cookie headers, no cookie lists)
    "Network.enable": "request tracking for waits; cookie headers are stripped from events",
    "Network.disable": "counterpart of enable",
    "Network.getResponseBody": "bodies of own pages' responses (the page could read them anyway)",
    "Network.getRequestPostData": "own pages' request bodies",
    # DOM / Accessibility: snapshot refs and element actions
    "DOM.enable": "snapshot",
    "DOM.disable": "counterpart of enable",
    "DOM.getDocument": "element lookup",
    "DOM.querySelector": "element lookup",
    "DOM.querySelectorAll": "element lookup",
    "DOM.describeNode": "element lookup for refs",
    "DOM.resolveNode": "ref (@eN) to JS object for click/fill",
    "DOM.getBoxModel": "click position of an element",
    "DOM.getContentQuads": "click position of an element",
    "DOM.scrollIntoViewIfNeeded": "click/fill scroll the element into view",
    "DOM.focus": "fill/type focus",
    "Accessibility.enable": "snapshot",
    "Accessibility.disable": "counterpart of enable",
    "Accessibility.getFullAXTree": "snapshot",
    "Accessibility.getPartialAXTree": "snapshot of one element",
    # Input
    "Input.dispatchMouseEvent": "click, scroll (wheel)",
    "Input.dispatchKeyEvent": "press, type",
    "Input.insertText": "fill, type",
    "Input.dispatchTouchEvent": "tap on touch-emulated pages",
    # Emulation: viewport/device settings of own pages only
    "Emulation.*": "viewport and device emulation of own pages (agent-browser set viewport/device)",
    # WebMCP (Chrome 156): agent-browser enables it on every page session
    "WebMCP.enable": "agent-browser enables it on every page it attaches",
    "Log.enable": "console/log capture of own pages",
    "Log.disable": "counterpart",
    "Inspector.enable": "target crash/detach notices",
}

ALLOWED_URL_SCHEMES = frozenset({"http", "https"})
ALLOWED_EXACT_URLS = frozenset({"about:blank", ""})
DOWNLOAD_BEHAVIORS_WITH_PATH = frozenset({"allow", "allowAndName"})
DEFAULT_TAB_QUOTA = 8

_METHOD_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,40}\.[A-Za-z][A-Za-z0-9]{0,60}$")


@dataclass
class PolicyContext:
    """What one stage connection owns; the gate keeps it up to date, the policy only reads it.

    own_targets: the stage's tabs (shared by all connections of the stage token).
    own_sessions: sessionId -> targetId of sessions this connection attached (tabs and children).
    pending_creates: Target.createTarget calls of the stage sent but not yet answered, on any of
        its connections (count toward the quota; the gate sets it before each check).
    """
    own_targets: set[str] = field(default_factory=set)
    own_sessions: dict[str, str] = field(default_factory=dict)
    artifacts_dir: Path | None = None
    tab_quota: int = DEFAULT_TAB_QUOTA
    pending_creates: int = 0


def safe_method_name(method: Any) -> str:
    """The method name if it looks like one, else a placeholder (log lines never echo junk)."""
    return method if isinstance(method, str) and _METHOD_RE.match(method) else "<malformed>"


def never_pass_reason(method: str) -> str | None:
    if method in NEVER_PASS:
        return NEVER_PASS[method]
    domain = method.split(".", 1)[0] + "."
    return NEVER_PASS.get(domain)


def is_allowed_method(method: str) -> bool:
    return method in ALLOWED or (method.split(".", 1)[0] + ".*") in ALLOWED


def url_allowed(url: Any) -> bool:
    """Only web pages: http(s) and about:blank. No file:, chrome:, javascript:, data:, view-source:."""
    if not isinstance(url, str):
        return False
    if url.strip().lower() in ALLOWED_EXACT_URLS:
        return True
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return False
    return parts.scheme.lower() in ALLOWED_URL_SCHEMES and bool(parts.netloc)


def _inside(path_text: Any, folder: Path | None) -> bool:
    if folder is None or not isinstance(path_text, str) or not path_text:
        return False
    path = Path(path_text)
    if not path.is_absolute():
        return False
    try:
        resolved, root = path.resolve(strict=False), folder.resolve(strict=False)
    except (OSError, RuntimeError):
        return False
    return resolved == root or root in resolved.parents


def _params_rule(method: str, params: dict, session_id: str | None, ctx: PolicyContext) -> str | None:
    """Parameter checks of allowed methods; returns a refusal reason or None."""
    target_id = params.get("targetId")
    if method in ("Target.attachToTarget", "Target.closeTarget", "Target.activateTarget"):
        if target_id not in ctx.own_targets:
            return "not a tab of this stage"
        if method == "Target.attachToTarget" and params.get("flatten") is not True:
            return "only flat sessions (flatten=true) are supported"
    elif method == "Target.getTargetInfo":
        if target_id is not None and target_id not in ctx.own_targets \
                and target_id not in ctx.own_sessions.values():
            return "not a target of this stage"
    elif method == "Target.detachFromTarget":
        sid = params.get("sessionId")
        if sid not in ctx.own_sessions and not (target_id in ctx.own_targets and sid is None):
            return "not a session of this connection"
    elif method == "Target.setAutoAttach":
        if session_id is None:
            return "auto-attach only inside an own page session"
    elif method == "Target.setDiscoverTargets":
        pass  # events are filtered by the gate
    elif method == "Target.createTarget":
        if params.get("browserContextId") is not None:
            return "browser contexts belong to the guard"
        if not url_allowed(params.get("url", "about:blank")):
            return "only http(s) and about:blank URLs"
        if len(ctx.own_targets) + ctx.pending_creates >= ctx.tab_quota:
            return f"tab quota reached ({ctx.tab_quota})"
    elif method == "Page.navigate":
        if not url_allowed(params.get("url")):
            return "only http(s) and about:blank URLs"
    elif method in ("Browser.setDownloadBehavior", "Page.setDownloadBehavior"):
        if params.get("browserContextId") is not None:
            return "browser contexts belong to the guard"
        behavior = params.get("behavior")
        if behavior == "deny":
            return None
        if behavior not in DOWNLOAD_BEHAVIORS_WITH_PATH:
            return "behavior must be deny, allow or allowAndName"
        if not _inside(params.get("downloadPath"), ctx.artifacts_dir):
            return "downloadPath must be inside the stage's artifacts folder"
    return None


def check_command(msg: Any, ctx: PolicyContext) -> str | None:
    """Decide one client->browser message. Returns None to forward it, or the refusal reason."""
    if not isinstance(msg, dict):
        return "not a CDP command object"
    method, params, session_id = msg.get("method"), msg.get("params", {}), msg.get("sessionId")
    if not isinstance(msg.get("id"), int) or isinstance(msg.get("id"), bool):
        return "a command needs an integer id"
    if not isinstance(method, str) or safe_method_name(method) == "<malformed>":
        return "malformed method name"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return "params must be an object"
    if session_id is not None and (not isinstance(session_id, str) or session_id not in ctx.own_sessions):
        return "sessionId is not a session this connection attached"
    reason = never_pass_reason(method)
    if reason:
        return reason
    if not is_allowed_method(method):
        return "not in the stage allowlist"
    return _params_rule(method, params, session_id, ctx)


def refusal_message(msg_id: Any, method: str, reason: str, session_id: Any = None) -> dict:
    """The CDP error reply for a refused command (keeps sessionId so the client can route it)."""
    reply: dict[str, Any] = {"id": msg_id, "error": {
        "code": -32000, "message": f"sfguard: refused {safe_method_name(method)}: {reason}"}}
    if isinstance(session_id, str):
        reply["sessionId"] = session_id
    return reply


# ---------------------------------------------------------------------------------------------
# Filtering what the browser sends back.

def target_visible(info: dict, own_targets: set[str], own_sessions: dict[str, str]) -> bool:
    """A targetInfo is visible to a stage if it is one of its tabs or an attached child."""
    tid = info.get("targetId")
    return tid in own_targets or tid in own_sessions.values()


def is_own_popup(info: dict, own_targets: set[str]) -> bool:
    """A page opened by one of the stage's own pages (window.open, target=_blank) is the stage's."""
    return info.get("type") == "page" and info.get("openerId") in own_targets


def filter_target_infos(infos: list, own_targets: set[str], own_sessions: dict[str, str]) -> list:
    """Target.getTargets result: only own tabs and own children."""
    return [i for i in infos if isinstance(i, dict) and target_visible(i, own_targets, own_sessions)]


# Events carrying request/response headers or cookie lists; the gate parses and redacts these.
NETWORK_EVENTS_TO_REDACT = frozenset({
    "Network.requestWillBeSent", "Network.requestWillBeSentExtraInfo",
    "Network.responseReceived", "Network.responseReceivedExtraInfo",
    "Network.responseReceivedEarlyHints", "Network.webSocketWillSendHandshakeRequest",
    "Network.webSocketHandshakeResponseReceived", "Network.requestIntercepted",
})
_COOKIE_HEADERS = frozenset({"cookie", "set-cookie", "proxy-authorization", "authorization"})
_COOKIE_FIELDS = frozenset({"associatedCookies", "blockedCookies", "exemptedCookies",
                            "headersText", "requestHeadersText", "cookiePartitionKey"})


def redact_network(value: Any) -> Any:
    """Strip Cookie/Set-Cookie/(Proxy-)Authorization headers and cookie lists, recursively."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in _COOKIE_FIELDS:
                continue
            if key in ("headers", "requestHeaders") and isinstance(item, dict):
                out[key] = {k: v for k, v in item.items() if k.lower() not in _COOKIE_HEADERS}
            else:
                out[key] = redact_network(item)
        return out
    if isinstance(value, list):
        return [redact_network(v) for v in value]
    return value
