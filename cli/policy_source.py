"""Which site policy `sfguard policy explain|validate|test` and `sfguard validate` check.

`--policy FILE` when given. Otherwise the policy the guard of the home enforces (`--home`, else
$SFGUARD_HOME, else ~/.stageflow/guard): a running guard is asked (GET /v1/status names its
policy file, `--policy` of its `sfguard start` or HOME/sites.yaml); with no guard running, the
home's own sites.yaml, which the next `sfguard start` will enforce; with neither, the shipped
template (policy/sites.yaml). The commands say which file they checked, and why, on stderr.
"""
from __future__ import annotations

import http.client
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicySource:
    path: str
    why: str

    def line(self) -> str:
        return f"sfguard: checked against the policy {self.path} ({self.why})"


def policy_source(policy_flag: str | None, home_flag: str | None) -> PolicySource:
    from sfguard import policy
    from sfguard.supervisor.client.guard_client import GuardClient, GuardUnavailable
    from sfguard.supervisor.home import home_policy_path, resolve_home

    if policy_flag:
        return PolicySource(policy_flag, "given with --policy")
    home = resolve_home(home_flag)
    if home.is_dir():
        try:
            status, body = GuardClient(home, timeout=10).call("GET", "/v1/status")
        except (GuardUnavailable, OSError, http.client.HTTPException):   # no (usable) guard there
            status, body = 0, None
        if status == 200 and isinstance(body, dict):
            file = (body.get("policy") or {}).get("file")
            if isinstance(file, str) and file:
                return PolicySource(file, f"the policy the guard running on {home} enforces")
        own = home_policy_path(home)
        if own.exists():
            return PolicySource(str(own), f"the policy of the guard home {home}; no guard runs there now")
    elif home_flag:
        from sfguard.cli.errors import CliError
        raise CliError(f"no guard home at {home} (check --home; `sfguard start --home {home_flag}` "
                       "makes one)", 2)
    return PolicySource(str(policy.default_policy_path()),
                        f"the shipped template: no guard home with a policy at {home}")
