"""WebSocket upgrades to hosts whose writes are gated or refused, refused in the browser
process; and the always-on rules of every guarded browser (no service worker, no write filed
as a read). The guard owns one small extension per browser (`extension_dir` writes it; the
browser loads it at start as the only extension it may load; `WebSocketGate` keeps a session on
its worker and sets its declarativeNetRequest session rules: `dnr_rules`). Each refusal the
extension reports is a `write_refused` line, reason `websocket_upgrade`.

    gate = WebSocketGate(pipe, ext_dir); await gate.apply(dnr_rules(pipe.writes))
    await guard_websockets(anchor)      # in step with the browser's write gate

Why an extension, and what it does not see: docs/decisions/0024-websocket-gate-extension.md and
docs/threat-model.md, "WebSocket upgrades".
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sfguard.policy.errors import MalformedHost
from sfguard.policy.hosts import normalize_host_ex, split_host_port_raw
from sfguard.policy.writes import WriteVerdict
from sfguard.supervisor.errors import BrowserStartError, swallowed
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpSession, PipeClosed
from sfguard.supervisor.writes.intercept import GET_ONLY_TYPES

log = logging.getLogger("sfguard.writes")

#: The extension's public key: a fixed key gives it a fixed id wherever its folder is.
EXTENSION_KEY = ("MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA0MhrzNkZufv9IqilK3+jPsaOgDaHM/+JORaQOYmjoNwFcnFKizHwRBA"
                 "bnVqQK9Ms3cGt8FjGfdnuyBTRke3VcqPpJKjBq5UW5VBBwea6B38lYJ5Mt4pXM8I44rxnkxhN2POWy7vszrvRM+E7Vr3cuzrJ"
                 "F28/ZFPZHta37xmxmW44gQNvGqK9SmYb/IasY6ZKBqn7SKwHxbpARQYGM9IKpYKwFT4op8Q06zvoRj+j7k/Kwz0yEu/wuC22V3"
                 "ILECaJ4YeBo4CxRSbL3xIC0siLACab+VG9EWYOyuqZTC7E7XugzLZNxZeWzX/sUvY7PaKdivjHqNow4TpZQ0GkZhf7+QIDAQAB")
#: sha256 of the key's DER, first 32 hex digits written a-p (Chromium's extension id)
EXTENSION_ID = "gbnpgmajpnekkdlpglfhbaecdebbegfc"
WORKER_FILE = "sw.js"
WORKER_URL = f"chrome-extension://{EXTENSION_ID}/{WORKER_FILE}"
MANIFEST = {"manifest_version": 3, "name": "sfguard write gate (WebSocket upgrades)", "version": "1",
            "key": EXTENSION_KEY, "permissions": ["declarativeNetRequest", "declarativeNetRequestFeedback"],
            "background": {"service_worker": WORKER_FILE}}
#: the first console argument of a refusal report
REPORT_TAG = "sfguard-ws-refused"
WORKER_JS = f"""// sfguard: refuses WebSocket upgrades to the hosts the guard names (session rules only)
const dnr = chrome.declarativeNetRequest;
dnr.onRuleMatchedDebug.addListener((info) => {{
  console.debug({json.dumps(REPORT_TAG)}, String(info.request.url), Number(info.rule.ruleId),
                String(info.request.method), String(info.request.type));
}});
globalThis.sfguardSetRules = async (rules) => {{
  const old = await dnr.getSessionRules();
  await dnr.updateSessionRules({{removeRuleIds: old.map((r) => r.id), addRules: rules}});
  return (await dnr.getSessionRules()).length;
}};
"""
#: the rule that refuses every request no tab made: a service worker's script and its requests
#: (measured on Chromium 156: tabId -1; pages, frames, dedicated workers and their requests carry
#: their tab's id), so no page can register a service worker (see the module docstring)
WORKER_RULE_ID = 9999
WORKER_RULE = {"id": WORKER_RULE_ID, "priority": 1, "action": {"type": "block"}, "condition": {"tabIds": [-1]}}
#: the rule that refuses every method but GET and HEAD for the resource types the write gate does
#: not pause (intercept.GET_ONLY_TYPES): no web API sends anything else as an image, a script, a
#: style sheet, a font or a medium, so only a renderer that lies about a request's type would,
#: and its write is refused here instead of walking past the gate. In force in every browser.
GET_ONLY_RULE_ID = 9998
GET_ONLY_RULE = {"id": GET_ONLY_RULE_ID, "priority": 1, "action": {"type": "block"},
                 "condition": {"resourceTypes": [t.lower() for t in GET_ONLY_TYPES],
                               "excludedRequestMethods": ["get", "head"]}}
#: seconds for loading the extension and for one rule update
LOAD_TIMEOUT = 15.0
#: seconds a load's worker has to show, and how many loads are tried
WORKER_WAIT = 5.0
LOAD_ATTEMPTS = 3
#: Chromium caps an extension's regex rules at 1000; far more guarded patterns than that
#: block every WebSocket instead (fail closed)
MAX_REGEX_RULES = 900
_USERINFO = r"([^/?#]*@)?"
_PORT = r"(:[0-9]+)?"
#: any IP address literal (a floor over an address range cannot be written as a regex)
IP_LITERAL = r"(\[[0-9a-fA-F:.]+\]|[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+)"


def extension_dir(parent: Path, gid: int | None = None) -> Path:
    """The extension's folder under `parent` (a fresh one), its two files written. With `gid`
    (the browser user's group) the folder and files are readable, not writable, by that group."""
    import tempfile  # noqa: PLC0415
    path = Path(tempfile.mkdtemp(prefix="wsx-", dir=parent))
    written = False
    try:
        for name, text in (("manifest.json", json.dumps(MANIFEST, indent=1)), (WORKER_FILE, WORKER_JS)):
            fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
            os.fchmod(fd, 0o640)    # whatever the umask (the service unit's is 0077)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            if gid is not None:
                os.chown(path / name, -1, gid, follow_symlinks=False)
        if gid is not None:
            os.chown(path, -1, gid, follow_symlinks=False)
            os.chmod(path, 0o750)
        written = True
    finally:
        if not written:
            import shutil  # noqa: PLC0415
            shutil.rmtree(path, ignore_errors=True)
    return path


def host_regex(pattern: str) -> str:
    """A regex (RE2) for the ws:// and wss:// URLs of a host pattern (`example.com`,
    `*.example.com`, an address, each with an optional port). An address range cannot be written
    as one: it gives every address literal. ValueError for a pattern that does not parse."""
    host, port = split_host_port_raw(pattern)        # MalformedHost is a ValueError
    wild = host.startswith("*.")
    if wild:
        host = host[2:]
    if "/" in host.strip("[]"):
        ipaddress.ip_network(host.strip("[]"))       # a range: any address literal (more, never less)
        name = IP_LITERAL
    else:
        host, is_ip = normalize_host_ex(host)
        if is_ip:
            ip = ipaddress.ip_address(host)
            name = re.escape(f"[{ip.compressed}]" if ip.version == 6 else ip.compressed)
            if ip.version == 4:      # and as an IPv4-mapped IPv6 literal (`[::ffff:7f00:1]`)
                mapped = ipaddress.IPv6Address("::ffff:" + str(ip)).compressed
                name = f"({name}|{re.escape(f'[{mapped}]')})"
        else:    # a name, with the trailing dot Chromium keeps in a URL (`ws://host./`)
            name = (r"([^/?#@:]*\.)?" if wild else "") + re.escape(host) + r"\.?"
    if port is None:
        return rf"^wss?://{_USERINFO}{name}{_PORT}/"
    if not port.isdigit():
        raise ValueError(f"not a port: {port[:20]!r}")
    default = {"80": "ws", "443": "wss"}.get(port)
    scheme = f"(wss?://{_USERINFO}{name}:{port}|{default}://{_USERINFO}{name})" if default \
        else f"wss?://{_USERINFO}{name}:{port}"
    return f"^{scheme}/"


def dnr_rules(writes: Any) -> list[dict]:
    """The block rules of a browser: the service-worker rule (WORKER_RULE) and the rule for
    writes disguised as reads of a GET-only type (GET_ONLY_RULE), both always; and for its
    write gate (intercept.WriteInterceptor) every host pattern whose mode is gate or deny, for the
    stages or by a floor of the site policy. A retry of a replay-unsafe stage that wrote before
    (every write held), a pattern that does not parse or more patterns than Chromium takes
    regexes for: every WebSocket is blocked (fail closed)."""
    return [*_websocket_rules(writes), GET_ONLY_RULE, WORKER_RULE]


def _websocket_rules(writes: Any) -> list[dict]:
    if writes is None:
        return []
    if writes.ctx.earlier:
        return [_rule(1, None)]
    patterns = [p for p, mode in writes.ctx.modes.items() if mode != "allow"]
    for entry in writes.rules.guarded():
        patterns += entry.patterns
    try:
        regexes = list(dict.fromkeys(host_regex(p) for p in patterns))
    except ValueError:
        return [_rule(1, None)]
    if len(regexes) > MAX_REGEX_RULES:
        return [_rule(1, None)]
    return [_rule(i, rx) for i, rx in enumerate(regexes, 1)]


def _rule(rule_id: int, regex: str | None) -> dict:
    cond: dict[str, Any] = {"resourceTypes": ["websocket"]}
    if regex is not None:
        cond["regexFilter"] = regex
    return {"id": rule_id, "priority": 1, "action": {"type": "block"}, "condition": cond}


class WebSocketGate:
    """The extension of one browser and the guard's session on its service worker."""

    def __init__(self, pipe: Any, ext_dir: Path) -> None:
        self.pipe, self.ext_dir = pipe, ext_dir
        self.writes: Any = None                 # the browser's WriteInterceptor: who, the log
        self.rules: list[dict] | None = None    # the rules in force
        self.step = ""                          # what the last start was doing (its errors)
        self.refused: list[str] = []            # host/path of each refusal (tests, metrics)
        self._cdp: CdpSession | None = None
        self._sid: str | None = None
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task | None = None

    async def apply(self, rules: list[dict]) -> None:
        """Put `rules` in force (the extension loaded first if need be). BrowserStartError when
        the browser does not take them."""
        async with self._lock:
            if rules == self.rules and self._cdp is not None and not self._cdp.client.closed:
                return
            try:
                if self._cdp is None or self._cdp.client.closed:
                    await self._start()
                assert self._cdp is not None
                self.step = "setting its rules"
                res = await self._cdp.call("Runtime.evaluate", {
                    "expression": f"sfguardSetRules({json.dumps(rules)})", "awaitPromise": True,
                    "returnByValue": True}, session=self._sid, timeout=LOAD_TIMEOUT)
            except (CdpCallError, PipeClosed, TimeoutError, KeyError, OSError) as exc:
                self.rules = None
                raise BrowserStartError(f"the WebSocket write gate could not be set ({self.step}): "
                                        f"{type(exc).__name__} {exc}") from None
            if res.get("exceptionDetails") or (res.get("result") or {}).get("value") != len(rules):
                self.rules = None
                detail = (res.get("exceptionDetails") or {}).get("exception", {}).get("description") \
                    or (res.get("exceptionDetails") or {}).get("text") or repr((res.get("result") or {}).get("value"))
                raise BrowserStartError("the WebSocket write gate could not be set: the browser refused its rules "
                                        f"({str(detail)[:200]})")
            self.rules = rules

    async def matched(self, url: str, resource_type: str, method: str) -> list[int]:
        """The ids of the rules in force that the browser's own matcher applies to a request
        (`declarativeNetRequest.testMatchOutcome`): a check of the rules as Chromium reads them,
        for requests no page can make (a POST filed as an image)."""
        if self._cdp is None or self._sid is None:
            raise BrowserStartError("the guard's extension is not loaded")
        req = {"url": url, "type": resource_type, "method": method, "tabId": 1}
        res = await self._cdp.call("Runtime.evaluate", {
            "expression": f"chrome.declarativeNetRequest.testMatchOutcome({json.dumps(req)})"
                          ".then((r) => r.matchedRules.map((m) => m.ruleId))",
            "awaitPromise": True, "returnByValue": True}, session=self._sid, timeout=LOAD_TIMEOUT)
        value = (res.get("result") or {}).get("value")
        if res.get("exceptionDetails") or not isinstance(value, list):
            raise CdpCallError("declarativeNetRequest.testMatchOutcome failed")
        return [int(v) for v in value]

    async def _start(self) -> None:
        if self._cdp is not None:
            await self._cdp.close()
        self._cdp = self._sid = None
        self.rules = None
        cdp = await self.pipe.session("websocket write gate")
        started = False
        try:
            # One load, then its worker's target. Measured at browser start under load: now and
            # then no worker target came (about 1 start in 25 with a load, an uninstall and a
            # second load; the second load was there for a registration kept without its script,
            # which cannot happen since the profile's Service Worker folder is removed before
            # every start). So a load whose worker does not show within WORKER_WAIT is done again.
            # The browser loads it itself at start (`--disable-extensions-except` names its
            # folder, the only extension a guarded browser may load): its worker is attached to
            # first; a worker that does not show is loaded over the pipe instead.
            sid = None
            for attempt in range(LOAD_ATTEMPTS + 1):
                if attempt == 0:
                    self.step = "attaching to the worker the browser loaded at start"
                    sid = await self._attach_worker(cdp, set())
                else:
                    self.step = "loading the extension" + (f" (attempt {attempt})" if attempt > 1 else "")
                    if attempt > 1:   # the one the command line loaded cannot be: it is loaded again
                        with contextlib.suppress(CdpCallError):
                            await cdp.call("Extensions.uninstall", {"id": EXTENSION_ID}, timeout=LOAD_TIMEOUT)
                    stale = set(self._worker_targets())
                    await self._load(cdp)
                    self.step = "attaching to its worker"
                    sid = await self._attach_worker(cdp, stale)
                if sid is not None:
                    break
                log.warning("the guard's extension showed no worker within %.0f s; loading it (again)", WORKER_WAIT)
            if sid is None:
                raise TimeoutError(f"no worker after {LOAD_ATTEMPTS} loads")
            await cdp.call("Runtime.enable", session=sid, timeout=LOAD_TIMEOUT)
            # the worker's target can be there before its script has run (seen on a cold start)
            self.step = "waiting for its worker's script"
            async with asyncio.timeout(LOAD_TIMEOUT):
                while (await cdp.call("Runtime.evaluate", {
                        "expression": "typeof globalThis.sfguardSetRules", "returnByValue": True},
                        session=sid, timeout=LOAD_TIMEOUT)).get("result", {}).get("value") != "function":
                    await asyncio.sleep(0.02)
            started = True
        finally:
            if not started:
                await cdp.close()
        self._cdp, self._sid = cdp, sid
        self._reader = asyncio.get_running_loop().create_task(self._read(cdp))

    async def _attach_worker(self, cdp: CdpSession, stale: set[str]) -> str | None:
        """A session on the extension's worker: its first target not in `stale` (the worker may
        stop and start again meanwhile: then its next one); None if none within WORKER_WAIT."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WORKER_WAIT
        while loop.time() < deadline:
            fresh = [t for t in self._worker_targets() if t not in stale]
            if not fresh:
                await asyncio.sleep(0.02)
                continue
            try:
                res = await cdp.call("Target.attachToTarget", {"targetId": fresh[0], "flatten": True})
                return str(res["sessionId"])
            except CdpCallError:
                stale.add(fresh[0])
        return None

    async def _load(self, cdp: CdpSession) -> None:
        res = await cdp.call("Extensions.loadUnpacked", {"path": str(self.ext_dir)}, timeout=LOAD_TIMEOUT)
        if res.get("id") != EXTENSION_ID:
            raise CdpCallError(f"Extensions.loadUnpacked: unexpected id {str(res.get('id'))[:40]}")

    def _worker_targets(self) -> list[str]:
        return [tid for tid, info in list(self.pipe.targets.items())
                if info.get("type") == "service_worker" and info.get("url") == WORKER_URL]

    async def _read(self, cdp: CdpSession) -> None:
        while ev := await cdp.events.get():     # {}: the session ended (browser closed)
            params = ev.get("params") or {}
            if ev.get("method") != "Runtime.consoleAPICalled" or ev.get("sessionId") != self._sid:
                continue
            args = [a.get("value") for a in params.get("args") or [] if isinstance(a, dict)]
            if len(args) >= 3 and args[0] == REPORT_TAG and isinstance(args[1], str):
                if args[2] == GET_ONLY_RULE_ID:
                    log.warning("refused a %s sent as a request of a type only ever fetched with GET "
                                "(%s): %s", str(args[3] if len(args) > 3 else "?")[:10].upper(),
                                str(args[4] if len(args) > 4 else "?")[:20], _host_path(args[1]))
                    continue
                if args[2] == WORKER_RULE_ID:
                    log.info("refused a request no tab made (a service worker's: none run in a guarded "
                             "browser): %s", _host_path(args[1]))
                    continue
                with swallowed(log, "logging a refused WebSocket upgrade"):
                    self._refused(args[1])

    def _refused(self, url: str) -> None:
        try:
            parts = urlsplit(url)
            host, is_ip = normalize_host_ex(parts.hostname or "")
            path, port = (parts.path or "/"), parts.port or (443 if parts.scheme == "wss" else 80)
        except (ValueError, MalformedHost):
            host, is_ip, path, port = "?", False, "/", None
        self.refused.append(f"{host}{path}")
        writes = self.writes
        if writes is None:
            return
        # A handshake names no frame the guard can map to a stage: the one stage of the browser
        # whose own mode refuses this host, else (a floor, or several) everyone's (`who(None)`).
        mine = [sw for sw in writes.stages.values() if sw.mode(host, is_ip, port) != "allow"]
        who = mine[0] if len(mine) == 1 else writes.who(None)
        verdict = WriteVerdict(True, "deny", "websocket_upgrade",
                               explanation="a WebSocket upgrade to a host whose writes are gated or refused")
        writes.record_decision("refused", "GET", host, port, path, verdict, who)


async def guard_websockets(anchor: Any) -> None:
    """Bring the browser's rules in step with its write gate (`pipe.writes`): called when the
    browser starts (before any page loads: the service-worker rule), at each stage's start and
    after a policy reload. An anchor without an extension folder (a fake host) has none."""
    pipe = getattr(anchor, "pipe", None)
    ext_dir = getattr(anchor, "ext_dir", None)
    if pipe is None or ext_dir is None:
        return
    rules = dnr_rules(getattr(pipe, "writes", None))
    gate: WebSocketGate | None = getattr(pipe, "websockets", None)
    if gate is None:
        gate = pipe.websockets = WebSocketGate(pipe, ext_dir)
    gate.writes = pipe.writes
    await gate.apply(rules)


_updates: set[asyncio.Task] = set()


def schedule_websockets(anchor: Any) -> None:
    """`guard_websockets` from synchronous code (a policy reload); a failure is logged."""
    async def run() -> None:
        try:
            await guard_websockets(anchor)
        except BrowserStartError as exc:
            log.error("a browser's WebSocket rules are not in step with the policy: %s", exc)
    try:
        task = asyncio.get_running_loop().create_task(run())
    except RuntimeError:     # no event loop (a synchronous caller outside the guard)
        log.error("a browser's WebSocket rules were not updated: no event loop")
        return
    _updates.add(task)
    task.add_done_callback(_updates.discard)


def _host_path(url: str) -> str:
    """host/path of a URL for a log line (never its query)."""
    try:
        parts = urlsplit(url)
        return f"{normalize_host_ex(parts.hostname or '')[0]}{parts.path or '/'}"
    except (ValueError, MalformedHost):
        return "?"
