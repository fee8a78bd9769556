"""Warnings about a valid policy: entries that do nothing a reviewer meant them to do.

`lint_policy` reads a policy that `load_policy` accepts and lists, each at file:line:col with
the field and a hint:

- duplicate entries: the same pattern (after normalisation) twice in `allow_always`, `quiet`,
  `private_networks.allow`, or anywhere in `block` (every group counts as one list);
- shadowed `allow_always` entries: a `block` rule matches the entry's host on a port the entry
  is meant for, so the block wins (the decision order puts `block` first) and the entry is
  dead for that port;
- special addresses that do nothing: an `allow_always` IP or CIDR of a special-purpose range
  that `private_networks.allow` does not open, and a `private_networks.allow` range over
  link-local or cloud metadata addresses (those open only as the exact address).

Warnings do not make a policy invalid: `sfguard policy validate` lists them and exits 0, and
`--strict` turns them into errors.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sfguard.policy.engine import LINK_LOCAL, METADATA_ADDRESSES, SitePolicy
from sfguard.policy.errors import PolicyIssue
from sfguard.policy.hosts import join_host_port
from sfguard.policy.patterns import PLAIN_NAME, Pattern, PatternError, parse_pattern
from sfguard.policy.schema import load_policy
from sfguard.policy.yamltree import Composer, YMap, YSeq, unpack


def lint_policy(path: str | Path | None = None) -> tuple[SitePolicy, list[PolicyIssue]]:
    """Load the policy (raises PolicyError when invalid) and return it with its warnings."""
    site = load_policy(path)
    text = Path(site.source).read_text(encoding="utf-8-sig")
    return site, lint_text(site, text)


def lint_text(site: SitePolicy, text: str) -> list[PolicyIssue]:
    """Warnings for policy `text`, already accepted as `site`."""
    root = Composer(site.source).compose(text)
    if not isinstance(root, YMap):
        return []
    warnings: list[PolicyIssue] = []
    lists: dict[str, list[tuple[Any, int, str]]] = {
        "allow_always": list(_items(root.get("allow_always"), "allow_always")),
        "quiet": list(_items(root.get("quiet"), "quiet")),
        "block": [],
        "private_networks.allow": [],
    }
    block = root.get("block")
    if isinstance(block, YSeq):
        for i, entry in enumerate(block):
            if not isinstance(entry, YMap):
                continue
            if "pattern" in entry:
                pos = entry.valpos.get("pattern", entry.pos)
                lists["block"].append((entry["pattern"], pos, f"block[{i}].pattern"))
            lists["block"] += _items(entry.get("patterns"), f"block[{i}].patterns")
    networks = root.get("private_networks")
    if isinstance(networks, YMap):
        lists["private_networks.allow"] = list(
            _items(networks.get("allow"), "private_networks.allow"))

    for name, items in lists.items():
        seen: dict[tuple[str | int | None, ...], str] = {}
        for text_, pos, field in items:
            key = _key(text_, allow_list=name != "block" and name != "quiet")
            if key is None:
                continue
            first = seen.get(key)
            if first is None:
                seen[key] = field
                continue
            warnings.append(_warn(site, pos, field, f"duplicate entry {_short(text_)}: "
                                  f"{first} already says the same",
                                  "remove one of them"))

    for text_, pos, field in lists["allow_always"]:
        pattern = _pattern(text_)
        if pattern is None or pattern.kind == "cidr":
            continue
        host, is_ip = pattern.key, pattern.kind == "ip"
        ports = [pattern.port] if pattern.port is not None else sorted(site.ports)
        hits = []
        for port in ports:
            m = site.block.match(host, is_ip, port)
            if m is not None:
                hits.append((port, m.rule))
        if not hits:
            continue
        rules = sorted({rule for _port, rule in hits})
        shown = ", ".join(str(port) for port, _rule in hits)
        scope = "the block list wins" if len(hits) == len(ports) else f"for port(s) {shown}"
        what = "subdomains may still be allowed" if pattern.kind == "wild" else "it never allows"
        warnings.append(_warn(
            site, pos, field,
            f"{_short(text_)} is shadowed by block rule {'; '.join(rules)} ({scope}; "
            f"block is checked first)",
            f"remove the entry or the block rule ({what} {host} on port {shown})"))
    warnings += _special_warnings(site, lists)
    warnings.sort(key=lambda w: (w.line or 0, w.col or 0))
    return warnings


def _special_warnings(site: SitePolicy, lists: dict[str, list[tuple[Any, int, str]]]) -> list[PolicyIssue]:
    """Special addresses the reviewer listed where they do nothing: an allow_always IP or CIDR
    that private_networks.allow does not open (it allows nothing), and a private_networks.allow
    range over link-local or cloud metadata addresses (those open only as exact addresses)."""
    out: list[PolicyIssue] = []
    for text_, pos, field in lists["allow_always"]:
        pattern = _pattern(text_)
        if pattern is None or pattern.network is None:
            continue
        why = site.run_pattern_refusal(pattern)
        if why is not None:
            out.append(_warn(site, pos, field, f"{_short(text_)} allows nothing: {why}",
                             "list it in private_networks.allow too, or remove it"))
    for text_, pos, field in lists["private_networks.allow"]:
        pattern = _pattern(text_)
        net = pattern.network if pattern is not None else None
        if net is None or net.num_addresses == 1:
            continue
        held = [str(a) for a in sorted(METADATA_ADDRESSES, key=str)
                if a.version == net.version and a in net]
        example = held[0] if held else "169.254.169.254"
        if any(net.overlaps(b) for b in LINK_LOCAL if b.version == net.version):
            held.insert(0, "link-local addresses")
        if held:
            out.append(_warn(site, pos, field,
                             f"{_short(text_)} does not open {', '.join(held)}: link-local and "
                             "cloud metadata addresses open only through an entry that is the "
                             "exact address",
                             f"list the one address you mean, e.g. - {example}"))
    return out


def _items(seq: Any, field: str) -> Iterator[tuple[Any, int, str]]:
    if isinstance(seq, YSeq):
        for i, text in enumerate(seq):
            yield text, seq.itempos[i], f"{field}[{i}]"


def _pattern(text: Any, allow_list: bool = True) -> Pattern | None:
    if not isinstance(text, str):
        return None
    try:
        return parse_pattern(text, allow_list=allow_list)
    except PatternError:
        return None


def _key(text: Any, allow_list: bool) -> tuple[str | int | None, ...] | None:
    if isinstance(text, str) and len(text) <= 253 and PLAIN_NAME(text) is not None \
            and "xn--" not in text:
        return ("fast", text)  # already canonical: the text is the key (no parse per entry)
    pattern = _pattern(text, allow_list)
    if pattern is None:
        return None
    if pattern.kind == "name" or pattern.kind == "wild":
        body = ("*." if pattern.kind == "wild" else "") + pattern.key
        return ("fast", join_host_port(body, pattern.port))
    return (pattern.kind, pattern.key, pattern.port)


def _warn(site: SitePolicy, pos: int, field: str, message: str, hint: str) -> PolicyIssue:
    line, col = unpack(pos)
    return PolicyIssue(site.source, line, col, field, message, hint)


def _short(text: Any) -> str:
    text = text if isinstance(text, str) else repr(text)
    return repr(text if len(text) <= 120 else text[:120] + "...")
