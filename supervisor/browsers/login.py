"""The login check: is this browser profile logged in to the site? Computed by the guard.

A stage's `browser.login_check` (`sfguard.supervisor.models.LoginCheck`) names a page, a pattern
for the address a logged-in visitor ends on, patterns for the addresses a logged-out visitor
ends on, and optionally a CSS selector that only a logged-in page shows:

    login_check:
      url: http://127.0.0.1:8080/account
      logged_in: "http://127.0.0.1:8080/account"
      logged_out: ["http://127.0.0.1:8080/login*"]
      selector: "#signed-in"

`check_login(pipe, check)` opens `url` in a tab of its own in the run's anchor (over the guard's
DevTools pipe), reads the final address and whether the selector is shown, closes the tab and
returns `LoginResult(logged_in, url)` (`url` as `shown_url` shows it: query values hidden).
`decide_login`: only `logged_in` matches -> True, or False when a selector is given and not
shown; a `logged_out` pattern matches -> False; both or neither -> `LoginCheckError`.
Patterns (`match_pattern`) match the WHOLE final URL: a glob, case-sensitive, where only `*` is
special (any run of characters, also none, also `/`; `?`, `.`, `[`, `+` mean themselves), or
`re:` and a Python regular expression that must match the whole URL (`re.fullmatch`).

Why the guard decides, never guesses, and lets the selector only say "logged out":
docs/decisions/0028-login-check.md.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from sfguard.errors import SfguardError
from sfguard.supervisor.gate.cdp_pipe import CdpCallError, CdpPipe, CdpSession, PipeClosed
from sfguard.supervisor.models import LoginCheck

_CdpError = CdpCallError

__all__ = [
    "REGEX_PREFIX", "LoginCheckError", "LoginResult", "check_login", "compile_pattern",
    "decide_login", "match_pattern",
]

#: A pattern starting with this is a regular expression, not a glob.
REGEX_PREFIX = "re:"
#: Navigation counts as settled once the load event fired and no main-frame navigation was
#: seen for this long (client-side redirects, `location.replace` after load).
QUIET_SECONDS = 0.5
#: Pauses between attempts to reach the anchor / create the check tab. An open right after a
#: close on the same profile fails for a moment (spec, gotcha 3: a 2 s pause fixed it).
RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0, 2.0, 2.0)
#: Longest wait for the check's tab to be gone after Target.closeTarget (it closes async).
CLOSE_WAIT = 5.0


class LoginCheckError(SfguardError):
    """The check could not give a trustworthy answer (page did not load, patterns ambiguous,
    browser unreachable). Messages never contain the CDP address or cookie values."""


def shown_url(url: str) -> str:
    """An address as the guard shows it in answers, logs and errors: scheme, host, port and path,
    and the query's names with their values hidden (`?code=…&state=…`). A sign-in's final
    address can carry an authorization code, a state or a reset token; the patterns are still
    matched against the whole address, inside the guard."""
    try:
        p = urlsplit(url)
        port = p.port
    except ValueError:
        return "(an address that does not parse)"
    if p.scheme not in ("http", "https") or not p.hostname:
        return url.split(":", 1)[0] + ":" if ":" in url else "(not an address)"
    host = f"[{p.hostname}]" if ":" in p.hostname else p.hostname
    out = f"{p.scheme}://{host}{f':{port}' if port is not None else ''}{p.path or '/'}"
    names = [k for k, _ in parse_qsl(p.query, keep_blank_values=True)]
    return out + ("?" + "&".join(f"{k}=…" for k in names) if names else "")


@dataclass(frozen=True)
class LoginResult:
    """The guard's answer. `url` is the final address the check page ended on, as `shown_url`
    shows it (query values hidden)."""
    logged_in: bool
    url: str

    def to_json(self) -> dict[str, Any]:
        return {"logged_in": self.logged_in, "url": self.url}


# --------------------------------------------------------------------------- patterns

def compile_pattern(pattern: str) -> re.Pattern[str]:
    """The compiled whole-URL matcher of `pattern` (glob, or `re:` regular expression).

    Raises ValueError naming the pattern when it is empty or not a valid regular expression.
    Use it to validate patterns ahead of time (the pipeline validator does)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("a URL pattern must be a non-empty string")
    if pattern.startswith(REGEX_PREFIX):
        body = pattern[len(REGEX_PREFIX):]
        if not body:
            raise ValueError(f"URL pattern {pattern!r} has an empty regular expression after 're:'")
        try:
            return re.compile(body, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"URL pattern {pattern!r} is not a valid regular expression: {exc}") from None
    # Glob: only `*` is special; runs of `*` collapse (they mean the same thing).
    parts = re.split(r"\*+", pattern)
    return re.compile(".*".join(re.escape(p) for p in parts), re.DOTALL)


def match_pattern(pattern: str, url: str) -> bool:
    """True when `pattern` matches the whole `url` (see the module docstring for the syntax)."""
    return compile_pattern(pattern).fullmatch(url) is not None


def decide_login(final_url: str, logged_in: str, logged_out: Iterable[str],
                 selector_found: bool | None = None) -> bool:
    """Decide from the final URL (and, if a selector was given, whether it was found).

    `selector_found` is None when the check has no selector. Raises LoginCheckError when the
    URL matches neither the logged-in nor any logged-out pattern, or both; ValueError for an
    invalid pattern."""
    logged_out = list(logged_out)
    in_match = match_pattern(logged_in, final_url)
    out_hits = [p for p in logged_out if match_pattern(p, final_url)]
    if in_match and out_hits:
        raise LoginCheckError(
            f"the final URL {shown_url(final_url)} matches both the logged_in pattern {logged_in!r} and the "
            f"logged_out pattern {out_hits[0]!r}: make the patterns exclusive")
    if not in_match and not out_hits:
        raise LoginCheckError(
            f"the final URL {shown_url(final_url)} matches neither the logged_in pattern {logged_in!r} nor "
            f"any logged_out pattern ({', '.join(map(repr, logged_out)) or 'none given'}): the "
            "check cannot tell, so it does not guess (add the pattern this page needs)")
    if out_hits:
        return False
    return selector_found is not False


# --------------------------------------------------------------------------- CDP

async def _open_tab(pipe: CdpPipe, deadline: float):
    """The check's own session on the browser's pipe and its own tab, in its own window (never
    a tab in the background of a stage's window). Retries with a bounded backoff.

    Returns (cdp, target_id)."""
    last = "no attempt was made"
    for delay in (*RETRY_DELAYS, None):
        cdp = None
        try:
            cdp = await pipe.session("login check")
            created = await cdp.call("Target.createTarget", {"url": "about:blank", "newWindow": True},
                                     timeout=max(0.1, deadline - time.monotonic()))
            target = created.get("targetId")
            if not isinstance(target, str):
                raise _CdpError("Target.createTarget: no target id in the answer")
            return cdp, target
        except PipeClosed:
            if cdp is not None:
                await cdp.close()
            raise LoginCheckError("the anchor browser is not running") from None
        except (_CdpError, CdpCallError) as exc:
            last = str(exc)
            if cdp is not None:
                await cdp.close()
        if delay is None or time.monotonic() + delay >= deadline:
            break
        await asyncio.sleep(delay)
    raise LoginCheckError(f"could not open a tab in the anchor browser ({last})")


def _redirect_target(cdp: CdpSession, session: str, target: str, start: str) -> str | None:
    """Where the check tab's main frame was last sent before its navigation failed, when a
    redirect sent it away from `start` (read from the Network events already received)."""
    last = None
    while not cdp.events.empty():
        ev = cdp.events.get_nowait()
        params = ev.get("params") or {}
        if (ev.get("sessionId") == session and ev.get("method") == "Network.requestWillBeSent"
                and params.get("type") == "Document" and params.get("frameId") == target
                and params.get("redirectResponse")):
            url = (params.get("request") or {}).get("url")
            last = url if isinstance(url, str) else last
    return last if last != start else None


async def _wait_settled(cdp: CdpSession, session: str, deadline: float, quiet: float) -> None:
    """Wait for the load event after at least one main-frame navigation, then for `quiet`
    seconds without a further main-frame navigation. Bounded by `deadline`."""
    navigated = loaded = False
    last_change = time.monotonic()
    while True:
        now = time.monotonic()
        if loaded and now - last_change >= quiet:
            return
        if now >= deadline:
            what = "finish loading" if not loaded else "stop navigating"
            raise LoginCheckError(f"the check page did not {what} in time")
        wait = min(deadline - now, quiet - (now - last_change) if loaded else deadline - now)
        try:
            ev = await asyncio.wait_for(cdp.events.get(), timeout=max(0.01, wait))
        except TimeoutError:
            continue
        if ev.get("sessionId") != session:
            continue
        method, params = ev.get("method"), ev.get("params") or {}
        if method == "Page.frameNavigated" and not (params.get("frame") or {}).get("parentId"):
            navigated, last_change = True, time.monotonic()
        elif method == "Page.navigatedWithinDocument":
            last_change = time.monotonic()
        elif method == "Page.loadEventFired" and navigated:
            loaded, last_change = True, max(last_change, time.monotonic())
        elif method == "Inspector.detached" or method == "Target.detachedFromTarget":
            raise LoginCheckError("the check tab was closed while loading")


async def _evaluate(cdp: CdpSession, session: str, expression: str) -> Any:
    res = await cdp.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                         session=session)
    if res.get("exceptionDetails"):
        raise _CdpError("evaluation failed")
    return (res.get("result") or {}).get("value")


async def _close_tab(cdp: CdpSession, target: str) -> None:
    """Close the check's tab and wait until the browser no longer lists it, so that a caller
    counting tabs (the tab quota) never sees it after check_login returned."""
    await cdp.call("Target.closeTarget", {"targetId": target})
    while True:
        infos = (await cdp.call("Target.getTargets")).get("targetInfos") or []
        if not any(t.get("targetId") == target for t in infos):
            return
        await asyncio.sleep(0.05)


async def check_login(pipe: CdpPipe, check: LoginCheck, *, timeout: float = 30,
                      quiet: float = QUIET_SECONDS) -> LoginResult:
    """Run `check` in a new tab (its own window) of the browser behind `pipe` and decide.

    `pipe` is the anchor's DevTools pipe (`Anchor.pipe`, guard-internal); the browser answers
    the run proxy's credential challenge through it. The tab is the check's own (created and
    always closed here), so stage tabs are untouched, and a failed check leaves the browser
    running. The whole check is bounded by `timeout` seconds.

    Raises LoginCheckError (browser gone, page failed or did not settle, invalid selector,
    ambiguous patterns) and ValueError (invalid pattern)."""
    # Invalid patterns fail before any browser work.
    compile_pattern(check.logged_in)
    for p in check.logged_out:
        compile_pattern(p)
    deadline = time.monotonic() + timeout
    cdp = target = None
    try:
        async with asyncio.timeout(timeout):
            cdp, target = await _open_tab(pipe, deadline)
            attached = await cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})
            session = attached.get("sessionId")
            if not isinstance(session, str):
                raise LoginCheckError("could not attach to the check tab")
            await cdp.call("Page.enable", session=session)
            # the addresses the tab is sent to (a redirect to a host the run may not reach fails
            # the navigation; where it was sent still decides: _refused_redirect)
            await cdp.call("Network.enable", session=session)
            # A new tab may be held at start for a debugger when another client of the anchor
            # auto-attaches with waitForDebuggerOnStart; release it, or navigation never starts.
            await cdp.call("Runtime.runIfWaitingForDebugger", session=session)
            nav = await cdp.call("Page.navigate", {"url": check.url}, session=session)
            if nav.get("errorText"):
                sent_to = _redirect_target(cdp, session, target, check.url)
                if sent_to is not None and any(match_pattern(p, sent_to) for p in check.logged_out):
                    # the site sent the check to its sign-in page on a host this run may not
                    # reach (an SSO provider): that is the site's answer, logged out
                    return LoginResult(False, shown_url(sent_to))
                raise LoginCheckError(f"the check page {check.url} could not be opened: {nav['errorText']}"
                                      " (is the site in the run's allow_domains, and reachable?)")
            await _wait_settled(cdp, session, deadline, quiet)
            final_url = await _evaluate(cdp, session, "location.href")
            if not isinstance(final_url, str) or not final_url:
                raise LoginCheckError("could not read the final URL of the check page")
            found = None
            if check.selector is not None:
                try:
                    found = await _evaluate(
                        cdp, session, f"document.querySelector({json.dumps(check.selector)}) !== null")
                except (_CdpError, CdpCallError):
                    raise LoginCheckError(f"the selector {check.selector!r} is not a valid CSS selector") from None
                found = found is True
        return LoginResult(decide_login(final_url, check.logged_in, check.logged_out, found),
                           shown_url(final_url))
    except TimeoutError:
        raise LoginCheckError(f"the login check did not finish within {timeout:g} s") from None
    except PipeClosed:
        raise LoginCheckError("the anchor browser stopped during the check") from None
    except (_CdpError, CdpCallError) as exc:
        raise LoginCheckError(f"the browser refused a step of the check: {exc}") from None
    finally:
        if cdp is not None:
            if target is not None:
                try:
                    await asyncio.wait_for(_close_tab(cdp, target), CLOSE_WAIT)
                except (PipeClosed, CdpCallError, TimeoutError, asyncio.CancelledError):  # best effort, bounded
                    pass
            await cdp.close()
