"""Run records on the shared PostgreSQL store (issue 48): a run recorded by one guard host is
listed, opened, exported and verified from another host's home (its own records folder has
none), against the one shared audit chain; a copy edited on the way is found."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import psycopg

from tests.console.conftest import console_url
from tests.console.test_console_scope import redeem, request
from tests.daemon.test_runs import stage
from tests.pg.conftest import ROOT


def cli(guards, home, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", "runs", *args, "--home", str(home)],
                          cwd=ROOT, env=guards.env(guards.tmp), capture_output=True, text=True, timeout=120)


def test_a_run_recorded_on_one_host_is_listed_opened_and_verified_on_another(guards, tmp_path):
    g1, g2 = guards.start("g1"), guards.start("g2")
    assert g1.call("POST", "/v1/runs", {"run_id": "fleet-1", "pipeline": "/p/fleet.yaml"})[0] == 201
    assert stage(g1, "fleet-1", "s1", profile="fleet-acct")[0] == 200
    # while it runs, the other host lists it as active
    listed = [json.loads(x) for x in cli(guards, g2.home, "list", "--json").stdout.splitlines()]
    assert [(x["run_id"], x["state"]) for x in listed] == [("fleet-1", "active")]
    assert g1.call("POST", "/v1/runs/fleet-1/end", {"outcome": "succeeded"})[0] == 200
    assert not (g2.home / "records" / "fleet-1").exists()
    found = cli(guards, g2.home, "list", "--json", "--profile", "fleet-acct")
    listed = [json.loads(x) for x in found.stdout.splitlines()]
    assert [(x["run_id"], x["outcome"], x["pipeline"], x["profiles"]) for x in listed] == [
        ("fleet-1", "succeeded", "fleet.yaml", ["fleet-acct"])]
    shown = cli(guards, g2.home, "show", "fleet-1", "--json")
    assert shown.returncode == 0, shown.stderr
    kinds = [json.loads(x)["kind"] for x in shown.stdout.splitlines()]
    assert kinds[0] == "run_started" and "stage_ready" in kinds and kinds[-1] == "run_ended"
    verified = cli(guards, g2.home, "verify", "fleet-1", "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout + verified.stderr
    out = tmp_path / "fleet-1.zip"
    assert cli(guards, g2.home, "export", "fleet-1", "--out", str(out)).returncode == 0
    with zipfile.ZipFile(out) as z:
        assert "fleet-1/index.html" in z.namelist() and "fleet-1/timeline.jsonl" in z.namelist()
    # the console of the other host lists and opens it too
    status, body = g2.call("POST", "/v1/console/link", {"ttl_s": 600})
    assert status == 200
    console = console_url(g2.banner)
    cookie = f"sfguard_console={redeem(console, body['url'])}"
    status, html = request(console, "GET", "/runs/fleet-1", cookie=cookie)
    assert status == 200 and "stage s1 (attempt 1) ready" in html
    # an edit of the shared copy is found: the other host's copy is checked against the chain
    with psycopg.connect(guards.url) as conn:
        conn.execute("UPDATE sfguard_run_record_lines SET body = convert_to(replace(convert_from(body, 'UTF8'), "
                     "'\"outcome\":\"succeeded\"', '\"outcome\":\"failed\"'), 'UTF8')")
    verified = cli(guards, g2.home, "verify", "fleet-1", "--json")
    assert verified.returncode == 1 and "chain" in verified.stdout, verified.stdout
