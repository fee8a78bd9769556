"""What a person is shown of a held write: form fields of urlencoded and multipart bodies (files
by name, type and size), JSON and text bodies, the headers that change what it means; secret
values masked by what a field is (never by a substring of its name), everything else readable."""
from __future__ import annotations

import base64

import pytest

from sfguard.policy.writes import WriteVerdict
from sfguard.supervisor.writes.approvals import Approval
from sfguard.supervisor.writes.intercept import WriteContext, WriteInterceptor

MULTIPART = (b'--XyZ\r\nContent-Disposition: form-data; name="title"\r\n\r\nhello w\xc3\xb6rld\r\n'
             b'--XyZ\r\nContent-Disposition: form-data; name="password"\r\n\r\nhunter2\r\n'
             b'--XyZ\r\nContent-Disposition: form-data; name="doc"; filename="a.txt"\r\n'
             b'Content-Type: text/plain\r\n\r\nabcdef\r\n--XyZ--\r\n')


class Pipe:
    writes = None


def shown(ctype: str, body: bytes, headers: dict | None = None, password_fields: tuple = ()) -> dict:
    icpt = WriteInterceptor(Pipe(), WriteContext("r1", "acct", "s1", 1, {}))
    params = {"request": {"method": "POST", "url": "https://a.test/x?q=1",
                          "headers": {"Content-Type": ctype, **(headers or {})},
                          "postDataEntries": [{"bytes": base64.b64encode(body).decode()}]}}
    held = icpt.held_write(params, "POST", "https://a.test/x?q=1", "a.test", "/x",
                           WriteVerdict(True, "gate", "stage_mode"), password_fields=password_fields)
    return Approval("ap_" + "1" * 20, held, 0.0, 1.0).public()


@pytest.mark.parametrize("ctype, body, form, size", [
    ("application/x-www-form-urlencoded", b"user=op&password=hunter2&otp=123456",
     [["user", "op"], ["password", "********"], ["otp", "********"]], 35),
    ("multipart/form-data; boundary=XyZ", MULTIPART,
     [["title", "hello wörld"], ["password", "********"], ["doc", "(file a.txt, text/plain, 6 bytes)"]],
     len(MULTIPART)),
    ("multipart/form-data; boundary=XyZ", b"not multipart at all", None, 20),
    ("application/json", b'{"password": "hunter2"}', None, 23),
])
def test_what_the_person_sees(ctype, body, form, size):
    ap = shown(ctype, body)
    assert ap["form"] == form and ap["body_size"] == size and ap["body_type"] == ctype
    assert "hunter2" not in repr(ap)


#: field name -> masked? Secret by what the field is: its words, not a substring of its name.
NAMES = {
    # secret
    "password": True, "passwd": True, "pw": True, "pwd": True, "new-password2": True, "userPassword": True,
    "pin": True, "pin_code": True, "otp": True, "mfa": True, "mfa_code": True, "totp": True, "2fa": True,
    "secret": True, "client_secret": True, "token": True, "access_token": True, "csrfToken": True,
    "api_key": True, "apiKey": True, "X-Api-Key": True, "credentials": True, "credential": True,
    "cvv": True, "cvc": True, "security_code": True, "card_number": True, "ssn": True, "auth": True,
    "verification_code": True, "session_id": True, "passphrase": True,
    # readable: words that only contain a secret word's letters
    "shipping_address": False, "author": False, "authorized_users": False, "spinner": False,
    "passenger": False, "compass": False, "keyword": False, "monkey": False, "zip_code": False,
    "postal_code": False, "country_code": False, "promo_code": False, "title": False, "comment": False,
    "amount": False, "opinion": False, "tokenizer_name": False, "cardinality": False, "description": False,
}


@pytest.mark.parametrize("name, secret", NAMES.items())
def test_a_field_is_masked_by_what_it_is(name, secret):
    ap = shown("application/x-www-form-urlencoded", f"{name}=v4lue-Xy".encode())
    assert ap["form"] == [[name, "********" if secret else "v4lue-Xy"]], name


@pytest.mark.parametrize("body, masked, readable", [
    # a card number (Luhn) and its security code, whatever the fields are called
    (b"num=4111+1111+1111+1111&c=123&qty=3", ["num", "c"], []),
    (b"num=4111111111111112&c=123", [], ["num", "c"]),        # not a card number: both readable
    (b"qty=3&id=1234", [], ["qty", "id"]),                     # a short number alone is no code
    (b"data=eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.abcdefghij", ["data"], []),    # a JSON web token
])
def test_values_shaped_like_secrets_are_masked(body, masked, readable):
    form = dict(shown("application/x-www-form-urlencoded", body)["form"])
    assert [k for k in masked if form[k] != "********"] == [] and [k for k in readable if form[k] == "********"] == []


def test_the_pages_password_inputs_are_masked_whatever_their_name():
    ap = shown("application/x-www-form-urlencoded", b"f1=hunter2&f2=visible", password_fields=("f1",))
    assert ap["form"] == [["f1", "********"], ["f2", "visible"]]


def test_a_json_body_is_shown_with_its_secrets_masked():
    body = b'{"title": "hello", "author": "ann", "user": {"password": "hunter2", "pin": 1234}, "items": [1, 2]}'
    ap = shown("application/json", body)
    assert ap["form"] is None
    shown_json = __import__("json").loads(ap["body_text"])
    assert shown_json == {"title": "hello", "author": "ann", "user": {"password": "********", "pin": "********"},
                          "items": [1, 2]}


def test_a_text_body_is_shown_and_another_type_is_not():
    assert shown("text/plain", b"hello there")["body_text"] == "hello there"
    ap = shown("application/octet-stream", b"\x00\x01binary")
    assert ap["body_text"] is None and ap["body_size"] == 8 and ap["body_type"] == "application/octet-stream"


def test_the_headers_that_change_what_a_write_means_are_shown():
    ap = shown("application/x-www-form-urlencoded", b"a=1", headers={
        "X-HTTP-Method-Override": "DELETE", "Origin": "https://a.test", "User-Agent": "Chromium",
        "Accept": "*/*", "Sec-Fetch-Mode": "cors", "Authorization": "Bearer abc.def", "X-Api-Key": "k-123",
        "X-Custom": "yes"})
    assert ap["headers"] == [["Authorization", "********"], ["Content-Type", "application/x-www-form-urlencoded"],
                             ["Origin", "https://a.test"], ["X-Api-Key", "********"], ["X-Custom", "yes"],
                             ["X-HTTP-Method-Override", "DELETE"]]
    assert "abc.def" not in repr(ap) and "k-123" not in repr(ap)
