"""sfguard's site policy: which hosts a guarded browser may reach, and why.

Pure code: no sockets, no processes, nothing of ours imported. The pieces:

- `policy.hosts`: host normalisation (`normalize_host`, `split_host_port`).
- `policy.patterns`: host patterns and public suffixes (`parse_pattern`, `Pattern`).
- `policy.index`: the rule index over parent domains (`RuleSet`, `Match`, `compile_patterns`).
- `policy.schema`: reading `sites.yaml` with file:line:col errors (`load_policy`, `parse_policy`),
  over `policy.yamltree` (YAML events into a tree that keeps positions) and `policy.yamlpos`.
- `policy.engine`: decisions (`SitePolicy.decide`, `check_address`, `refuse`, `Decision`).
- `policy.watch`: `PolicyWatcher`, the last good policy of a file that reviewers edit live.
- reviewer tools: `policy.lint` (warnings), `policy.casefile` (test cases), `policy.replay`
  (decision-log replay), `policy.diff` (rule diffs).

See docs/policy.md for the reviewer's guide and docs/design.md 4.1 for the contract.
"""
from sfguard.policy.engine import (
    DEFAULT_PORTS,
    METADATA_ADDRESSES,
    REVIEWER_ONLY,
    Decision,
    SitePolicy,
    special_address,
)
from sfguard.policy.errors import MalformedHost, PolicyError, PolicyIssue
from sfguard.policy.hosts import (
    allow_pattern_for_url,
    join_host_port,
    normalize_host,
    parse_resolve,
    split_host_port,
    url_host_port,
)
from sfguard.policy.index import Match, RuleSet, compile_patterns
from sfguard.policy.patterns import Pattern, PatternError, parse_pattern
from sfguard.policy.schema import MAX_POLICY_BYTES, default_policy_path, load_policy, parse_policy
from sfguard.policy.watch import PolicyWatcher

__all__ = [
    "allow_pattern_for_url", "join_host_port", "parse_resolve", "url_host_port",
    "DEFAULT_PORTS", "METADATA_ADDRESSES", "REVIEWER_ONLY", "Decision", "MAX_POLICY_BYTES",
    "MalformedHost", "Match", "Pattern",
    "PatternError", "PolicyError", "PolicyWatcher", "PolicyIssue", "RuleSet", "SitePolicy", "compile_patterns",
    "default_policy_path", "load_policy", "normalize_host", "parse_pattern", "parse_policy",
    "special_address", "split_host_port",
]
