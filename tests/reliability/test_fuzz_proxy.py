"""The guard proxy (`sfguard proxy`, real mitmproxy) under a fuzzed stream of request lines and
headers: it never crashes and never lets a denied host through (the fixture site's hit
counters show what reached it; only site-a.test is allowed)."""
from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import free_port
from tests.daemon.conftest import ROOT
from tests.reliability.conftest import hits, write_policy

pytestmark = pytest.mark.reliability
EXAMPLES = int(os.environ.get("SFGUARD_FUZZ_EXAMPLES", "25")) * 8
AUTH = "Basic " + base64.b64encode(b"fz:fuzz-token-0123456789").decode()


@pytest.fixture(scope="module")
def site_mod(tmp_path_factory):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sfguard.fixtures.login_server", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    assert proc.stdout.readline().decode().startswith("ready ")
    yield port
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, site_mod):
    tmp = tmp_path_factory.mktemp("pfuzz")
    pol = write_policy(tmp / "sites.yaml", site_mod)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sfguard.cli.main", "proxy", "--allow", "site-a.test", "--policy", str(pol),
         "--listen", f"127.0.0.1:{port}", "--client", "fz:fuzz-token-0123456789",
         "--resolve", "site-a.test=127.0.0.1", "--resolve", "site-b.test=127.0.0.1",
         "--decision-log", str(tmp / "decisions.log")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=open(tmp / "proxy.err", "wb"))
    assert proc.stdout is not None
    assert proc.stdout.readline().decode().startswith("ready "), (tmp / "proxy.err").read_text()
    yield port, proc, tmp
    alive = proc.poll() is None
    proc.terminate()
    proc.wait(15)
    assert alive, "the proxy died under fuzzing"
    assert "Traceback" not in (tmp / "proxy.err").read_text()


def denied_hosts(p: int) -> list[str]:
    return ["site-b.test", "SITE-B.TEST.", "site-b.test.", "127.0.0.1", "localhost", "0x7f.0.0.1",
            "2130706433", "[::ffff:127.0.0.1]", "[::1]", "site-a.test@site-b.test",
            "site-b.test#.site-a.test", "xn--site-b-.test", "site-a.test.site-b.test"]


def hosts(p: int):
    return st.sampled_from(["site-a.test", *denied_hosts(p)]).flatmap(
        lambda h: st.sampled_from([h, f"{h}:{p}", f"{h}:80", f"{h}:0", f"{h}:99999", f"{h}:{p}x"]))


junk = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=40)


@st.composite
def requests(draw, port: int):
    method = draw(st.sampled_from(["GET", "POST", "CONNECT", "HEAD", "OPTIONS", "get", "G\x00T", "PRI"]))
    host = draw(hosts(port))
    if method == "CONNECT":
        target = host
    else:
        scheme = draw(st.sampled_from(["http://", "https://", "HTTP://", "", "//", "ws://"]))
        target = scheme + host + draw(st.sampled_from(["/", "/hits", "?x", "", "/%2e%2e/", "/" + "a" * 3000]))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.1 extra", ""]))
    headers = []
    if draw(st.booleans()):
        auth = draw(st.sampled_from([AUTH, AUTH + "x", "Basic", "", AUTH + "\r\nX: y"]))
        headers.append(("Proxy-Authorization", auth))
    if draw(st.booleans()):
        headers.append(("Host", draw(hosts(port))))
    headers += draw(st.lists(st.tuples(st.sampled_from(["Host", "Content-Length", "Transfer-Encoding",
                                                        "Connection", "X-Forwarded-For", "Upgrade", "", " x"]),
                                       junk), max_size=4))
    sep = draw(st.sampled_from(["\r\n", "\n", "\r"]))
    text = f"{method} {target} {version}{sep}" + "".join(f"{k}: {v}{sep}" for k, v in headers) + sep
    return text.encode("utf-8", "surrogatepass") + draw(st.binary(max_size=64))


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(5)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            out = b""
            while len(out) < 65536:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
            return out
        except OSError:
            return b""


def test_fuzzed_requests_never_crash_the_proxy_nor_reach_a_denied_host(proxy, site_mod):
    port, proc, tmp = proxy
    before = {h: hits(site_mod, h) for h in ("site-b.test", "127.0.0.1", "localhost")}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=requests(site_mod))
    def run(data):
        exchange(port, data)
        assert proc.poll() is None, "the proxy died"

    run()
    # an allowed request still works after the storm: the proxy is healthy
    from tests.reliability.test_fault_proxy_kill import fetch_via
    proxy_url = f"http://fz:fuzz-token-0123456789@127.0.0.1:{port}"
    assert fetch_via(proxy_url, f"http://site-a.test:{site_mod}/")[0] == 200
    assert fetch_via(proxy_url, f"http://site-b.test:{site_mod}/")[0] == 403
    after = {h: hits(site_mod, h) for h in before}
    assert after == before, f"a denied host was reached: {before} -> {after}"
