"""What a person is shown of a held write, with its secrets masked: form fields, a JSON or text
body, and the request headers that change its meaning.

A value is masked by what its field is, never by a substring of its name: a field the page
marks `type=password`, a name whose words (split at `_ - .`, digits and camelCase) include a
secret word (`password`, `pw`, `pin`, `otp`, `mfa`, `token`, `api_key`, `credentials`, ...), and
values shaped like a card number (13-19 digits passing the Luhn check), a card's security code
beside one, or a JSON web token. So `shipping_address`, `author` and `authorized_users` stay
readable. Pure: used by the approvals store when it shows or keeps an approval.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

MASK = "********"
#: single words that make a field secret
SECRET_WORDS = frozenset({
    "password", "passwd", "passwort", "pwd", "pass", "passphrase", "passcode", "pw", "pin", "otp", "mfa",
    "totp", "hotp", "2fa", "secret", "token", "credential", "credentials", "cvv", "cvc", "cvv2", "cvc2",
    "csc", "ssn", "auth", "authorization", "cookie", "csrf", "xsrf", "jwt", "bearer", "apikey",
})
#: two words in a row that make a field secret (`api_key`, `security_code`, `sessionId`)
SECRET_PAIRS = frozenset({
    ("api", "key"), ("secret", "key"), ("private", "key"), ("access", "key"), ("session", "id"),
    ("session", "key"), ("security", "code"), ("verification", "code"), ("auth", "code"),
    ("recovery", "code"), ("backup", "code"), ("reset", "code"), ("sms", "code"), ("one", "time"),
    ("card", "number"), ("cc", "number"), ("cc", "num"), ("card", "num"), ("account", "number"),
    ("iban", "number"), ("signing", "key"),
})
_WORDS_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+[a-z]*")
_CARD_RE = re.compile(r"[0-9][0-9 -]{11,22}[0-9]")
_CVC_RE = re.compile(r"[0-9]{3,4}")
_JWT_RE = re.compile(r"eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*")
#: request headers the browser sets itself (not shown: they say nothing of what the write does)
BROWSER_HEADERS = frozenset({
    "accept", "accept-encoding", "accept-language", "cache-control", "connection", "content-length",
    "host", "pragma", "referer", "te", "upgrade-insecure-requests", "user-agent", "dnt", "priority",
    "purpose", "save-data", "ping-from", "ping-to", "last-event-id",
})
MAX_TEXT = 8192


def words(name: str) -> list[str]:
    """`apiKey` -> [api, key]; `new-password2` -> [new, password, 2]; `X_CSRF_Token` -> [x, csrf, token]."""
    return [w.lower() for w in _WORDS_RE.findall(name)]


def secret_name(name: str) -> bool:
    """True when a field or header of this name holds a secret (by its words, not substrings)."""
    ws = words(name)
    if any(w in SECRET_WORDS for w in ws):
        return True
    return any(pair in SECRET_PAIRS for pair in zip(ws, ws[1:], strict=False))


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def card_number(value: str) -> bool:
    if _CARD_RE.fullmatch(value.strip()) is None:
        return False
    digits = re.sub(r"[ -]", "", value)
    return 13 <= len(digits) <= 19 and _luhn(digits)


def secret_value(value: str) -> bool:
    """A value that is a secret whatever its field is called: a card number, a JSON web token."""
    return card_number(value) or _JWT_RE.search(value) is not None


def mask_form(form: Iterable[tuple[str, str]], password_fields: Iterable[str] = ()) -> list[list[str]]:
    """[name, shown value] of a form body. A 3-4 digit value is a card's security code when the
    same form carries a card number."""
    pairs = list(form)
    marked = set(password_fields)
    has_card = any(card_number(v) for _, v in pairs)
    out = []
    for name, value in pairs:
        hide = (name in marked or secret_name(name) or secret_value(value)
                or (has_card and _CVC_RE.fullmatch(value.strip()) is not None))
        out.append([name, MASK if hide else value])
    return out


def _mask_json(node: Any, key: str = "") -> Any:
    if isinstance(node, dict):
        return {k: _mask_json(v, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_mask_json(v, key) for v in node]
    if key and secret_name(key) and node is not None:
        return MASK
    if isinstance(node, str) and secret_value(node):
        return MASK
    return node


def shown_body(body: bytes, content_type: str | None) -> str | None:
    """A JSON body (masked by key and value) or a text body as the person sees it, at most
    MAX_TEXT characters; None for a form (shown as fields), an empty body or another type."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if not body or kind in ("application/x-www-form-urlencoded", "multipart/form-data"):
        return None
    text = body.decode("utf-8", "replace")
    if kind.endswith("json") or kind.endswith("+json") or (not kind and text.lstrip()[:1] in "{["):
        try:
            return _cut(json.dumps(_mask_json(json.loads(text)), indent=1, ensure_ascii=False))
        except ValueError:
            pass
    if kind.startswith("text/") or not kind or kind.endswith("xml") or kind.endswith("json"):
        if secret_value(text) and len(text) < 200:
            return MASK
        return _cut(_JWT_RE.sub(MASK, text))
    return None


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"... ({len(text) - MAX_TEXT} more characters)"


def shown_headers(headers: dict[str, str]) -> list[list[str]]:
    """The headers that change what a write means (a method override, its content type,
    Origin, anything a page set), with secret ones masked; the browser's own are left out, and
    Cookie is never shown."""
    out = []
    for name, value in sorted(headers.items(), key=lambda kv: kv[0].lower()):
        low = name.lower()
        if low in BROWSER_HEADERS or low.startswith(("sec-", ":")):
            continue
        out.append([name, MASK if secret_name(name) or secret_value(value) else value[:500]])
    return out
