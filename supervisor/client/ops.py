"""The runner's side of the control API: runs, stages, login checks and handoffs on a running guard.

Used by `sfguard profiles check|login` (cli/profiles_cmd.py) and by `sfguard demo`
(supervisor/demo/). Two layers, each usable alone:

* `GuardRun`: one run on a running guard, spoken to over its unix socket with
  `sfguard.supervisor.client.guard_client.GuardClient` exactly like a pipeline runner would:
  create the run, ask for stage browsers, ask the guard for a login check, open a handoff, end
  stages and the run. API errors become `OpError` (message = the guard's own sentence, `code` =
  its error code).
* `ProfileOps`: the two operator commands. `check()` is a short run `check-<random>` with one
  headless stage on the profile (so the check host is in the run's allow list), one login
  check, then the run ends (the profile is resealed). `open_login_window()` is a run
  `login-<random>` with a headed stage and a `local_window` handoff; the caller waits for the
  person and calls `finish()`.

This module only talks to the guard through its API; it never prints a cookie value, a token or
a password.
"""
from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sfguard import policy
from sfguard.errors import SfguardError
from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable

__all__ = ["GuardNotRunning", "GuardRun", "HandoffRefused", "LoginWindow", "OpError", "ProfileInUse",
           "ProfileOps", "guard_running", "new_run_id"]

STAGE_WAIT_S = 60.0          # a queued stage (profile leased by another run) waits this long
LIVE_VIEW_WAIT_S = 900.0     # a person at a live view has this long (the guard's own limit too)


class OpError(SfguardError):
    """An operation on the guard failed; str() is a sentence for the operator."""

    def __init__(self, message: str, code: str = "error", status: int | None = None):
        super().__init__(message)
        self.code, self.status = code, status


class GuardNotRunning(OpError):
    pass


class HandoffRefused(OpError):
    """The guard cannot show a login window (no display, container); str() names the cause."""


class ProfileInUse(OpError):
    """The profile is leased by another run for longer than the caller would wait."""


def _error_of(status: int, answer: Any) -> OpError:
    err = (answer or {}).get("error") if isinstance(answer, dict) else None
    if not err:
        return OpError(f"the guard answered HTTP {status}", "http_error", status)
    msg = err.get("message") or err.get("code") or f"HTTP {status}"
    return OpError(msg, err.get("code") or "error", status)


class GuardRun:
    """One run on a running guard. Use as a context manager, or call `end()` yourself."""

    def __init__(self, client: GuardClient, run_id: str, pipeline: str | None = None):
        self.client, self.run_id = client, run_id
        self.ended = False
        body: dict[str, Any] = {"run_id": run_id}
        if pipeline:
            body["pipeline"] = pipeline
        status, answer = self._call("POST", "/v1/runs", body)
        if status != 201:
            raise _error_of(status, answer)

    def _call(self, method: str, route: str, body: Any = None) -> tuple[int, Any]:
        try:
            return self.client.call(method, route, body)
        except GuardUnavailable as exc:
            raise GuardNotRunning(str(exc), "guard_unavailable") from None
        except OSError as exc:  # timeouts, a guard that went away mid-call
            raise OpError(f"talking to the guard failed: {exc}", "guard_io") from None

    def stage(self, stage_id: str, browser: dict, attempt: int = 1,
              wait: float = STAGE_WAIT_S) -> dict[str, str]:
        """Ask for a stage's browser; returns the stage env. A queued stage (the profile is
        leased by another run) is polled for at most `wait` seconds, then ProfileInUse."""
        body = {"stage_id": stage_id, "attempt": attempt, "browser": browser}
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/stages", body)
        deadline = time.monotonic() + wait
        while status == 202:
            if time.monotonic() >= deadline:
                raise ProfileInUse(f"profile {browser.get('profile')!r} is in use by run "
                                  f"{answer.get('holder_run')!r} since {answer.get('since')}; "
                                  "try again when that run has ended", "profile_leased", 202)
            time.sleep(0.5)
            status, answer = self._call("GET", f"/v1/runs/{self.run_id}/stages/{stage_id}")
        if status != 200:
            raise _error_of(status, answer)
        return dict(answer["env"])

    def end_stage(self, stage_id: str, outcome: str = "succeeded") -> list[str]:
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/stages/{stage_id}/end",
                                    {"outcome": outcome})
        if status != 200:
            raise _error_of(status, answer)
        return list(answer.get("problems") or [])

    def login_check(self, profile: str, spec: dict,
                    on_retry: Callable[[str], None] | None = None) -> dict:
        """The guard's own {logged_in, url} for `profile` (needs a stage that allowed the host).

        A check that timed out inside the guard (`login_check_failed`, "did not finish") is
        tried once more, after telling `on_retry`: seen now and then on a freshly started anchor;
        any other error is raised at once."""
        for attempt in (1, 2):
            status, answer = self._call("POST", f"/v1/runs/{self.run_id}/login-check",
                                        {"profile": profile, "login_check": spec})
            if status == 200:
                return {"logged_in": bool(answer["logged_in"]), "url": str(answer["url"])}
            err = _error_of(status, answer)
            if attempt == 1 and err.code == "login_check_failed" and "did not finish" in str(err):
                if on_retry:
                    on_retry(f"the guard's login check timed out ({err}); trying once more")
                continue
            raise err
        raise AssertionError("unreachable")

    def verify(self, profile: str, reported: dict) -> None:
        """Have the guard compare a stage's envelope with its own last check (OpError on 409)."""
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/login-check/verify",
                                    {"profile": profile, "reported": reported})
        if status != 200:
            raise _error_of(status, answer)

    def handoff(self, profile: str, site: str, reason: str, url: str | None,
                kind: str = "auto", stage_id: str | None = None,
                login_check: dict | None = None) -> dict:
        """Open the profile's browser for a person; the gate payload, or HandoffRefused.
        `auto`: a visible window where the guard has a screen, else a live view in its console."""
        body: dict[str, Any] = {"profile": profile, "site": site, "reason": reason, "kind": kind}
        if url:
            body["url"] = url
        if stage_id:
            body["stage_id"] = stage_id
        if login_check:
            body["login_check"] = login_check
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/handoff", body)
        if status == 409 and (answer or {}).get("error", {}).get("code") == "handoff_impossible":
            raise HandoffRefused(answer["error"]["message"], "handoff_impossible", 409)
        if status != 200:
            raise _error_of(status, answer)
        return dict(answer)

    def wait_handoff(self, limit: float = LIVE_VIEW_WAIT_S) -> dict:
        """Long-poll the run's live_view handoff until it is no longer open (or `limit` s)."""
        deadline = time.monotonic() + limit
        while True:
            left = min(30.0, max(0.0, deadline - time.monotonic()))   # never past `limit`
            status, answer = self._call("GET", f"/v1/runs/{self.run_id}/handoff?wait={left:.2f}")
            if status != 200:
                raise _error_of(status, answer)
            if answer["state"] != "open" or time.monotonic() >= deadline:
                return dict(answer)

    def end(self, outcome: str = "succeeded") -> list[str]:
        """End the run: the guard closes its browsers, reseals its profiles, releases leases."""
        if self.ended:
            return []
        status, answer = self._call("POST", f"/v1/runs/{self.run_id}/end", {"outcome": outcome})
        self.ended = True
        if status != 200:
            raise _error_of(status, answer)
        return list(answer.get("problems") or [])

    def __enter__(self) -> GuardRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.ended:
            with contextlib.suppress(OpError):
                self.end("succeeded" if exc_type is None else
                         "cancelled" if exc_type is KeyboardInterrupt else "failed")


def new_run_id(prefix: str) -> str:
    """A fresh run id: `prefix-` and 8 random hex digits."""
    return f"{prefix}-{secrets.token_hex(4)}"


@dataclass
class LoginWindow:
    """An open `profiles login` run: show `payload`, wait for the person, then `finish()`."""
    run: GuardRun
    payload: dict
    new_profile: str | None = None     # the profile this login created (it did not exist)

    def finish(self, confirmed: bool) -> list[str]:
        """End the stage and the run (closes the window, reseals the profile). A login that
        was not confirmed leaves no empty profile behind: one it created is deleted."""
        problems: list[str] = []
        with contextlib.suppress(OpError):
            problems += self.run.end_stage("login", "succeeded" if confirmed else "cancelled")
        try:
            problems += self.run.end("succeeded" if confirmed else "cancelled")
        except OpError as exc:
            problems.append(f"ending the run failed: {exc}")
        if not confirmed and self.new_profile is not None:
            problems += drop_new_profile(self.run.client, self.new_profile)
        return problems


def drop_new_profile(client: GuardClient, name: str) -> list[str]:
    """Delete the empty profile an aborted login made; the problem, if any."""
    try:
        status, answer = client.call("DELETE", f"/v1/profiles/{name}")
    except GuardUnavailable as exc:
        return [f"the new profile {name} could not be removed: {exc}"]
    if status not in (200, 404):
        return [f"the new profile {name} could not be removed: {_error_of(status, answer)}"]
    return []


class ProfileOps:
    """`sfguard profiles check` and `sfguard profiles login` against the guard of `home`."""

    def __init__(self, home: Path, name: str, url: str, allow: list[str] | None = None):
        self.client = GuardClient(home)
        self.name, self.url = name, url
        try:
            page = policy.allow_pattern_for_url(url)
        except policy.MalformedHost as exc:
            raise OpError(f"{url!r} is not an http:// or https:// address with a valid host and "
                          f"port ({exc.reason})", "invalid_url") from None
        self.allow = [page] + [a.strip() for a in (allow or []) if a.strip()]
        try:
            policy.compile_patterns(self.allow, source="--allow")
        except policy.PolicyError as exc:
            raise OpError(str(exc), "invalid_pattern") from None

    def _browser(self, headed: bool) -> dict:
        return {"profile": self.name, "headed": headed, "allow_domains": self.allow}

    def _profile_exists(self) -> bool:
        try:
            status, answer = self.client.call("GET", "/v1/profiles")
        except GuardUnavailable as exc:
            raise GuardNotRunning(str(exc), "guard_unavailable") from None
        if status != 200:
            raise _error_of(status, answer)
        return any(p.get("name") == self.name for p in answer.get("profiles", []))

    def check(self, spec: dict, on_retry: Callable[[str], None] | None = None) -> dict:
        """{logged_in, url} computed by the guard in a short run of its own."""
        if not self._profile_exists():
            raise OpError(f"no profile {self.name!r} on this guard (create it with `sfguard profiles "
                          f"create {self.name}` or log in with `sfguard profiles login {self.name} "
                          "--url URL`)", "profile_not_found")
        with GuardRun(self.client, new_run_id("check")) as run:
            run.stage("check", self._browser(headed=False), wait=0)
            result = run.login_check(self.name, spec, on_retry)
            run.end_stage("check")
            run.end()
        return result

    def open_login_window(self, spec: dict | None = None) -> LoginWindow:
        """A run with a headed stage on the profile and a local_window handoff at the URL; on a
        guard without a screen, a headless stage and a live_view handoff (payload kind
        live_view, url = a one-time console link). HandoffRefused when neither can work."""
        new = None if self._profile_exists() else self.name
        run = GuardRun(self.client, new_run_id("login"))
        opened = False
        try:
            try:
                run.stage("login", self._browser(headed=True), wait=0)
            except OpError as exc:
                if exc.code != "no_display":
                    raise
                # The guard has no screen: a headless browser and a live view in its console
                # (kind auto), or, with its console off, a refusal that names the cause.
                run.stage("login", self._browser(headed=False), wait=0)
                payload = run.handoff(self.name, urlsplit(self.url).hostname or self.url,
                                      f"sfguard profiles login: sign in to profile {self.name}",
                                      self.url, "auto", "login", spec)
                if payload.get("kind") != "live_view":
                    raise HandoffRefused(str(exc), "no_display") from None
                window = LoginWindow(run, payload, new)
                opened = True
                return window
            payload = run.handoff(self.name, urlsplit(self.url).hostname or self.url,
                                  f"sfguard profiles login: sign in to profile {self.name}", self.url)
            opened = True
        finally:
            if not opened:      # a failure, or Ctrl-C: the run ends and a profile made for it goes
                with contextlib.suppress(OpError):
                    run.end("cancelled")
                if new is not None:
                    drop_new_profile(self.client, new)
        return LoginWindow(run, payload, new)


def guard_running(home: Path) -> bool:
    """True when a guard answers /v1/status on the socket of `home`."""
    try:
        status, _ = GuardClient(home, timeout=10).call("GET", "/v1/status")
    except (GuardUnavailable, OSError):
        return False
    return status == 200
