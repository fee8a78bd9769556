"""What a person is shown of a held write's body: form fields of urlencoded and multipart
bodies (files by name and size), password-like values masked, other bodies by type and size."""
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


def shown(ctype: str, body: bytes) -> dict:
    icpt = WriteInterceptor(Pipe(), WriteContext("r1", "acct", "s1", 1, {}))
    params = {"request": {"method": "POST", "url": "https://a.test/x?q=1", "headers": {"Content-Type": ctype},
                          "postDataEntries": [{"bytes": base64.b64encode(body).decode()}]}}
    held = icpt.held_write(params, "POST", "https://a.test/x?q=1", "a.test", "/x",
                           WriteVerdict(True, "gate", "stage_mode"))
    return Approval("ap_" + "1" * 20, held, 0.0, 1.0).public()


@pytest.mark.parametrize("ctype, body, form, size", [
    ("application/x-www-form-urlencoded", b"user=op&password=hunter2&otp=123456",
     [["user", "op"], ["password", "********"], ["otp", "********"]], 35),
    ("multipart/form-data; boundary=XyZ", MULTIPART,
     [["title", "hello wörld"], ["password", "********"], ["doc", "(file a.txt, 6 bytes)"]], len(MULTIPART)),
    ("multipart/form-data; boundary=XyZ", b"not multipart at all", None, 20),
    ("application/json", b'{"password": "hunter2"}', None, 23),
])
def test_what_the_person_sees(ctype, body, form, size):
    ap = shown(ctype, body)
    assert ap["form"] == form and ap["body_size"] == size and ap["body_type"] == ctype
    assert "hunter2" not in repr(ap)
