"""Write gates: which requests change something on a site, and what happens to them.

A *write* is a request whose method is not GET or HEAD (a CORS preflight OPTIONS is a read), every
WebSocket upgrade, and any GET the site policy names as a write for that site. Everything else is
a read and passes. Each write gets one of three modes, from loosest to strictest:

  allow  sent as today;
  gate   held until a person approves or denies it (a timeout is a denial);
  deny   refused at once; the site never sees it.

The stage asks for a mode (`browser.writes`); the security reviewers set a floor per site in
sites.yaml (`writes`); the stricter of the two wins (`effective`), so a pipeline never loosens the
site policy. Pure: no I/O, every verdict names its reason, and the rule and line that decided.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: the write modes, loosest first
WRITE_MODES: tuple[str, ...] = ("allow", "gate", "deny")
#: methods that only read (OPTIONS only as a CORS preflight)
READ_METHODS = frozenset({"GET", "HEAD"})


def stricter(a: str, b: str) -> str:
    """The stricter of two write modes."""
    return a if WRITE_MODES.index(a) >= WRITE_MODES.index(b) else b


def check_mode(mode: str) -> str:
    if mode not in WRITE_MODES:
        raise ValueError(f"write mode is one of {', '.join(WRITE_MODES)}, not {mode!r}")
    return mode


@dataclass(frozen=True)
class WriteVerdict:
    """What happens to one request. `write` False means a read: it passes (`mode` allow)."""
    write: bool
    mode: str
    reason: str                 # read_method, cors_preflight, write_method, websocket_upgrade, ...
    rule: str | None = None     # the sites.yaml rule that decided, if one did
    line: int | None = None     # its line in sites.yaml
    explanation: str = ""

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class WriteRules:
    """The site policy's `writes` section: floors per site, and the exceptions (requests that
    only read although they POST; GETs that write). Empty: no floor, methods decide."""

    def judge(self, host: str, method: str, path: str, *, websocket: bool = False,
              preflight: bool = False) -> WriteVerdict:
        """The site's verdict for one request to `host` (normalised) with `method` and `path`."""
        m = method.upper()
        if websocket:
            return WriteVerdict(True, "allow", "websocket_upgrade", explanation="a WebSocket upgrade is a write")
        if m in READ_METHODS:
            return WriteVerdict(False, "allow", "read_method", explanation=f"{m} only reads")
        if m == "OPTIONS" and preflight:
            return WriteVerdict(False, "allow", "cors_preflight", explanation="a CORS preflight only asks")
        return WriteVerdict(True, "allow", "write_method", explanation=f"{m} is a write")


def effective(stage_mode: str, site: WriteVerdict) -> WriteVerdict:
    """The verdict once the stage's mode is applied: the stricter of the stage's and the site's."""
    check_mode(stage_mode)
    if not site.write:
        return site
    mode = stricter(stage_mode, site.mode)
    if mode == site.mode:
        return site
    return dataclasses.replace(site, mode=mode, reason="stage_mode", rule=None, line=None,
                               explanation=f"{site.explanation}; the stage asks for writes: {stage_mode}")
