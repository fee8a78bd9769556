"""`sfguard start --ca-file PEM`: the guard's browsers, and only they, trust a private
certificate authority besides the system's, with certificate checks on. Real `sfguard start`,
Chromium and agent-browser against loopback HTTPS sites whose certificates a test authority
issued (tests/tls_site.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sfguard.supervisor.browsers import trust
from sfguard.supervisor.home import runtime_path
from tests.tls_site import TlsSite, issue, make_ca

from .conftest import ROOT, Daemon
from .test_real_browser import as_stage

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(trust.certutil() is None, reason="certutil comes with ./dev setup (libnss3-tools)")]


@pytest.fixture
def sites(tmp_path):
    """secure.test (issued by the authority given to the guard) and rogue.test (by another)."""
    ours, other = make_ca("sfguard test authority"), make_ca("an authority nobody gave the guard")
    d = tmp_path / "tls"
    d.mkdir()
    secure = TlsSite(*issue(ours, "secure.test", d), label="secure site")
    rogue = TlsSite(*issue(other, "rogue.test", d), label="rogue site")
    yield ours.write(tmp_path / "ca.pem"), secure, rogue
    secure.close()
    rogue.close()


def start_guard(tmp_path, name: str, *extra: str, ports=()) -> Daemon:
    home = (tmp_path / name).absolute()
    pol = tmp_path / f"{name}-sites.yaml"
    pol.write_text(f"version: 1\nmode: enforce\nports: [80, 443, {', '.join(map(str, ports))}]\nblock: []\n"
                   "private_networks:\n  allow: [127.0.0.1/32]\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    d = Daemon(home, env, tmp_path / f"{name}.log")
    d.start("--policy", str(pol), "--resolve", "secure.test=127.0.0.1", "--resolve", "rogue.test=127.0.0.1", *extra)
    return d


def stage(d: Daemon, run: str, allow: list[str]) -> dict:
    assert d.call("POST", "/v1/runs", {"run_id": run})[0] == 201
    status, answer = d.call("POST", f"/v1/runs/{run}/stages",
                            {"stage_id": "s1", "attempt": 1,
                             "browser": {"profile": "acct", "headed": False, "allow_domains": allow}})
    assert status == 200, answer
    return answer["env"]


def page_of(env: dict, url: str) -> str:
    opened = as_stage(env, "open", url)
    if opened.returncode != 0:
        return "ERROR " + opened.stderr + opened.stdout
    return as_stage(env, "get", "text", "body").stdout


def test_the_browsers_trust_the_given_authority_and_no_other(tmp_path, sites):
    ca, secure, rogue = sites
    d = start_guard(tmp_path, "home", "--ca-file", str(ca), ports=(secure.port, rogue.port))
    try:
        assert "--ca-file sfguard test authority" in d.banner
        st = d.call("GET", "/v1/status")[1]
        assert [c["subject"] for c in st["trusted_cas"]] == ["sfguard test authority"]
        env = stage(d, "r1", ["secure.test", "rogue.test"])
        a = f"https://secure.test:{secure.port}"
        # the given authority: the page loads, and a Secure; SameSite=None cookie works
        assert "secure site" in page_of(env, f"{a}/login")
        assert "sf_tls=1" in page_of(env, f"{a}/cookies")
        # another authority: still refused (certificate checks are on)
        shown = page_of(env, f"https://rogue.test:{rogue.port}/")
        assert "rogue site" not in shown and ("CERT" in shown or "ERROR" in shown), shown
        # the login check names the certificate error, never "logged out"
        check = {"url": f"https://rogue.test:{rogue.port}/account",
                 "logged_in": f"https://rogue.test:{rogue.port}/account",
                 "logged_out": [f"https://rogue.test:{rogue.port}/login*"]}
        status, body = d.call("POST", "/v1/runs/r1/login-check", {"profile": "acct", "login_check": check})
        assert status == 422 and body["error"]["code"] == "login_check_failed", body
        assert "CERT" in body["error"]["message"], body
        # only the guard's browsers: nothing in the guard user's own NSS store or HOME
        assert not (tmp_path / ".pki").exists()
        stores = [p for p in runtime_path(d.home).rglob("cert9.db")]
        assert stores and all(oct(p.stat().st_mode & 0o777) == "0o600" for p in stores)
        assert d.call("POST", "/v1/runs/r1/end", {"outcome": "succeeded"})[0] == 200
        assert not list(runtime_path(d.home).rglob("cert9.db"))      # the browser's HOME went with it
        # `sfguard status` shows it to the operator
        out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "status", "--home", str(d.home)],
                             cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=60).stdout
        assert "browsers also trust sfguard test authority" in out, out
        out = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "doctor", "--home", str(d.home)],
                             cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=60).stdout
        assert "trusted CAs: the guard on this home" in out and "sfguard test authority" in out, out
    finally:
        d.finish()


def test_without_the_ca_file_the_private_site_is_refused(tmp_path, sites):
    _, secure, rogue = sites
    d = start_guard(tmp_path, "plain", ports=(secure.port, rogue.port))
    try:
        assert "--ca-file" not in d.banner
        env = stage(d, "r1", ["secure.test"])
        shown = page_of(env, f"https://secure.test:{secure.port}/login")
        assert "secure site" not in shown, shown
    finally:
        d.finish()


@pytest.mark.parametrize("content, fault", [
    (b"not a certificate", "no PEM certificate"),
    (None, "cannot be read"),
    ("site", "is not a certificate authority"),
])
def test_a_bad_ca_file_stops_the_start(tmp_path, content, fault):
    path = tmp_path / "ca.pem"
    if content == "site":
        ca = make_ca("x")
        crt, _ = issue(ca, "leaf.test", tmp_path)
        path.write_bytes(crt.read_bytes().split(b"-----END CERTIFICATE-----")[0] + b"-----END CERTIFICATE-----\n")
    elif content is not None:
        path.write_bytes(content)
    r = subprocess.run([sys.executable, "-m", "sfguard.cli.main", "start", "--home", str(tmp_path / "h"),
                        "--ca-file", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and fault in r.stderr and str(path) in r.stderr, r.stderr
