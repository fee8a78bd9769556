"""The fixture login site behaves like a real site with a login (issue 7)."""
from __future__ import annotations

import hashlib
import http.cookiejar
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from http.cookies import SimpleCookie
from pathlib import Path

import aiohttp
import pytest

from sfguard.fixtures.login_server import cookie_marker, make_app, start_login_server

ROOT = Path(__file__).resolve().parents[2]


def set_cookies(resp) -> dict[str, object]:
    jar = SimpleCookie()
    for header in resp.headers.getall("Set-Cookie", []):
        jar.load(header)
    return dict(jar)


async def login(client, user="operator", password="correct-horse", nxt=None):
    data = {"user": user, "password": password}
    if nxt is not None:
        data["next"] = nxt
    return await client.post("/login", data=data, allow_redirects=False)


@pytest.fixture
async def client(aiohttp_client):
    return await aiohttp_client(make_app())


@pytest.mark.parametrize("path", ["/account"])
async def test_logged_out_visitor_is_sent_to_the_form(client, path):
    resp = await client.get(path, allow_redirects=False)
    assert resp.status == 302
    assert resp.headers["Location"] == "/login?next=/account"


async def test_login_form_has_the_named_fields_and_sign_in_button(client):
    text = await (await client.get("/login")).text()
    assert "name='user'" in text and "name='password'" in text
    assert ">Sign in</button>" in text


async def test_login_sets_one_persistent_and_one_session_cookie(client):
    resp = await login(client)
    assert resp.status == 302 and resp.headers["Location"] == "/account"
    cookies = set_cookies(resp)
    assert set(cookies) == {"sf_persist", "sf_session"}
    persist, session = cookies["sf_persist"], cookies["sf_session"]
    assert persist["max-age"] == str(30 * 24 * 3600) and not persist["expires"]
    assert not session["max-age"] and not session["expires"]      # session-only
    assert persist["httponly"] and session["httponly"]
    assert persist["path"] == "/" and session["path"] == "/"
    assert len(persist.value) == 32 and persist.value != session.value
    # random per login
    again = set_cookies(await login(client))
    assert again["sf_persist"].value != persist.value


async def test_logged_in_visitor_sees_account_with_user_name(client):
    await login(client)
    resp = await client.get("/account", allow_redirects=False)
    assert resp.status == 200
    assert "Signed in as operator" in await resp.text()


@pytest.mark.parametrize("user,password", [("operator", "wrong"), ("someone", "correct-horse"), ("", "")])
async def test_wrong_credentials_do_not_log_in(client, user, password):
    resp = await login(client, user, password)
    assert resp.headers["Location"] == "/login?error=1"
    assert set_cookies(resp) == {}
    assert (await client.get("/account", allow_redirects=False)).status == 302


async def test_persistent_cookie_alone_keeps_the_login(client):
    """After a browser restart only sf_persist is left: still logged in."""
    cookies = set_cookies(await login(client))
    client.session.cookie_jar.clear()
    resp = await client.get("/account", allow_redirects=False,
                            headers={"Cookie": f"sf_persist={cookies['sf_persist'].value}"})
    assert resp.status == 200


async def test_logout_ends_the_login(client):
    await login(client)
    resp = await client.get("/logout", allow_redirects=False)
    assert resp.headers["Location"] == "/login"
    assert (await client.get("/account", allow_redirects=False)).status == 302


@pytest.mark.parametrize("nxt,expected", [
    ("/cookies", "/cookies"), ("//evil.test/x", "/account"), ("http://evil.test/", "/account"), ("", "/account"),
])
async def test_next_parameter_only_accepts_local_paths(client, nxt, expected):
    resp = await login(client, nxt=nxt)
    assert resp.headers["Location"] == expected


async def test_cookie_pages_show_names_and_markers_never_values(client):
    cookies = set_cookies(await login(client))
    data = await (await client.get("/cookies.json")).json()
    values = {n: m.value for n, m in cookies.items()}
    assert data["cookies"] == {n: hashlib.sha256(v.encode()).hexdigest()[:8] for n, v in values.items()}
    assert data["cookies"]["sf_persist"] == cookie_marker(values["sf_persist"])
    page = await (await client.get("/cookies")).text()
    for name, value in values.items():
        assert name in page and cookie_marker(value) in page
        assert value not in page and value not in str(data)


@pytest.mark.parametrize("host", ["site-a.test", "site-b.test:8080"])
async def test_any_host_is_served_and_shown(client, host):
    resp = await client.get("/", headers={"Host": host})
    assert f"Host: {host}" in await resp.text()
    assert (await (await client.get("/cookies.json", headers={"Host": host})).json())["host"] == host


async def test_hits_count_requests_per_host_and_path(client):
    for _ in range(2):
        await client.get("/", headers={"Host": "site-a.test"})
    await client.get("/account", headers={"Host": "site-b.test"}, allow_redirects=False)
    hits = {(h["host"], h["path"]): h["count"] for h in (await (await client.get("/hits.json")).json())["hits"]}
    assert hits[("site-a.test", "/")] == 2
    assert hits[("site-b.test", "/account")] == 1
    assert ("site-b.test", "/") not in hits


async def test_hits_say_when_the_first_and_latest_request_came(client):
    start = time.time()
    await client.get("/", headers={"Host": "site-a.test"})
    between = time.time()
    await client.get("/", headers={"Host": "site-a.test"})
    end = time.time()
    (row,) = [h for h in (await (await client.get("/hits.json")).json())["hits"]
              if (h["host"], h["path"]) == ("site-a.test", "/")]
    assert start <= row["first"] <= between <= row["last"] <= end


async def test_start_login_server_serves_on_a_free_port():
    runner, url = await start_login_server(user="u1", password="p1")
    try:
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
            async with s.post(url + "/login", data={"user": "u1", "password": "p1"}) as r:
                assert "Signed in as u1" in await r.text()
    finally:
        await runner.cleanup()


def test_command_line_prints_ready_and_takes_credentials_from_env():
    env = dict(os.environ, SFGUARD_FIXTURE_USER="envuser", SFGUARD_FIXTURE_PASSWORD="envpass")
    proc = subprocess.Popen([sys.executable, "-m", "sfguard.fixtures.login_server", "--port", "0"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("ready http://127.0.0.1:")
        url = line.split()[1]
        body = urllib.parse.urlencode({"user": "envuser", "password": "envpass"}).encode()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        with opener.open(url + "/login", data=body, timeout=10) as r:
            assert "Signed in as envuser" in r.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0


def test_command_line_rejects_a_bad_port():
    out = subprocess.run([sys.executable, "-m", "sfguard.fixtures.login_server", "--port", "70000"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--port" in out.stderr
