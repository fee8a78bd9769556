"""Webhooks from a real `sfguard start` (fake agent-browser) to real receivers on 127.0.0.1
(docs/operator-guide.md section 13): a failed run, an invalid policy edit and a broken audit
chain arrive signed as the guide says (checked with the guide's own `verify`, which refuses a
timestamp too old); a receiver that is down at first gets its delivery once it is up (same
delivery id, later attempt); one that never answers is given up after `retry_for_s`, and each
outcome is a log line, a metric, a `status` line and a `status --check` alert. The guide's chat
relay runs between the guard and a stand-in chat. Invalid notify.yaml files stop the start with
file:line. The secret and the webhook URL's path never reach the log."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.daemon.conftest import ROOT
from tests.daemon.test_api_contract import stage_body
from tests.daemon.test_metrics import parse, scrape_unix, value
from tests.webhook_receiver import Receiver, doc_verify, guide_block

TOKEN_PATH = "/hooks/T0KEN-a1b2c3d4e5f6a7b8"       # a chat webhook's URL path is its credential


def write_notify(home, text: str, mode: int = 0o600):
    path = home / "notify.yaml"
    path.write_text(text)
    path.chmod(mode)
    return path


def status(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", "status", "--home", str(d.home), *args],
                          cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=60)


def hooks_state(d) -> list[dict]:
    return d.call("GET", "/v1/status")[1]["notifications"]["webhooks"]


def wait_for(pred, what: str, bound: float = 40.0):
    deadline = time.monotonic() + bound
    while not (got := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return got


def test_events_are_signed_retried_given_up_and_recorded(daemon):
    d = daemon
    main, late, gone = Receiver().up(), Receiver(), free_port()
    d.stop()
    d.log.write_text("")
    write_notify(d.home, f"""version: 1
webhooks:
  - url: {main.url(TOKEN_PATH)}
  - url: {late.url()}
    events: [run_failed]
    retry_for_s: 120
  - url: http://127.0.0.1:{gone}/never
    events: [run_failed]
    retry_for_s: 10
    timeout_s: 2
""")
    d.start("--audit-check", "1")
    assert f"notifications to 3 webhook(s): http://127.0.0.1:{main.port}/..." in d.banner
    secret_file = d.home / "notify.secret"
    assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
    secret = secret_file.read_bytes().strip()
    verify = doc_verify()

    # a failed run: to all three; `late` is down and comes up after a while
    assert d.call("POST", "/v1/runs", {"run_id": "n1"})[0] == 201
    assert d.call("POST", "/v1/runs/n1/stages", stage_body("s1"))[0] == 200
    assert d.call("POST", "/v1/runs/n1/end", {"outcome": "failed"})[0] == 200
    failed = main.wait("run_failed")[0]
    ev = failed.event
    assert (ev["run"], ev["outcome"], ev["problems"], ev["guard"]) == ("n1", "failed", 0, os.uname().nodename)
    assert ev["link"].startswith("http://127.0.0.1:") and ev["about"]
    assert failed.path == TOKEN_PATH
    time.sleep(3)
    late.up()
    again = late.wait("run_failed", bound=60)[0]
    assert again.headers["X-Sfguard-Delivery"] == failed.headers["X-Sfguard-Delivery"] == ev["delivery"]
    assert again.body == failed.body                       # the same event, delivered late
    wait_for(lambda: hooks_state(d)[1]["delivered"] == 1, "the late delivery is not recorded")
    assert hooks_state(d)[1]["last"]["attempts"] >= 2

    # an invalid policy edit: the last good policy stays, the operator is told where
    sites = d.home / "sites.yaml"
    good = sites.read_text()
    time.sleep(1.1)
    sites.write_text(good + "mode: sideways\n")
    ev = main.wait("policy_invalid")[0].event
    assert ev["file"] == str(sites) and "sites.yaml:" in ev["reason"] and "sideways" in ev["reason"], ev
    sites.write_text(good)

    # the audit chain is tampered with: found within --audit-check, told once
    audit = d.home / "audit.log"
    text = audit.read_text()
    assert '"run":"n1"' in text
    audit.write_text(text.replace('"run":"n1"', '"run":"n9"', 1))
    ev = main.wait("audit_chain_broken", bound=20)[0].event
    assert ev["reason"] and ev["link"].endswith("/audit")

    # the one that never answers is given up after its retry_for_s
    wait_for(lambda: hooks_state(d)[2]["failed"] == 1, "the unreachable webhook was not given up", 60)
    gave_up = hooks_state(d)[2]
    assert gave_up["last"]["result"] == "failed" and gave_up["last"]["attempts"] >= 3, gave_up
    assert gave_up["url"] == f"http://127.0.0.1:{gone}/..."
    check = status(d, "--check")
    assert check.returncode == 1, check.stdout + check.stderr
    assert "ALERT   the audit chain does not verify" in check.stdout, check.stdout
    assert f"ALERT   the last notification to http://127.0.0.1:{gone}/... was not delivered" in check.stdout
    assert "audit   chain BROKEN" in check.stdout
    assert "webhook http://127.0.0.1:" in check.stdout
    fams = parse(scrape_unix(d)[2])
    assert value(fams, "sfguard_webhook_deliveries", "_total", result="failed") == 1
    assert value(fams, "sfguard_webhook_deliveries", "_total", result="delivered") == len(main.got) + 1
    assert value(fams, "sfguard_webhook_attempt_failures", "_total") >= 4
    assert value(fams, "sfguard_audit_chain_ok") == 0

    # every delivery is signed as the guide says; its headers agree with its body
    for got in main.got + late.got:
        header = got.headers["X-Sfguard-Signature"]
        assert verify(secret, header, got.body), header
        assert got.headers["X-Sfguard-Event"] == got.event["event"]
        assert got.headers["Content-Type"] == "application/json"
        t = int(header.split(",")[0].removeprefix("t="))
        assert abs(t - got.at) < 5
        assert not verify(secret, header, got.body, now=t + 301)      # too old: a replay is refused
        assert verify(secret, header, got.body, now=t + 299)
        assert not verify(secret, header, got.body + b" ")             # the body as sent, only
        assert not verify(b"another-secret-0123456789", header, got.body)
    # the log: each outcome, never the secret or the URL's path
    assert d.stop() == 0
    log = d.log.read_text()
    assert secret.decode() not in log and "T0KEN" not in log
    assert f"delivered to http://127.0.0.1:{late.port}/... (attempt " in log
    assert f"WARNING sfguard.notify: notification run_failed {ev_id(failed)} to http://127.0.0.1:{gone}/... " \
           "not delivered after" in log
    main.down()
    late.down()


def ev_id(got) -> str:
    return got.event["delivery"]


def test_the_guides_chat_relay_posts_each_event_once(daemon, tmp_path):
    """The guide's relay (run as the operator would) between the guard and a stand-in chat:
    one chat message per event, repeats dropped, a wrong signature refused."""
    chat = Receiver().up()
    relay_port = free_port()
    script = tmp_path / "relay.py"
    script.write_text(guide_block("class Relay("))
    secret_copy = tmp_path / "relay.secret"
    d = daemon
    d.stop()
    write_notify(d.home, f"version: 1\nwebhooks:\n  - url: http://127.0.0.1:{relay_port}/sfguard\n")
    d.start()
    secret_copy.write_bytes((d.home / "notify.secret").read_bytes())
    relay = subprocess.Popen([sys.executable, str(script)], env={
        "PATH": os.environ["PATH"], "SFGUARD_WEBHOOK_SECRET_FILE": str(secret_copy),
        "CHAT_WEBHOOK_URL": chat.url("/services/T000/B000/XXXX"), "PORT": str(relay_port)})
    try:
        wait_for(lambda: _listening(relay_port), "the relay does not listen", 20)
        d.call("POST", "/v1/runs", {"run_id": "c1"})
        d.call("POST", "/v1/runs/c1/end", {"outcome": "failed"})
        text = json.loads(wait_for(lambda: chat.got, "no chat message")[0].body)["text"]
        assert "run_failed" in text and "run=c1" in text and "outcome=failed" in text, text
        # a forged or replayed delivery never reaches the chat
        import urllib.error
        import urllib.request
        forged = urllib.request.Request(f"http://127.0.0.1:{relay_port}/sfguard", data=b'{"event":"x"}',
                                        headers={"X-Sfguard-Signature": f"t={int(time.time())},v1=00"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(forged, timeout=10)
        assert refused.value.code == 401
        time.sleep(1)
        assert len(chat.got) == 1
    finally:
        relay.terminate()
        relay.wait(10)
        chat.down()


def _listening(port: int) -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


BAD_FILES = [
    # (notify.yaml, mode, what stderr names)
    ("version: 1\nwebhooks:\n  - url: https://hooks.example/x\n    tmeout_s: 3\n", 0o600,
     "notify.yaml:4:5: webhooks[0].tmeout_s: unknown key 'tmeout_s' (hint: did you mean 'timeout_s'?)"),
    ("version: 1\nwebhooks:\n  - url: http://hooks.example/x\n", 0o600,
     "notify.yaml:3:10: webhooks[0].url: must be https://"),
    ("version: 1\nwebhooks:\n  - url: https://hooks.example/x\n    events: [write_hled]\n", 0o600,
     "webhooks[0].events: unknown event 'write_hled'; did you mean 'write_held'?"),
    ("version: 1\nwebhooks:\n  - url: https://u:p@hooks.example/x\n", 0o600, "must not carry a user or password"),
    ("version: 1\nwebhooks:\n  - url: https://hooks.example/x\n    retry_for_s: 5\n", 0o600,
     "notify.yaml:4:18: webhooks[0].retry_for_s: Input should be greater than or equal to 10, got 5"),
    ("version: 1\nwebhooks: []\n", 0o600, "notify.yaml:2:11: webhooks: List should have at least 1 item"),
    ("version: 1\nwebhooks:\n  - url: https://hooks.example/x\n", 0o644, "mode 0644 lets others read"),
    ("version: 1\nwebhooks:\n  - url: https://hooks.example/x\n    secret_file: SHORT\n", 0o600,
     "the secret is shorter than 16 characters"),
    ("version: 1\nwebhooks: [\n", 0o600, "notify.yaml:3:1: (yaml): not valid YAML"),
]


@pytest.mark.parametrize("text,mode,needle", BAD_FILES,
                         ids=["unknown-key", "plain-http", "unknown-event", "userinfo", "retry-too-short",
                              "no-webhooks", "readable-by-others", "short-secret", "yaml-syntax"])
def test_an_invalid_notify_yaml_stops_the_start_naming_where(tmp_path, text, mode, needle):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    short = tmp_path / "short.secret"
    short.write_text("abc\n")
    short.chmod(0o600)
    write_notify(home, text.replace("SHORT", str(short)), mode)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(home)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the webhook configuration is invalid" in proc.stderr and needle in proc.stderr, proc.stderr
    assert "sfguard: ready" not in proc.stdout


def test_the_guides_notify_yaml_is_valid_and_names_every_event(tmp_path):
    """Section 13's example file loads as the guard loads it, and its table lists every event."""
    import re

    from sfguard.supervisor.daemon.notify_config import EVENTS, load_notify
    from tests.webhook_receiver import GUIDE
    guide = GUIDE.read_text()
    text = guide[guide.index("## 13. Notifications"):]
    example = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    write_notify(home, example)
    config = load_notify(home)
    assert [h.shown for h in config.webhooks] == ["https://relay.example.org/...", "http://127.0.0.1:8787/..."]
    assert config.webhooks[1].events == frozenset(EVENTS)
    table = text[:text.index("**Signatures.**")]
    assert [e for e in EVENTS if f"`{e}`" not in table] == []
