"""What a real site does, through the guard with real Chromium and agent-browser, over HTTPS
from an authority given with --ca-file (issue 33, section 4): HTTP/2 inside the CONNECT tunnel,
a WebSocket over wss://, Server-Sent Events, a download into the stage's artifacts folder (and
nowhere else), and a file upload refused with a clear message. The site is hypercorn serving
tests/real_site_app.py on loopback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from sfguard.supervisor.browsers import trust
from sfguard.supervisor.home import runtime_path
from tests.conftest import free_port
from tests.tls_site import issue, make_ca

from .test_ca_file import stage, start_guard
from .test_real_browser import as_stage

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(trust.certutil() is None, reason="certutil comes with ./dev setup (libnss3-tools)")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """(stage env, site origin, guard) for one stage allowed on secure.test."""
    tmp = tmp_path_factory.mktemp("realsite")
    ca = make_ca("sfguard real-site authority")
    cert, key = issue(ca, "secure.test", tmp)
    port = free_port()
    site = subprocess.Popen([sys.executable, "-m", "hypercorn", "--certfile", str(cert), "--keyfile", str(key),
                             "--bind", f"127.0.0.1:{port}", "tests.real_site_app:app"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    d = start_guard(tmp, "home", "--ca-file", str(ca.write(tmp / "ca.pem")), ports=(port,))
    try:
        env = stage(d, "r1", ["secure.test"])
        yield env, f"https://secure.test:{port}", d
    finally:
        d.finish()
        site.terminate()
        site.wait(10)


def result_of(env: dict, url: str, bound: float = 15.0) -> str:
    """Open `url` and wait (bounded) for the page's window.__result."""
    opened = as_stage(env, "open", url)
    assert opened.returncode == 0, opened.stderr
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        got = as_stage(env, "eval", "String(window.__result ?? '')").stdout.strip().strip('"')
        if got:
            return got
        time.sleep(0.2)
    return ""


def test_http2_inside_the_tunnel(guarded):
    env, origin, _ = guarded
    assert result_of(env, f"{origin}/proto") == "h2"


def test_a_websocket_over_wss(guarded):
    env, origin, _ = guarded
    assert result_of(env, f"{origin}/ws") == "pong:ping"


def test_server_sent_events(guarded):
    env, origin, _ = guarded
    assert result_of(env, f"{origin}/sse") == "e1,e2,e3"


def test_a_download_lands_in_the_artifacts_folder_only(guarded, tmp_path):
    """The stage's downloads go to one folder the guard made: under a root guard the browser
    user's own (`downloads` in its HOME, 0700, that user's), else the run's `artifacts`."""
    env, origin, d = guarded
    assert as_stage(env, "open", f"{origin}/files").returncode == 0
    name = "downloads" if os.geteuid() == 0 else "artifacts"
    folders = [p for p in runtime_path(d.home).rglob(name) if p.is_dir()]
    assert len(folders) == 1, folders
    if os.geteuid() == 0:
        st = folders[0].stat()
        assert st.st_mode & 0o777 == 0o700 and st.st_uid != 0, oct(st.st_mode)
    target = folders[0] / "report.csv"
    got = as_stage(env, "download", "#dl", str(target))
    assert got.returncode == 0, got.stderr
    deadline = time.monotonic() + 10
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert target.read_bytes() == b"id,value\n1,sfguard\n"
    outside = tmp_path / "report.csv"
    refused = as_stage(env, "download", "#dl", str(outside))
    assert refused.returncode != 0 and not outside.exists()


def test_a_file_upload_is_refused_with_a_clear_message(guarded, tmp_path):
    env, origin, _ = guarded
    f = tmp_path / "secret.txt"
    f.write_text("host file")
    assert as_stage(env, "open", f"{origin}/files").returncode == 0
    refused = as_stage(env, "upload", "#up", str(f))
    assert refused.returncode != 0
    said = refused.stderr + refused.stdout
    assert "would upload local files of the host into a page" in said, said
