"""Pacing: how fast one logged-in account may use a site, and what a stage may spend.

The `pace` section of sites.yaml (read by policy/schema.py into `PaceRules`)::

    pace:
      - pattern: "*.shop.example"          # or patterns: [...]; host patterns as in block
        reason: "the shop locks accounts that browse faster than a person"
        page_loads_per_minute: 20          # pages opened in a tab (navigations)
        min_gap_s: 2                       # at least this long between two page loads
        requests_per_minute: 120           # requests the proxy sees (plain HTTP; HTTPS: connections)
        connections: 6                     # connections open at once
        burst: 3                           # events that may go at once before the pace applies
        over: wait                         # wait (up to max_wait_s, then 429) | refuse (429 at once)
        max_wait_s: 5

Limits apply per profile (the account) and per entry: every request to a host of the entry
counts on one counter of that profile, across runs, stages and guard hosts; a browser without
a profile has counters of its own. Every entry whose pattern matches a host applies, each on
its own counter. A stage's budget (`Budget`, the browser field) adds limits of the stage's
own: totals (page loads, requests, active minutes, then 429 until the stage ends) and rates
that can only be stricter, since the site's pace is counted as well.

Rates are a generic cell rate algorithm (GCRA): one number per counter, the time the next
event is due at the pace (`tat`). An event at `now` waits `max(tat, now) - (burst-1)*interval
- now` seconds (none when that is not positive); a wait over the limit's `max_wait` is refused
and changes nothing. So in any window of t seconds at most `burst + t/interval` events pass.
`admit` is that arithmetic, pure (time is passed in); the counter stores (proxy_addons/pacing.py,
supervisor/profiles/pg_pace.py) keep the numbers.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sfguard.policy.index import RuleSet

#: the limits of a pace entry, in the order explain shows them
LIMITS: tuple[str, ...] = ("page_loads_per_minute", "min_gap_s", "requests_per_minute", "connections")
OVER: tuple[str, ...] = ("wait", "refuse")
DEFAULT_MAX_WAIT = 5.0
#: the longest a request may be made to wait (a browser slows down, it does not time out)
MAX_WAIT_CAP = 30.0
#: a wait at least this long is a decision line (shorter ones only slow the request)
DELAY_LOGGED = 0.25
#: what a stage's budget may name (the browser field's `budget`)
BUDGET_TOTALS: tuple[str, ...] = ("page_loads", "requests", "active_minutes")
BUDGET_RATES: tuple[str, ...] = ("page_loads_per_minute", "requests_per_minute")


@dataclass(frozen=True)
class Rate:
    """One paced counter: `interval` seconds between two events at the pace, `burst` at once."""
    kind: str              # requests | page_loads | page_gap
    site: str              # the counter's site: the entry's patterns (a stage's own: "stage")
    interval: float
    burst: int
    over: str              # wait | refuse
    max_wait: float
    rule: str              # "sites.yaml:40 pace *.shop.example requests_per_minute 120"
    reason: str = "pace"   # pace (the site's) | budget (the stage's own)
    explanation: str = ""

    def key(self, who: str) -> str:
        """The counter of this limit for `who` (a profile, or a browser without one)."""
        return f"{who}|{self.kind}|{self.site}"

    @property
    def wait_limit(self) -> float:
        return 0.0 if self.over == "refuse" else self.max_wait


@dataclass(frozen=True)
class Total:
    """A stage's budget total: at most `limit` events while the stage lasts."""
    kind: str              # requests | page_loads
    limit: int
    rule: str              # "browser.budget.requests 500"
    explanation: str = ""
    reason: str = "budget"

    def key(self, who: str) -> str:
        return f"{who}|total|{self.kind}"


Limit = Rate | Total


@dataclass(frozen=True)
class Cap:
    """Connections open at once to a site's hosts, per profile."""
    site: str
    limit: int
    max_wait: float
    rule: str
    explanation: str = ""

    def key(self, who: str) -> str:
        return f"{who}|connections|{self.site}"


@dataclass(frozen=True)
class HostPace:
    """The pace of one host: its counters. Empty (falsy) where no entry matches."""
    requests: tuple[Rate, ...] = ()
    page_loads: tuple[Rate, ...] = ()
    connections: tuple[Cap, ...] = ()
    entries: tuple[PaceEntry, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)


NO_PACE = HostPace()


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


@dataclass(frozen=True)
class PaceEntry:
    """One entry of the `pace` section."""
    patterns: tuple[str, ...]
    hosts: RuleSet = field(repr=False)
    reason: str
    line: int
    label: str = "sites.yaml"
    page_loads_per_minute: float | None = None
    min_gap_s: float | None = None
    requests_per_minute: float | None = None
    connections: int | None = None
    burst: int = 1
    over: str = "wait"
    max_wait_s: float = DEFAULT_MAX_WAIT

    @property
    def site(self) -> str:
        return ",".join(self.patterns)

    def rule(self, limit: str | None = None) -> str:
        text = f"{self.label}:{self.line} pace {', '.join(self.patterns)}"
        if limit is not None:
            text += f" {limit} {_num(getattr(self, limit))}"
        return text

    def limits(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in LIMITS if getattr(self, k) is not None}

    def host_pace(self) -> HostPace:
        why = f"the site policy paces {', '.join(self.patterns)} ({self.reason})"
        requests: list[Rate] = []
        loads: list[Rate] = []
        caps: list[Cap] = []
        if self.requests_per_minute is not None:
            requests.append(Rate("requests", self.site, 60.0 / self.requests_per_minute, self.burst, self.over,
                                 self.max_wait_s, self.rule("requests_per_minute"),
                                 explanation=f"{why}: {_num(self.requests_per_minute)} requests a minute"))
        if self.page_loads_per_minute is not None:
            loads.append(Rate("page_loads", self.site, 60.0 / self.page_loads_per_minute, self.burst, self.over,
                              self.max_wait_s, self.rule("page_loads_per_minute"),
                              explanation=f"{why}: {_num(self.page_loads_per_minute)} page loads a minute"))
        if self.min_gap_s is not None:
            loads.append(Rate("page_gap", self.site, float(self.min_gap_s), 1, self.over, self.max_wait_s,
                              self.rule("min_gap_s"),
                              explanation=f"{why}: {_num(self.min_gap_s)} s between two page loads"))
        if self.connections is not None:
            caps.append(Cap(self.site, self.connections, 0.0 if self.over == "refuse" else self.max_wait_s,
                            self.rule("connections"),
                            explanation=f"{why}: {self.connections} connections open at once"))
        return HostPace(tuple(requests), tuple(loads), tuple(caps), (self,))


def merge(paces: Iterable[HostPace]) -> HostPace:
    out = NO_PACE
    for p in paces:
        out = HostPace(out.requests + p.requests, out.page_loads + p.page_loads,
                       out.connections + p.connections, out.entries + p.entries)
    return out


class PaceRules:
    """The site policy's `pace` section. Empty: nothing is paced."""

    def __init__(self, entries: Iterable[PaceEntry] = ()) -> None:
        self.entries: tuple[PaceEntry, ...] = tuple(entries)
        self._paces = {id(e): e.host_pace() for e in self.entries}
        self._cache: dict[tuple[str, int | None], HostPace] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def matching(self, host: str, port: int | None = None) -> list[PaceEntry]:
        is_ip = ":" in host or host.replace(".", "").isdigit()
        return [e for e in self.entries if e.hosts.match(host.strip("[]"), is_ip, port) is not None]

    def pace(self, host: str, port: int | None = None) -> HostPace:
        """Every counter a request to `host` (normalised) and `port` counts on (NO_PACE: none)."""
        if not self.entries:
            return NO_PACE
        key = (host, port)
        found = self._cache.get(key)
        if found is None:
            found = merge(self._paces[id(e)] for e in self.matching(host, port))
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = found
        return found

    def strictest(self, host: str, port: int | None = None) -> dict[str, tuple[float | int, str]]:
        """{limit: (value, rule)} over the entries for `host`: the smallest rate or cap, the
        longest gap; with `over`, `max_wait_s` and `burst` of the entry that set the tightest."""
        out: dict[str, tuple[float | int, str]] = {}
        for e in self.matching(host, port):
            for name, value in e.limits().items():
                old = out.get(name)
                tighter = value > old[0] if name == "min_gap_s" and old else old is None or value < old[0]
                if tighter:
                    out[name] = (value, e.rule(name))
        return out


def describe(entry: PaceEntry) -> str:
    """One entry's limits in words (`sfguard policy explain`)."""
    parts = []
    if entry.page_loads_per_minute is not None:
        parts.append(f"{_num(entry.page_loads_per_minute)} page loads a minute")
    if entry.min_gap_s is not None:
        parts.append(f"at least {_num(entry.min_gap_s)} s between page loads")
    if entry.requests_per_minute is not None:
        parts.append(f"{_num(entry.requests_per_minute)} requests a minute")
    if entry.connections is not None:
        parts.append(f"{entry.connections} connections at once")
    if entry.burst > 1:
        parts.append(f"{entry.burst} at once before the pace applies")
    over = ("429 at once" if entry.over == "refuse" else
            f"wait up to {_num(entry.max_wait_s)} s, then 429")
    return f"{', '.join(parts)}; over it: {over}"


def explain(rules: PaceRules, host: str, port: int | None = None) -> list[dict[str, object]]:
    """Every entry that paces `host`, as `policy explain --json` shows it (empty: none)."""
    return [{"rule": e.rule(), "patterns": list(e.patterns), "reason": e.reason, "limits": e.limits(),
             "burst": e.burst, "over": e.over, "max_wait_s": e.max_wait_s, "text": describe(e)}
            for e in rules.matching(host, port)]


# ------------------------------------------------------------------------------- budgets

@dataclass(frozen=True)
class Budget:
    """A stage's budget (the browser field's `budget`): totals for the stage's life and a pace
    of its own, which only adds to the site's (both are counted)."""
    page_loads: int | None = None
    requests: int | None = None
    active_minutes: float | None = None
    page_loads_per_minute: float | None = None
    requests_per_minute: float | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, k) is not None for k in BUDGET_TOTALS + BUDGET_RATES)

    def as_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in BUDGET_TOTALS + BUDGET_RATES if getattr(self, k) is not None}

    def limits(self, kind: str) -> tuple[Limit, ...]:
        """The stage's own limits on events of `kind` (requests | page_loads)."""
        out: list[Limit] = []
        total = getattr(self, kind)
        if total is not None:
            out.append(Total(kind, int(total), f"browser.budget.{kind} {total}",
                             f"this stage's budget allows {total} {kind.replace('_', ' ')} in all"))
        rate = getattr(self, f"{kind}_per_minute")
        if rate is not None:
            out.append(Rate(kind, "stage", 60.0 / rate, 1, "wait", DEFAULT_MAX_WAIT,
                            f"browser.budget.{kind}_per_minute {_num(rate)}", reason="budget",
                            explanation=f"this stage's budget allows {_num(rate)} {kind.replace('_', ' ')} a minute"))
        return tuple(out)


def effective(rules: PaceRules, budget: Budget | None, pattern_host: str,
              port: int | None = None) -> dict[str, object]:
    """What the stage answer shows for one allowed pattern's host: the site's strictest limits,
    tightened by the stage's own rates (never loosened), with the rules that set them."""
    site = rules.strictest(pattern_host, port)
    out: dict[str, object] = {name: value for name, (value, _rule) in site.items()}
    rule_of = {name: rule for name, (_value, rule) in site.items()}
    for name in BUDGET_RATES:
        mine = getattr(budget, name, None) if budget is not None else None
        if mine is not None and (name not in out or mine < float(out[name])):  # type: ignore[arg-type]
            out[name] = mine
            rule_of[name] = f"browser.budget.{name} {_num(mine)}"
    if out:
        out["rules"] = rule_of
    return out


# ------------------------------------------------------------------------------- admission

#: a counter's value: (a rate's due time `tat` and the interval it was counted at) or (a
#: total's count, 0)
State = tuple[float, float]


@dataclass(frozen=True)
class Admission:
    """What `admit` decided: go after `wait` seconds, or refused by `refused` (retry after
    `retry_after` seconds; None: not before the stage ends). `updates` are the counters' new
    values (when refused: only counters rescaled to an edited interval). `due`: how late the
    event is against the pace, the largest over its rates (negative: that much room left)."""
    wait: float
    refused: Limit | None = None
    retry_after: float | None = None
    updates: Mapping[str, State] = field(default_factory=dict)
    due: float = float("-inf")

    @property
    def ok(self) -> bool:
        return self.refused is None


def admit(states: Mapping[str, State], limits: Sequence[tuple[str, Limit]], now: float, *,
          force: bool = False) -> Admission:
    """One event on every limit at once, or on none. `states`: each counter's value (missing:
    never used), `limits`: (counter key, limit). A rate counted at another interval (the entry
    was edited) keeps its debt in events: the time it is ahead is scaled to the new interval,
    so an edit applies to the next event, looser or stricter.

    `force`: the event happened already (a page load the guard saw commit): every rate counts
    it, however late; a total over its limit is `refused` and not counted."""
    updates: dict[str, State] = {}
    rescaled: dict[str, State] = {}     # kept even when refused: the counter's new scale
    wait, worst = 0.0, float("-inf")
    refused: Limit | None = None
    for key, limit in limits:
        if isinstance(limit, Total):
            count = states.get(key, (0.0, 0.0))[0]
            if count >= limit.limit:
                if not force:
                    return Admission(0.0, limit, None, rescaled, worst)
                refused = limit
                continue
            updates[key] = (count + 1, 0.0)
            continue
        tat, was = states.get(key, (now, limit.interval))
        if tat > now and was > 0 and was != limit.interval:
            tat = now + (tat - now) * limit.interval / was
            rescaled[key] = (tat, limit.interval)
        start = max(tat, now, updates.get(key, (0.0, 0.0))[0] - limit.interval)
        due = start - (limit.burst - 1) * limit.interval - now
        worst = max(worst, due)
        if not force and due > limit.wait_limit + 1e-9:
            return Admission(0.0, limit, max(due, 0.0), rescaled, worst)
        updates[key] = (start + limit.interval, limit.interval)
        wait = max(wait, due, 0.0)
    return Admission(wait, refused, None, updates, worst)


def retry_text(seconds: float | None) -> str:
    if seconds is None:
        return "until this stage ends"
    return f"in {max(1, math.ceil(seconds))} s"
