"""Redaction: known secrets pushed through every log path never reach a file in the home."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sfguard.supervisor.redaction import MASK, redact
from tests.profiles.conftest import ROOT

COOKIE = "sid=Zx81kQpL0vR7"
BEARER = "eyJhbGciOiJIUzI1NiJ9.payload.sig"
PROXY_PASS = "pr0xyPa55word"
CDP_ID = "0f9a6c1e-5b2d-4f55-8c1c-7e3a9b2d4c11"
RUN_SECRET = "run-time-secret-4711"
ALL = [COOKIE.split("=")[1], BEARER, PROXY_PASS, CDP_ID, RUN_SECRET]

CASES = [
    (f"Cookie: {COOKIE}; theme=dark", COOKIE),
    (f"set-cookie: {COOKIE}; HttpOnly", COOKIE),
    (f"headers={{'cookie': '{COOKIE}', 'accept': '*/*'}}", COOKIE),
    (f"Headers[(b'Cookie', b'{COOKIE}')]", COOKIE),
    (f"Authorization: Bearer {BEARER}", BEARER),
    (f"sending bearer {BEARER} upstream", BEARER),
    (f'"proxy-authorization": "Basic {PROXY_PASS}"', PROXY_PASS),
    (f"Proxy-Authorization=Basic {PROXY_PASS}", PROXY_PASS),
    (f"upstream http://user:{PROXY_PASS}@127.0.0.1:8080/", PROXY_PASS),
    (f"ws://127.0.0.1:9222/devtools/browser/{CDP_ID} ready", CDP_ID),
    (f"wss://localhost:1/devtools/page/{CDP_ID}", CDP_ID),
]


@pytest.mark.parametrize("text,secret", CASES)
def test_redact_patterns(text, secret):
    out = redact(text)
    assert secret not in out
    assert MASK in out


@pytest.mark.parametrize("text", ["cookies were flushed", "authorization checked for run r1",
                                  "GET https://example.com/path ok", "profile shop sealed"])
def test_harmless_text_kept(text):
    assert redact(text) == text


SCRIPT = r"""
import logging, sys
from pathlib import Path
from sfguard.supervisor import redaction
home = Path(sys.argv[1])
secrets = sys.argv[2:]
cookie, bearer, proxy_pass, cdp_id, run_secret = secrets

root = logging.getLogger()
root.setLevel(logging.DEBUG)
early = logging.FileHandler(home / "early.log")
early.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s %(detail)s",
                                     defaults={"detail": "-"}))
root.addHandler(early)
redaction.install()                              # once, at process start
redaction.register_secret(run_secret)

late = logging.FileHandler(home / "late.log")    # a handler added AFTER install
late.setFormatter(logging.Formatter("%(message)s %(detail)s", defaults={"detail": "-"}))
proxy_log = logging.getLogger("mitmproxy.proxy")
proxy_log.propagate = False
proxy_log.addHandler(late)
child = logging.getLogger("sfguard.daemon.child")
child.addHandler(logging.FileHandler(home / "child.log"))

for log in (logging.getLogger("sfguard"), proxy_log, child):
    log.info("Cookie: %s", cookie)                                    # args
    log.info(f"Authorization: Bearer {bearer}")                       # msg
    log.warning("upstream %s", f"http://u:{proxy_pass}@127.0.0.1:3128")
    log.info("cdp at %s", f"ws://127.0.0.1:9222/devtools/browser/{cdp_id}")
    log.info("token %s in text", run_secret)
    log.info("headers %r", {"set-cookie": cookie, "x": 1})
    log.info("extra field", extra={"detail": f"Cookie: {cookie} {run_secret}"})
    try:
        raise RuntimeError(f"failed with {run_secret} and Cookie: {cookie}")
    except RuntimeError:
        log.exception("boom %s", run_secret)
    log.info("stack", stack_info=True)
print("logged")
"""


def test_secrets_never_reach_any_file_in_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(home), *ALL], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    files = sorted(home.iterdir())
    assert {f.name for f in files} == {"early.log", "late.log", "child.log"}
    combined = ""
    for f in files:
        text = f.read_text()
        assert text.count(MASK) >= 8, f.name           # every line actually went through
        combined += text
        for secret in ALL:
            assert secret not in text, (f.name, secret)
    assert "RuntimeError" in combined and "boom" in combined   # the exception is still there
    for secret in ALL:
        assert secret not in proc.stderr


def test_register_secret_refuses_short_values():
    from sfguard.supervisor.redaction import register_secret
    with pytest.raises(ValueError):
        register_secret("abc")
