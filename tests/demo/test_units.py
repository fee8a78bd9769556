"""Parts of `sfguard demo` and `profiles check|login` that need no browser."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from sfguard import policy
from sfguard.supervisor.client import ops
from sfguard.supervisor.demo import run as demo
from sfguard.supervisor.demo.runner import _cond_fires
from sfguard.supervisor.pipeline.spec import validate_pipeline
from tests.demo.conftest import ROOT, SFGUARD, cli_env, leftovers, sfguard


@pytest.mark.parametrize("url, pattern", [
    ("http://127.0.0.1:8080/account", "127.0.0.1:8080"),
    ("https://Example.com/login?x=1", "example.com"),
    ("http://[::1]:9000/", "[::1]:9000"),
    ("http://site-a.test/", "site-a.test"),
])
def test_profile_ops_allow_the_url_host_first(tmp_path, url, pattern):
    # the run's allow list: the --url host (policy.allow_pattern_for_url), then the --allow extras
    got = ops.ProfileOps(tmp_path, "acct", url, allow=[" extra.test ", ""]).allow
    assert got == [pattern, "extra.test"]
    policy.compile_patterns(got)  # and they are valid allow_domains entries


@pytest.mark.parametrize("url", ["ftp://example.com/", "example.com", "http:///x", "http://a.com:99999/"])
def test_profile_ops_refuse_a_url_that_is_not_http(tmp_path, url):
    with pytest.raises(ops.OpError) as err:
        ops.ProfileOps(tmp_path, "acct", url)
    assert err.value.code == "invalid_url" and "not an http:// or https:// address" in str(err.value)


def test_the_client_loads_no_demo_fixture_or_cli_module():
    # runner-side operations stand alone: importing them pulls in neither the demo, the fixture
    # site nor the CLI (imports point one way: cli and demo -> client, never back)
    code = ("import sys, sfguard.supervisor.client.ops\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('sfguard.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=cli_env())
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "sfguard.supervisor.client.ops" in loaded
    assert [m for m in loaded if m.startswith(("sfguard.supervisor.demo", "sfguard.fixtures",
                                               "sfguard.cli"))] == []


@pytest.mark.parametrize("cond, output, fires", [
    (None, {}, True),
    ("logged_in eq false", {"logged_in": False}, True),
    ("logged_in eq false", {"logged_in": True}, False),
    ("logged_in ne false", {"logged_in": True}, True),
    ("logged_in == true", {"logged_in": True}, True),
    ("logged_in eq true", {}, False),
])
def test_route_conditions(cond, output, fires):
    assert _cond_fires(cond, output) is fires


def test_demo_policy_allows_only_the_fixture_on_loopback(tmp_path):
    pol = policy.load_policy(demo.write_demo_policy(tmp_path / "p.yaml", 41234))
    assert oct((tmp_path / "p.yaml").stat().st_mode & 0o777) == "0o600"
    allow = policy.compile_patterns(["127.0.0.1:41234"])
    d = pol.decide("127.0.0.1", 41234, allow)
    assert d.allowed and pol.check_address(d, "127.0.0.1").allowed
    # the shipped blocks are still there, other ports are still refused
    linkedin = policy.compile_patterns(["*.linkedin.com"])
    assert pol.decide("www.linkedin.com", 443, linkedin).reason == "blocked_by_policy"
    assert pol.decide("127.0.0.1", 41235, allow).reason == "port_not_allowed"


def test_example_pipeline_rewritten_to_the_fixture_port_validates(tmp_path):
    pol = demo.write_demo_policy(tmp_path / "p.yaml", 41234)
    copy = demo.prepare_pipeline(demo.EXAMPLE_PIPELINE, tmp_path / "pipe.yaml", 41234)
    rep = validate_pipeline(copy, policy_path=pol, check_tools=False)
    assert rep.ok, [str(i) for i in rep.issues]
    assert "8080" not in copy.read_text().split("stages:", 1)[1]
    assert {s.id: s.browser.allow_domains for s in rep.stages} == {
        "check": ["127.0.0.1:41234"], "login": ["127.0.0.1:41234"], "work": ["127.0.0.1:41234"]}
    assert demo._fixture_hosts(rep.stages) == []  # IP literals need no --resolve


@pytest.mark.parametrize("args", [
    ["profiles", "check", "acct", "--url", "http://127.0.0.1:9/account", "--logged-in", "http://127.0.0.1:9/account"],
    ["profiles", "login", "acct", "--url", "http://127.0.0.1:9/login"],
])
def test_profile_commands_without_a_guard_say_to_start_one(tmp_path, args):
    r = sfguard(*args, "--home", str(tmp_path / "home"))
    assert r.returncode == 3, (r.stdout, r.stderr)     # 3: the guard is not running
    assert f"sfguard start --home {tmp_path / 'home'}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--url", "ftp://x/", "--logged-in", "x"], "not an http:// or https:// address"),
    (["--url", "http://a.test/", "--logged-in", "x", "--allow", "*"], "allow"),
    (["--url", "http://a.test/"], "--logged-in"),
])
def test_check_input_errors(tmp_path, args, message):
    r = sfguard("profiles", "check", "acct", *args, "--home", str(tmp_path / "home"))
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_existing_profile_subcommands_still_listed():
    r = sfguard("profiles", "--help")
    for action in ("list", "show", "create", "clear", "check", "login"):
        assert action in r.stdout


def test_demo_refuses_a_home_with_a_running_guard(tmp_path):
    home = tmp_path / "home"
    env = cli_env()
    guard = subprocess.Popen([*SFGUARD, "start", "--home", str(home)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = guard.stdout.readline()
            if not line or line.strip() == b"sfguard: ready":
                break
        assert line.strip() == b"sfguard: ready"
        r = sfguard("demo", "--home", str(home))
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "already running" in r.stderr
        # it started nothing: no fixture site, no second guard
        assert "fixture login site" not in r.stdout
        ours = {guard.pid} | {c.pid for c in psutil.Process(guard.pid).children(recursive=True)}
        assert [l for l in leftovers(str(home)) if int(l.split(":")[0]) not in ours] == []
    finally:
        guard.terminate()
        guard.wait(30)
