"""What a run record says of a command, an address and typed text: never a secret (issue 48).
Table-driven: each row is a command a stage could send and what the entry may and may not hold."""
from __future__ import annotations

import json

import pytest

from sfguard.supervisor.record import summary

SECRET = "hunter2-Zx9"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJlLXZhbHVl"

COMMANDS = [
    # (method, params, must be in the summary, must not be in it)
    ("Page.navigate", {"url": f"https://u:{SECRET}@shop.test/a/b?token={SECRET}&q=x#frag={SECRET}"},
     ["https://shop.test/a/b?token=...&q=..."], [SECRET, "frag", "u:"]),
    ("Target.createTarget", {"url": f"http://site.test:8080/p?code={SECRET}", "newWindow": True},
     ["http://site.test:8080/p?code=..."], [SECRET]),
    ("Runtime.evaluate", {"expression": f"document.querySelector('#pw').value = '{SECRET}'"},
     ["document.querySelector('#pw').value = '…'"], [SECRET]),
    ("Runtime.evaluate", {"expression": f'fetch("https://x.test/?t={SECRET}")'}, ['fetch("…")'], [SECRET]),
    ("Runtime.evaluate", {"expression": f"const t = `Bearer {JWT}`; 1"}, ["const t = `…`"], [JWT]),
    ("Runtime.evaluate", {"expression": f"document.querySelector('input[value={JWT}]')"}, [], [JWT]),
    ("Runtime.callFunctionOn", {"functionDeclaration": "function(v) { this.value = v; }",
                                "arguments": [{"value": SECRET}]}, ['"args": 1'], [SECRET]),
    ("Input.insertText", {"text": SECRET}, ['"chars": 11'], [SECRET]),
    ("Input.dispatchKeyEvent", {"type": "keyDown", "key": "h", "text": "h"}, ['"(character)"'], ['"h"']),
    ("Input.dispatchKeyEvent", {"type": "keyDown", "key": "Enter", "text": "\r"}, ['"Enter"'], []),
    ("Input.dispatchMouseEvent", {"type": "mousePressed", "x": 10.6, "y": 20.2, "button": "left"},
     ['"x": 11', '"y": 20', '"button": "left"'], []),
    ("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {SECRET}"}}, ['"headers"'], [SECRET]),
    ("Storage.getCookies", {"browserContextId": SECRET}, ['"browserContextId"'], [SECRET]),
    ("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": f"/home/{SECRET}"},
     ['"allow"'], [SECRET]),
]


@pytest.mark.parametrize("method,params,shown,hidden", COMMANDS, ids=[f"{c[0]}-{i}" for i, c in enumerate(COMMANDS)])
def test_a_command_summary_keeps_what_it_did_and_no_secret(method, params, shown, hidden):
    out = summary.command(method, params)
    text = json.dumps(out, ensure_ascii=False) + " " + " ".join(str(v) for v in out.values())
    for want in shown:
        assert want in text, text
    for secret in hidden:
        assert secret not in text, text


FIELDS = [
    # (the focused field, the text, the value is kept)
    ({"tag": "input", "type": "text", "name": "user"}, "operator", True),
    ({"tag": "input", "type": "password", "name": "word"}, "operator", False),     # type=password
    ({"tag": "input", "type": "text", "name": "new_password2"}, "x", False),       # its words
    ({"tag": "input", "type": "text", "id": "otpCode"}, "123456", False),
    ({"tag": "input", "type": "text", "autocomplete": "one-time-code"}, "123456", False),
    ({"tag": "input", "type": "text", "autocomplete": "cc-number"}, "4", False),
    ({"tag": "input", "type": "text", "name": "comment"}, "4111 1111 1111 1111", False),   # a card number
    ({"tag": "textarea", "name": "notes"}, JWT, False),                               # a token shape
    ({"tag": "input", "type": "text", "name": "shipping_address"}, "1 Main St", True),
    ({"tag": "input", "type": "hidden", "name": "x"}, "v", False),
    ({"tag": "div", "name": ""}, "typed into a div", False),        # not a field the rules know
    ({"tag": "div", "editable": True}, "a note", True),             # contenteditable
    ({"tag": "iframe"}, "into a frame", False),                     # focus in another document
    (None, "the guard could not read the field", False),           # unknown: fail closed
]


@pytest.mark.parametrize("field,text,kept", FIELDS)
def test_typed_text_is_its_length_and_field_and_its_value_only_where_not_secret(field, text, kept):
    out = summary.typed(text, field)
    assert out["chars"] == len(text)
    assert out["field"]
    assert ("text" in out) is kept and out.get("secret", False) is not kept
    if not kept:
        assert text not in json.dumps(out)


@pytest.mark.parametrize("url,want", [
    ("about:blank", "about:blank"), ("chrome-error://chromewebdata/?x=1", "chrome-error://chromewebdata/"),
    ("https://a.test/", "https://a.test/"), ("https://a.test/?", "https://a.test/"),
    ("https://a.test/p?only", "https://a.test/p?only=..."), (7, None),
])
def test_addresses(url, want):
    assert summary.address(url) == want
