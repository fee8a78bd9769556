"""The demo's pipeline runner: plays the runner of the validated example pipeline, one run at a
time, and the stage worker of each stage (`StageSide`: agent-browser with only the env the guard
returned). Used by `run_demo` (supervisor/demo/run.py); talks to the guard only through
supervisor/client/ops.py.

It never prints a cookie value, a token or a password: cookies are compared by the fixture
site's markers (the first 8 hex digits of sha256(value)).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from sfguard.errors import SfguardError
from sfguard.supervisor.browsers import tools
from sfguard.supervisor.client.guard_client import GuardClient
from sfguard.supervisor.client.ops import GuardRun, HandoffRefused, OpError, new_run_id

#: The fixture site's default login (fixtures/login_server); $SFGUARD_FIXTURE_USER/_PASSWORD
#: override both the site's and the demo's (the demo passes its environment to the site).
FIXTURE_USER, FIXTURE_PASSWORD = "operator", "correct-horse"
AB_TIMEOUT_S = 60.0          # one agent-browser command of the stage side
MAX_LOGIN_ATTEMPTS = 3


class DemoError(SfguardError):
    """The demo could not complete; str() says why (no traceback for the user)."""


class StageSide:
    """Runs agent-browser as a stage worker would: with ONLY the env the guard returned, plus
    PATH and an empty per-demo HOME."""

    def __init__(self, env: dict[str, str], home: Path):
        ab = tools.find_agent_browser()
        if ab.path is None:
            raise DemoError(f"agent-browser is missing ({ab.hint}); run ./dev setup")
        self.ab = ab.path
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **env}

    def run(self, *args: str, check: bool = True) -> str:
        try:
            r = subprocess.run([self.ab, *args], env=self.env, capture_output=True, text=True,
                               timeout=AB_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise DemoError(f"agent-browser {args[0]} did not finish within {AB_TIMEOUT_S:.0f} s") from None
        if check and r.returncode != 0:
            # agent-browser's message, without the arguments (a fill value stays out of it)
            msg = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DemoError(f"agent-browser {args[0]} failed: {msg[0][:300]}")
        return r.stdout.strip()


_MARKER = re.compile(r"\b(sf_[a-z_]+)\s+([0-9a-f]{8})\b")


def read_markers(stage: StageSide, origin: str) -> dict[str, str]:
    """Cookie name -> marker, as the fixture site's /cookies page shows them (never values)."""
    stage.run("open", f"{origin}/cookies")
    return dict(_MARKER.findall(stage.run("get", "text", "#cookies")))


@dataclass
class RunReport:
    run_id: str
    executed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    check: dict | None = None
    login_ran: bool = False
    login_by: str | None = None        # "operator (window)" | "demo (headless, no display)"
    heading: str | None = None
    markers: dict[str, str] = field(default_factory=dict)


def _gate(st) -> dict:
    """A stage's gate as plain data (the validator keeps the YAML node, aliases resolved here)."""
    if st.gate is None:
        return {}
    data = st.gate if isinstance(st.gate, dict) else yaml.safe_load(yaml.serialize(st.gate))
    return data if isinstance(data, dict) else {}


def _cond_fires(cond: str | None, output: dict) -> bool:
    if not cond:
        return True
    m = re.fullmatch(r"\s*([A-Za-z_][\w.]*)\s*(eq|ne|==|!=)\s*(\S+)\s*", cond)
    if not m:
        raise DemoError(f"the demo runner does not understand the condition {cond!r}")
    name, op, want = m.groups()
    have = output.get(name)
    have_s = str(have).lower() if isinstance(have, bool) else str(have)
    equal = have_s == want.strip("'\"")
    return equal if op in ("eq", "==") else not equal


class DemoRunner:
    """Plays the pipeline runner for the validated example pipeline, one run at a time."""

    def __init__(self, client: GuardClient, report, pipeline_src: Path, stage_home: Path,
                 say: Callable[[str], None], interactive: bool, auto_login: bool = False,
                 site_origin: str | None = None):
        self.client, self.stages, self.say = client, report.stages, say
        self.site_origin = site_origin
        self.pipeline_src, self.stage_home = pipeline_src, stage_home
        self.interactive = interactive
        self.auto_login = auto_login
        self.headless_fallback = False
        self.user = os.environ.get("SFGUARD_FIXTURE_USER") or FIXTURE_USER
        self.password = os.environ.get("SFGUARD_FIXTURE_PASSWORD") or FIXTURE_PASSWORD

    # The stage order is the pipeline's; a stage runs when it is the first one or when a route
    # from a stage that ran fires (routes from skipped stages do not block a join: topology A).
    def run(self, n: int) -> RunReport:
        rep = RunReport(new_run_id(f"demo-{n}"))
        self.say(f"== run {n} ({rep.run_id}) ==")
        fired: set[str] = set()
        with GuardRun(self.client, rep.run_id, pipeline=str(self.pipeline_src)) as run:
            for i, st in enumerate(self.stages):
                if i > 0 and st.id not in fired:
                    rep.skipped.append(st.id)
                    self.say(f"[{st.id}] skipped: no route into it fired")
                    continue
                output = self._stage(run, st, rep)
                rep.executed.append(st.id)
                for r in st.routes:
                    ok = _cond_fires(r.cond, output)
                    why = f" (if {r.cond}: {'true' if ok else 'false'})" if r.cond else ""
                    self.say(f"[route] {st.id} -> {r.target}{why}{'' if ok else ': not taken'}")
                    if ok:
                        fired.add(r.target)
            problems = run.end("succeeded")
            self.say("[run] ended: the guard closed the browser and resealed the profile"
                     + (f" (problems: {'; '.join(problems)})" if problems else ""))
        return rep

    def _browser(self, st) -> dict:
        b = st.browser.model_dump(exclude_none=True)
        if self.headless_fallback:
            b["headed"] = False
        return b

    def _request(self, run: GuardRun, st, attempt: int) -> StageSide:
        try:
            env = run.stage(st.id, self._browser(st), attempt)
        except OpError as exc:
            if exc.code != "no_display" or self.headless_fallback:
                raise
            self.headless_fallback = True
            self.say(f"[{st.id}] the guard has no display ({exc}); the demo runs every stage "
                     "headless (headed: false)")
            env = run.stage(st.id, self._browser(st), attempt)
        b = st.browser
        self.say(f"[{st.id}] stage ready: profile {b.profile}, allow_domains {b.allow_domains}, "
                 f"env {sorted(env)}")
        return StageSide(env, self.stage_home)

    def _stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        if st.browser is None:
            self.say(f"[{st.id}] no browser: nothing for the guard to do")
            return {}
        if _gate(st).get("handoff"):
            return self._login_stage(run, st, rep)
        if st.browser.login_check is not None:
            return self._check_stage(run, st, rep)
        return self._work_stage(run, st, rep)

    def _check_stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        self._request(run, st, 1)
        spec = st.browser.login_check.model_dump(exclude_none=True)
        result = run.login_check(st.browser.profile, spec, on_retry=lambda m: self.say(f"[{st.id}] {m}"))
        rep.check = result
        self.say(f"[{st.id}] guard login check of {spec['url']}: logged_in={str(result['logged_in']).lower()}, "
                 f"final address {result['url']}")
        # The stage agent reports the guard's result in its envelope; the runner has the guard
        # compare it with its own (a made-up envelope would be refused with 409).
        run.verify(st.browser.profile, result)
        self.say(f"[{st.id}] envelope {{logged_in: {str(result['logged_in']).lower()}}} verified by the guard")
        run.end_stage(st.id)
        return result

    def _login_stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        rep.login_ran = True
        spec = st.browser.login_check.model_dump(exclude_none=True)
        gate = _gate(st)
        handoff = gate["handoff"]
        for attempt in range(1, MAX_LOGIN_ATTEMPTS + 1):
            stage = self._request(run, st, attempt)
            self.say(f"[{st.id}] gate: {gate.get('message', 'confirm')}")
            confirmed = "gate confirmed"
            try:
                kind = "live_view" if handoff.get("kind") == "live_view" else "auto"
                payload = run.handoff(st.browser.profile, str(handoff.get("site")),
                                      str(handoff.get("reason")), spec["url"], kind, st.id)
                if payload["kind"] == "live_view":
                    if not self._live_view(run, st, payload, rep):
                        raise DemoError("the login was cancelled in the live view")
                    confirmed = "gate confirmed (Done in the live view)"
                else:
                    self._window_handoff(st, stage, spec, payload, rep)
            except HandoffRefused as exc:
                self.say(f"[{st.id}] handoff refused by the guard: {exc}")
                self.say(f"[{st.id}] the demo plays the operator instead, headless, through this "
                         "stage's own agent-browser env (open the login page, fill, click)")
                self._play_operator(stage, spec["url"])
                rep.login_by = "the demo, headless (no display for a login window)"
            self.say(f"[{st.id}] {confirmed}")
            # verify: login_check -- the guard checks the login again after the confirm
            result = run.login_check(st.browser.profile, spec, on_retry=lambda m: self.say(f"[{st.id}] {m}"))
            self.say(f"[{st.id}] verify: guard login check says logged_in={str(result['logged_in']).lower()} "
                     f"({result['url']})")
            run.end_stage(st.id, "succeeded" if result["logged_in"] else "failed")
            if result["logged_in"]:
                return result
            if st.on_verify_fail != st.id:
                raise DemoError(f"the login was not confirmed by the guard ({result['url']})")
            self.say(f"[{st.id}] on_verify_fail: back to {st.id}")
        raise DemoError(f"no login after {MAX_LOGIN_ATTEMPTS} attempts")

    def _window_handoff(self, st, stage: StageSide, spec: dict, payload: dict, rep: RunReport) -> None:
        """A visible login window on the guard's screen: the operator logs in (or, with no one
        at the terminal, the demo plays the operator in that window)."""
        self.say(f"[{st.id}] handoff: {payload['kind']} for {payload['site']} at {payload.get('url')}")
        if self.interactive:
            self.say(f"[{st.id}] log in as user {self.user!r} in the browser window, then press "
                     "Enter here (Ctrl-D aborts)")
            if sys.stdin.readline() == "":
                raise DemoError("aborted at the login gate")
            rep.login_by = "the operator, in the visible window"
        else:
            self.say(f"[{st.id}] no one at the terminal: the demo plays the operator in the window")
            self._play_operator(stage, spec["url"])
            rep.login_by = "the demo, in the visible window (no terminal)"

    def _live_view(self, run: GuardRun, st, payload: dict, rep: RunReport) -> bool:
        """The guard has no screen: its console shows the login tab at a one-time link. With
        --auto-login a scripted person (a separate, unguarded headless Chromium) signs in
        through that page; otherwise a person opens the link. True when Done was pressed."""
        url = payload["url"]
        shown = url.split("?", 1)[0]
        if self.auto_login:
            self.say(f"[{st.id}] handoff: live_view for {payload['site']} at {shown} (one-time "
                     "link given to the scripted person, not printed)")
            import asyncio

            from sfguard.supervisor.console.viewer import ViewerError, scripted_login
            try:
                out = asyncio.run(scripted_login(url, self.user, self.password, say=self.say))
            except ViewerError as exc:
                raise DemoError(f"the scripted person could not log in through the live view: {exc}") from None
            self.say(f"[person] pressed Done; the page says: {out['result']}")
            self._say_how_the_form_was_sent()
            rep.login_by = "a scripted person, through the live view (a separate headless browser)"
        else:
            self.say(f"[{st.id}] handoff: live_view for {payload['site']}. Open this one-time "
                     f"link in a browser, sign in as user {self.user!r}, then press Done:")
            self.say(f"    {url}")
            rep.login_by = "the operator, through the live view"
        state = run.wait_handoff()
        self.say(f"[{st.id}] live view ended: {state['state']}")
        return state["state"] == "done"

    def _say_how_the_form_was_sent(self) -> None:
        """What the fixture site saw of its sign-in form (its /submits.json: how each POST was
        sent, by a click on the button or by the keyboard; never the user or password)."""
        if not self.site_origin:
            return
        import json
        import urllib.request
        try:
            with urllib.request.urlopen(f"{self.site_origin}/submits.json", timeout=10) as r:
                submits = json.load(r).get("submits") or []
        except (OSError, ValueError):
            self.say("[site] could not read how the sign-in form was sent")
            return
        vias = ", ".join(str(x.get("via")) for x in submits) or "none"
        self.say(f"[site] sign-in form posts so far, sent by: {vias}")

    def _play_operator(self, stage: StageSide, url: str) -> None:
        stage.run("open", url)
        stage.run("fill", "input[name=user]", self.user)
        stage.run("fill", "input[name=password]", self.password)
        stage.run("click", "button[type=submit]")
        stage.run("wait", "1000", check=False)
        self.say(f"[operator] signed in; the page is now {stage.run('get', 'url')}")

    def _work_stage(self, run: GuardRun, st, rep: RunReport) -> dict:
        stage = self._request(run, st, 1)
        check = next((s.browser.login_check for s in self.stages
                      if s.browser and s.browser.profile == st.browser.profile and s.browser.login_check), None)
        if check is None:
            raise DemoError(f"stage {st.id}: no login_check names the page to read")
        page = urlsplit(check.url)
        origin = f"{page.scheme}://{page.netloc}"
        stage.run("open", check.url)
        rep.heading = stage.run("get", "text", "h1")
        self.say(f"[{st.id}] opened {check.url}: heading {rep.heading!r}")
        rep.markers = read_markers(stage, origin)
        shown = ", ".join(f"{k} (marker {v})" for k, v in sorted(rep.markers.items())) or "none"
        self.say(f"[{st.id}] cookies the site received: {shown}")
        run.end_stage(st.id)
        return {}
