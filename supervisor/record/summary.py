"""What a run record says of a CDP command, an address and typed text: short, and never a
secret. Pure: no I/O.

- Addresses keep scheme, host, port and path; a query's names with their values hidden, never
  user info or a fragment (`writes.held.hidden_query`).
- Script text (Runtime.evaluate, Runtime.callFunctionOn) is cut to a line; its string literals
  are replaced by `"…"` unless they read as a CSS selector (`#q`, `input[name=user]`) and hold
  nothing the write gate's masking rules call a secret. Call arguments are counted, never shown.
- Typed text (Input.insertText) is its length and the field it went into; its value only where
  the field is not secret by the write gate's rules (`type=password`, a secret word in its name,
  id or autocomplete, a card number or token shape) and the field is known. A field the guard
  could not read counts as secret (fail closed).
- Key events name a key only when it is a named key (Enter, Tab, ...): a character never.
- Every other command: the names of its parameters, never their values.
"""
from __future__ import annotations

import re
from typing import Any

from sfguard.supervisor.writes.held import hidden_query
from sfguard.supervisor.writes.masking import secret_name, secret_value

#: longest script text kept of one command
SCRIPT_CHARS = 160
#: longest typed value kept (of a field that is not secret)
TYPED_CHARS = 200
_STRING_RE = re.compile(r"""'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"|`(?:[^`\\]|\\.)*`""", re.S)
_SELECTOR_RE = re.compile(r"^[A-Za-z0-9_#.\[\]=:>~+*^$|\-\s()@,]{1,80}$")
_SPACE_RE = re.compile(r"\s+")
URL_METHODS = frozenset({"Page.navigate", "Target.createTarget"})
#: commands after which a tab may send requests to the site it shows (a click, Enter, a reload)
CAUSES = frozenset({"Page.reload", "Page.navigateToHistoryEntry"})
TAB_METHODS = frozenset({"Target.attachToTarget", "Target.closeTarget", "Target.activateTarget",
                         "Target.getTargetInfo", "Target.detachFromTarget"})


def short_id(target: Any) -> str | None:
    """A tab's id as entries name it (its first 8 characters: enough within one run)."""
    return target[:8] if isinstance(target, str) and target else None


def _literal(match: re.Match[str]) -> str:
    text = match.group(0)
    inner = text[1:-1]
    quote = text[0]
    if inner and _SELECTOR_RE.fullmatch(inner) and any(c in inner for c in "#.[>") \
            and not secret_value(inner) and "//" not in inner:
        return text
    return f"{quote}…{quote}"


def script(text: Any, limit: int = SCRIPT_CHARS) -> str:
    """Script text on one line, string literals hidden (selectors kept), at most `limit`."""
    if not isinstance(text, str):
        return ""
    shown = _SPACE_RE.sub(" ", _STRING_RE.sub(_literal, text)).strip()
    if len(shown) > limit:
        shown = shown[:limit] + f"… ({len(text)} chars)"
    return shown


def address(url: Any) -> str | None:
    """An address for a record: query values hidden, no user info or fragment."""
    if not isinstance(url, str):
        return None
    if url in ("", "about:blank") or url.startswith(("about:", "chrome-error:")):
        return url.split("#", 1)[0].split("?", 1)[0]
    return hidden_query(url)


def host_of(url: Any) -> str | None:
    """The host of an http(s) address, lower case; None for others."""
    if not isinstance(url, str):
        return None
    m = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://(?:[^/@?#]*@)?(\[[^\]]*\]|[^/:?#]*)", url)
    return m.group(1).lower().strip("[]") or None if m else None


def command(method: str, params: Any) -> dict[str, Any]:
    """The short summary of one command's parameters (see the module docstring)."""
    p = params if isinstance(params, dict) else {}
    if method in URL_METHODS:
        return {"url": address(p.get("url", "about:blank"))}
    if method == "Runtime.evaluate":
        return {"script": script(p.get("expression"))}
    if method == "Runtime.callFunctionOn":
        args = p.get("arguments")
        return {"script": script(p.get("functionDeclaration")), "args": len(args) if isinstance(args, list) else 0}
    if method == "Input.insertText":
        text = p.get("text")
        return {"chars": len(text) if isinstance(text, str) else 0}
    if method == "Input.dispatchKeyEvent":
        key = p.get("key")
        return {"type": str(p.get("type") or "")[:20],
                "key": key if isinstance(key, str) and len(key) > 1 and key.isalnum() else "(character)"}
    if method in ("Input.dispatchMouseEvent", "Input.dispatchTouchEvent"):
        out: dict[str, Any] = {"type": str(p.get("type") or "")[:20]}
        for k in ("x", "y"):
            if isinstance(p.get(k), (int, float)) and not isinstance(p.get(k), bool):
                out[k] = round(float(p[k]))
        if p.get("button") not in (None, "none"):
            out["button"] = str(p.get("button"))[:10]
        return out
    if method in TAB_METHODS:
        return {"target": short_id(p.get("targetId"))}
    if method.endswith("setDownloadBehavior"):
        return {"behavior": str(p.get("behavior") or "")[:20]}
    return {"params": sorted(str(k)[:40] for k in p)[:10]} if p else {}


def causes_requests(method: str, params: Any) -> bool:
    """Whether a command may make its tab send requests: a navigation, a reload, a click, a key."""
    p = params if isinstance(params, dict) else {}
    if method in URL_METHODS or method in CAUSES:
        return True
    if method == "Input.dispatchMouseEvent":
        return p.get("type") == "mousePressed"
    return method == "Input.dispatchKeyEvent" and p.get("type") in ("keyDown", "rawKeyDown")


def secret_field(field: dict[str, Any] | None) -> bool:
    """Whether typed text into this field is a secret (the write gate's rules; unknown: yes)."""
    if not isinstance(field, dict) or field.get("tag") not in ("input", "textarea") and not field.get("editable"):
        return True
    if str(field.get("type") or "").lower() in ("password", "hidden"):
        return True
    return any(secret_name(str(field.get(k) or "")) for k in ("name", "id", "autocomplete", "label"))


def field_text(field: dict[str, Any] | None) -> str:
    """How an entry names the field typed into: `input[name=user]`, `textarea#notes`, ..."""
    if not isinstance(field, dict):
        return "(unknown field)"
    tag = str(field.get("tag") or "element")[:20]
    if field.get("name"):
        return f"{tag}[name={str(field['name'])[:60]}]"
    if field.get("id"):
        return f"{tag}#{str(field['id'])[:60]}"
    if field.get("type"):
        return f"{tag}[type={str(field['type'])[:20]}]"
    return tag


def typed(text: str, field: dict[str, Any] | None) -> dict[str, Any]:
    """Typed text as an entry keeps it: its length and field; its value only where neither the
    field nor the value is secret."""
    out: dict[str, Any] = {"chars": len(text), "field": field_text(field)}
    if secret_field(field) or secret_value(text):
        out["secret"] = True
    else:
        out["text"] = text[:TYPED_CHARS]
    return out
