"""A run record as a person reads it: one line per entry in the order things happened, each
with its pictures and its links, filtered by stage, kind or refusals. Used by the console's run
page, `sfguard runs show` and the export's static page. Pure: entries in, rows out.
"""
from __future__ import annotations

import time
from typing import Any

#: what the kind filter offers (the entry kinds a person asks for)
KINDS = ("command", "navigated", "loaded", "screenshot", "proxy", "write", "stage", "login_check",
         "handoff", "console", "lease", "run")
DECISIONS = frozenset({"proxy", "write", "level", "record_capped"})


def _ts(entry: dict[str, Any]) -> str:
    return str(entry.get("ts") or "")


def kind_of(entry: dict[str, Any]) -> str:
    """The filter group of an entry: `stage_ready` is a stage entry, `run_started` a run one."""
    kind = str(entry.get("kind") or "")
    return kind.split("_", 1)[0] if kind.startswith(("stage_", "run_")) else kind


def refused(entry: dict[str, Any]) -> bool:
    """A refusal of the guard: a command the gate refused, a proxy denial, a write refused or
    denied, timed out or cancelled (none of those was sent)."""
    kind = entry.get("kind")
    if kind == "command":
        return bool(entry.get("refused"))
    if kind == "proxy":
        return str(entry.get("verdict") or "") not in ("allow",) and not str(entry.get("reason", "")).startswith(
            "would_deny")
    if kind == "write":
        return entry.get("verdict") in ("refused", "denied", "timed_out", "cancelled")
    return False


def _where(e: dict[str, Any]) -> str:
    host = str(e.get("host") or "")
    port = e.get("port")
    return host + (f":{port}" if port not in (None, 80, 443) else "") + str(e.get("path") or "")


def describe(e: dict[str, Any]) -> str:
    """One line of what an entry says."""
    kind = str(e.get("kind") or "")
    if kind == "command":
        if "chars" in e and e.get("method") == "Input.insertText":
            what = (f"typed {e['chars']} characters into {e.get('field', '(unknown field)')}"
                    + (f": {e['text']!r}" if "text" in e else " (secret: value not kept)"))
        else:
            bits = [str(e.get(k)) for k in ("url", "script", "key", "type", "behavior") if e.get(k)]
            if "x" in e and "y" in e:
                bits.append(f"at {e['x']},{e['y']}")
            what = " ".join([str(e.get("method") or "")] + bits)
        if e.get("refused"):
            return f"{what} REFUSED by the gate: {e['refused']}"
        return what + (" (answered by the gate: write held)" if e.get("answer") else "") + (
            " [guard's setup]" if e.get("phase") == "setup" else "")
    if kind == "navigated":
        return ("could not load " if e.get("failed") else "navigated to ") + str(e.get("url") or "")
    if kind == "loaded":
        return f"loaded {e.get('url') or ''}"
    if kind == "screenshot":
        return f"screenshot ({e.get('why')})" + (f" of {e['url']}" if e.get("url") else "")
    if kind == "proxy":
        if e.get("reason") == "quiet_denials":
            return f"proxy denied {e.get('count')} background requests (quiet)"
        return f"proxy {e.get('verdict')} {e.get('method') or ''} {_where(e)} ({e.get('reason')})".replace("  ", " ")
    if kind == "write":
        who = f" by {e['by']}" if e.get("by") else ""
        why = e.get("why") or e.get("reason") or ""
        ap = f" approval {e['approval']}" if e.get("approval") else ""
        return f"write {e.get('verdict')}: {e.get('method')} {_where(e)} ({why}){ap}{who}"
    if kind.startswith("stage_"):
        extra = " ".join(f"{k}={e[k]}" for k in ("profile", "outcome", "error", "holder_run") if e.get(k))
        return f"stage {e.get('stage')} (attempt {e.get('attempt')}) {kind[6:]}" + (f": {extra}" if extra else "")
    if kind in ("run_started", "run_ended"):
        return f"run {kind[4:]}" + (f": {e['outcome']}" if e.get("outcome") else "")
    if kind == "level":
        return f"recording {e.get('level')} for " + (str(e["host"]) if e.get("host") else "a site (sites.yaml)")
    if kind == "record_capped":
        return "the record reached its size cap: only decisions are kept from here"
    fields = " ".join(f"{k}={e[k]}" for k in ("event", "profile", "host", "result", "outcome", "by", "mode")
                      if e.get(k) not in (None, ""))
    return f"{kind}: {fields}"


def rows(entries: list[dict[str, Any]], *, stage: str | None = None, kind: str | None = None,
         only_refused: bool = False, fold: bool = True) -> list[dict[str, Any]]:
    """Entries as rows, in the order things happened (monotonic time, then seq), with the
    pictures that show each and the entries linked to it both ways; `fold`: the same plain
    command sent again at once is one row with its `repeat` count."""
    order = sorted(entries, key=lambda e: (float(e.get("t") or 0), int(e.get("seq") or 0)))
    shots: dict[int, list[str]] = {}
    back: dict[int, list[int]] = {}
    for e in order:
        links = e.get("links") or {}
        seq = int(e.get("seq") or 0)
        if e.get("kind") == "screenshot" and isinstance(links.get("for"), int):
            shots.setdefault(links["for"], []).append(str(e.get("shot")))
        for target in (links.get("command"), links.get("held"), links.get("for")):
            if isinstance(target, int):
                back.setdefault(target, []).append(seq)
    t0 = float(order[0].get("t") or 0) if order else 0.0
    out: list[dict[str, Any]] = []
    for e in order:
        seq = int(e.get("seq") or 0)
        if stage and e.get("stage") != stage:
            continue
        if kind and kind_of(e) != kind:
            continue
        if only_refused and not refused(e):
            continue
        links = e.get("links") or {}
        own = [str(links["shot"])] if links.get("shot") else []
        if e.get("kind") == "screenshot":
            own = [str(e.get("shot"))]
        row = {"seq": seq, "ts": _ts(e), "at": round(float(e.get("t") or 0) - t0, 3),
                    "kind": str(e.get("kind")), "group": kind_of(e), "stage": e.get("stage") or "",
                    "text": describe(e), "refused": refused(e), "decision": kind_of(e) in DECISIONS,
                    "shots": own + shots.get(seq, []) if e.get("kind") != "screenshot" else own,
                    "to": [v for k, v in links.items() if k in ("command", "held", "for") and isinstance(v, int)],
                    "from": back.get(seq, []), "repeat": 1}
        if fold and out and _same(out[-1], row):
            out[-1]["repeat"] += 1        # the same command again (agent-browser's liveness checks)
            continue
        out.append(row)
    if kind == "screenshot":
        return out
    shown = {r["seq"] for r in out}        # a picture stands beside what it shows, not on its own
    return [r for r in out if not (r["kind"] == "screenshot" and r["to"] and r["to"][0] in shown)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two rows one line can stand for: the same plain command of the same stage, nothing
    linked to either."""
    return (a["kind"] == b["kind"] == "command" and a["text"] == b["text"] and a["stage"] == b["stage"]
            and not (a["refused"] or a["shots"] or a["to"] or a["from"] or b["shots"] or b["to"] or b["from"]))


def nearest(rows_: list[dict[str, Any]], when: str) -> int | None:
    """The seq of the row closest in wall time to `when` (an ISO time, as decision lines have)."""
    if not rows_ or not when:
        return None
    best = min(rows_, key=lambda r: abs(_seconds(r["ts"]) - _seconds(when)))
    return int(best["seq"])


def _seconds(ts: str) -> float:
    try:
        whole, _, frac = ts.rstrip("Z").partition(".")
        return time.mktime(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float("0." + (frac or "0"))
    except ValueError:
        return 0.0


def summary_line(index: dict[str, Any]) -> dict[str, Any]:
    """What a listing shows of a record."""
    def when(v: Any) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(float(v))) if isinstance(v, (int, float)) else ""
    return {"record": index.get("record"), "run_id": index.get("run_id"), "host": index.get("host"),
            "pipeline": index.get("pipeline") or "", "profiles": list(index.get("profiles") or []),
            "stages": list(index.get("stages") or []), "state": index.get("state"),
            "outcome": index.get("outcome") or "", "started": when(index.get("started")),
            "ended": when(index.get("ended")), "entries": index.get("entries"), "bytes": index.get("bytes"),
            "started_epoch": float(index.get("started") or 0)}


def matches(line: dict[str, Any], *, text: str = "", pipeline: str = "", profile: str = "", outcome: str = "",
            since: float | None = None, until: float | None = None) -> bool:
    """A listing's search: words anywhere, or each field (pipeline, profile, outcome, dates)."""
    hay = " ".join(str(v) for v in (line["record"], line["run_id"], line["pipeline"], " ".join(line["profiles"]),
                                     line["outcome"], line["state"], line["host"])).lower()
    if text and not all(w in hay for w in text.lower().split()):
        return False
    if pipeline and pipeline.lower() not in line["pipeline"].lower():
        return False
    if profile and profile not in line["profiles"]:
        return False
    if outcome and outcome != (line["outcome"] or line["state"]):
        return False
    started = line["started_epoch"]
    return not (since is not None and started < since) and not (until is not None and started >= until)
