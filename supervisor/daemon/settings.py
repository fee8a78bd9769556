"""What `sfguard start` decides once, from its flags: one typed, frozen object the Guard is built
with. Nothing changes it afterwards; what the guard learns while it runs (its pool of browser
users, the sandbox check, the API's TCP port, the console) is its own state, set in daemon/."""
from __future__ import annotations

from dataclasses import dataclass, field

from sfguard.supervisor.browsers.browser_pool import PoolConfig
from sfguard.supervisor.daemon.log_rotation import Retention
from sfguard.supervisor.record.recorder import RecordSettings
from sfguard.supervisor.stage.sandbox import DEFAULT_STAGE_USER
from sfguard.supervisor.writes.intercept import DEFAULT_TIMEOUT as WRITE_GATE_TIMEOUT

#: ended runs stay in memory (status, the console, GET) for the newest KEEP_ENDED_RUNS and at
#: most KEEP_ENDED_SECONDS (`sfguard start --keep-ended-runs/--keep-ended-hours`); then only
#: their record on disk is left
KEEP_ENDED_RUNS = 200
KEEP_ENDED_SECONDS = 24 * 3600.0


#: `sfguard start --proxies`: the choices, and the default (the environment variable
#: SFGUARD_PROXIES gives another default, e.g. to run a test suite in the other mode)
PROXIES_CHOICES = ("per-run", "shared")
PROXIES_DEFAULT = "per-run"


@dataclass(frozen=True)
class GuardSettings:
    keep_ended_runs: int = KEEP_ENDED_RUNS
    keep_ended_seconds: float = KEEP_ENDED_SECONDS
    #: how long a held write waits for a person before it is refused (--write-gate-timeout)
    write_gate_timeout: float = WRITE_GATE_TIMEOUT
    #: the decision log's rotation (--log-max-mb, --log-max-age, --log-keep)
    log_retention: Retention = field(default_factory=Retention)
    #: the group given the control socket and the home (--api-group), as a gid
    api_gid: int | None = None
    #: under root: the user stages run as (--stage-user), and the pool of users browsers run as,
    #: one per running browser (--browser-users PREFIX, --browser-pool-size N)
    stage_user_name: str = DEFAULT_STAGE_USER
    browser_pool: PoolConfig = field(default_factory=PoolConfig)
    #: "per-run": a proxy process per run; "shared": one proxy process serves every run, each
    #: with its own listener and credentials (--proxies; docs/design.md 4.2)
    proxies: str = PROXIES_DEFAULT
    #: how often the running guard verifies the audit chain again, in seconds (--audit-check)
    audit_check_seconds: float = 300.0
    #: the run records: level, retention, size caps, screenshots (--record, --record-*)
    record: RecordSettings = field(default_factory=RecordSettings)
