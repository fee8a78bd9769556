"""Two guard daemons (homes of their own, fake browsers) on one real PostgreSQL share a profile's
pace (issue 49): what one host's run of the profile used, the other host's next run of it finds.

Traffic is the stage's shell (its proxy credential, as `sfguard stage-exec` gives it), sent
through the stage's proxy bridge socket, as the sandbox would. The site counts what arrived. The
pace: 2 a minute with a burst of 3, refused over it; the profile's lease lets one host hold it at
a time, so the second host's run follows the first. Tolerance: `burst + elapsed/30 s` (+1 on the
window's edge); counters per host would let the second run's burst through as well (6)."""
from __future__ import annotations

import base64
import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.pace_site import PaceSite
from tests.pg.test_guards import end_run, new_run

POLICY = """version: 1
ports: [80, 443, {port}]
private_networks:
  allow: [127.0.0.1/32]
pace:
  - pattern: shop.test
    reason: "the shop locks accounts that browse fast"
    requests_per_minute: 2
    burst: 3
    over: refuse
"""


@pytest.fixture
def shop():
    s = PaceSite()
    yield s
    s.close()


def shell_gets(d, run: str, port: int, n: int, tag: str) -> list[int]:
    """`n` GETs from the stage's shell: its proxy credential, through its proxy bridge socket."""
    status, info = d.call("GET", f"/v1/runs/{run}/stages/s1/exec")
    assert status == 200, info
    proxy = urlsplit(info["env"]["HTTP_PROXY"])
    auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
    out = []
    for i in range(n):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(20)
            s.connect(info["bridges"]["proxy_socket"])
            s.sendall(f"GET http://shop.test:{port}/{tag}/{i} HTTP/1.1\r\nHost: shop.test:{port}\r\n"
                      f"Proxy-Authorization: Basic {auth}\r\nConnection: close\r\n\r\n".encode())
            head = s.recv(4096)
            out.append(int(head.split()[1]) if head else 0)
    return out


def test_two_guard_hosts_keep_one_pace_for_a_profile(guards, tmp_path, shop):
    pol = tmp_path / "sites.yaml"
    pol.write_text(POLICY.format(port=shop.port))
    args = ("--policy", str(pol), "--resolve", "shop.test=127.0.0.1")
    g1, g2 = guards.start("g1", *args), guards.start("g2", *args)
    body = {"stage_id": "s1", "attempt": 1,
            "browser": {"profile": "acct", "headed": False, "allow_domains": ["shop.test"]}}
    new_run(g1, "r1")
    status, answer = g1.call("POST", "/v1/runs/r1/stages", body)
    assert status == 200, answer
    assert answer["pace"]["shop.test"]["requests_per_minute"] == 2
    first = shell_gets(g1, "r1", shop.port, 5, "one")
    assert first == [200, 200, 200, 429, 429]
    end_run(g1, "r1")
    new_run(g2, "r2")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, answer = g2.call("POST", "/v1/runs/r2/stages", body) if status != 202 else \
            g2.call("GET", "/v1/runs/r2/stages/s1?wait=5")
        if answer.get("state") == "ready":
            break
    assert answer.get("state") == "ready", answer
    second = shell_gets(g2, "r2", shop.port, 5, "two")
    arrived = shop.times("/")
    elapsed = arrived[-1] - arrived[0]
    assert len(arrived) <= 3 + elapsed / 30 + 1, (first, second, elapsed)
    assert 429 in second
    lines = [json.loads(x) for x in (g2.home / "logs" / "decisions.log").read_text().splitlines() if x.strip()]
    refused = [x for x in lines if x["reason"] == "pace"]
    assert refused and refused[0]["rule"].endswith("pace shop.test requests_per_minute 2")
    end_run(g2, "r2")
