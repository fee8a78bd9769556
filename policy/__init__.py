"""sfguard's site policy: which hosts a guarded browser may reach, and why.

Pure code: no sockets, no processes, nothing of ours imported. The pieces:

- `policy.hosts`: host normalisation (`normalize_host`, `split_host_port`).
- `policy.patterns`: host patterns and the suffix index (`compile_patterns`, `RuleSet`).
- `policy.schema`: reading `sites.yaml` with file:line:col errors (`load_policy`, `parse_policy`).
- `policy.engine`: decisions (`SitePolicy.decide`, `check_address`, `refuse`, `Decision`).
- `policy.watch`: `PolicyWatcher`, the last good policy of a file that reviewers edit live.

See docs/policy.md for the reviewer's guide and docs/design.md 4.1 for the contract.
"""
from sfguard.policy.engine import DEFAULT_PORTS, Decision, SitePolicy, special_address
from sfguard.policy.errors import MalformedHost, PolicyError, PolicyIssue
from sfguard.policy.hosts import allow_pattern_for_url, join_host_port, normalize_host, split_host_port, url_host_port
from sfguard.policy.patterns import Match, Pattern, PatternError, RuleSet, compile_patterns, parse_pattern
from sfguard.policy.schema import MAX_POLICY_BYTES, default_policy_path, load_policy, parse_policy
from sfguard.policy.watch import PolicyWatcher

__all__ = [
    "allow_pattern_for_url", "join_host_port", "url_host_port",
    "DEFAULT_PORTS", "Decision", "MAX_POLICY_BYTES", "MalformedHost", "Match", "Pattern",
    "PatternError", "PolicyError", "PolicyWatcher", "PolicyIssue", "RuleSet", "SitePolicy", "compile_patterns",
    "default_policy_path", "load_policy", "normalize_host", "parse_pattern", "parse_policy",
    "special_address", "split_host_port",
]
