"""The effective write mode of a stage per allowed host pattern: the stricter of the stage's
`browser.writes` and the site policy's floor for that host (policy.writes.effective)."""
from __future__ import annotations

from typing import Any

from sfguard.policy.hosts import split_host_port_raw
from sfguard.policy.writes import WriteRules, effective


def stage_write_modes(site_policy: Any, stage_mode: str, patterns: list[str]) -> dict[str, str]:
    """{pattern: mode} for the stage's allow_domains (what the runner tells the agent)."""
    rules = getattr(site_policy, "writes", None) or WriteRules()
    out: dict[str, str] = {}
    for pattern in patterns:
        try:
            host = split_host_port_raw(pattern)[0]
        except ValueError:
            host = pattern
        host = host[2:] if host.startswith("*.") else host
        out[pattern] = effective(stage_mode, rules.judge(host, "POST", "/")).mode
    return out
