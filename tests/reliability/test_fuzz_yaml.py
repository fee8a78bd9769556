"""`sites.yaml` and pipeline YAML under hostile input: fuzzed documents give validation errors,
never a traceback; YAML bombs and huge files are refused quickly (bounded by a timeout)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfguard import policy
from sfguard.policy.schema import MAX_POLICY_BYTES
from sfguard.supervisor.pipeline.spec import MAX_PIPELINE_BYTES, validate_pipeline
from tests.daemon.conftest import ROOT

pytestmark = pytest.mark.reliability
EXAMPLES = int(os.environ.get("SFGUARD_FUZZ_EXAMPLES", "25")) * 8

POLICY_KEYS = ["version", "mode", "ports", "block", "allow_always", "private_networks", "allow",
               "tab_quota", "quiet", "x"]
PIPELINE_KEYS = ["name", "stages", "browser", "profile", "allow_domains", "login_check", "url",
                 "logged_in", "logged_out", "selector", "headed", "next", "when", "id", "x"]
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
           | st.text(max_size=30) | st.sampled_from(["*", "*.com", "a..b", "::1", "10.0.0.0/8",
                                                    "xn--", "example.com:99999", "@pipeline"]))


def docs(keys):
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                        | st.dictionaries(st.sampled_from(keys) | st.text(max_size=8), kids, max_size=5),
                        max_leaves=20)


mutations = st.sampled_from(["", "\t", ": :", "- [", "{", "&a x", "*a", "!!python/object:os.system",
                             "\x00", "\ufeff", "---\n---", "? ", "%YAML 1.1\n"])


def render(doc, mutation: str, where: int) -> str:
    text = yaml.safe_dump(doc, allow_unicode=True) if doc is not None else ""
    where = where % (len(text) + 1)
    return text[:where] + mutation + text[where:]


@settings(max_examples=EXAMPLES, deadline=None)
@given(doc=docs(POLICY_KEYS), mutation=mutations, where=st.integers(0, 10**6))
def test_fuzzed_sites_yaml_gives_validation_errors_only(doc, mutation, where):
    text = render({"version": 1, "mode": "enforce", **doc} if isinstance(doc, dict) else doc,
                  mutation, where)
    try:
        policy.parse_policy(text, "fuzz.yaml")
    except policy.PolicyError as exc:
        assert exc.issues and all(i.message for i in exc.issues)
        assert "Traceback" not in str(exc)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=docs(PIPELINE_KEYS), mutation=mutations, where=st.integers(0, 10**6))
def test_fuzzed_pipeline_yaml_gives_validation_errors_only(tmp_path, doc, mutation, where):
    path = tmp_path / "pipeline.yaml"
    path.write_text(render(doc, mutation, where), errors="surrogatepass")
    report = validate_pipeline(path, check_tools=False)
    assert report.ok or all(i.message for i in report.errors)


BILLION_LAUGHS = "lol0: &l0 [lol]\n" + "".join(
    f"lol{i}: &l{i} [{', '.join([f'*l{i-1}'] * 10)}]\n" for i in range(1, 10))
MERGE_BOMB = "a: &a {x: 1}\nb: {<<: *a}\n" * 1


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("bomb", [BILLION_LAUGHS, "version: 1\n" + BILLION_LAUGHS, MERGE_BOMB],
                         ids=["laughs", "laughs-in-policy", "merge"])
def test_yaml_bombs_are_refused_quickly(tmp_path, bomb):
    p = tmp_path / "sites.yaml"
    p.write_text(bomb)
    r = cli("policy", "validate", str(p), timeout=30)       # the bound: 30 s, it takes < 1 s
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
    assert "alias" in (r.stdout + r.stderr).lower() or "anchor" in (r.stdout + r.stderr).lower()
    pipe = tmp_path / "pipeline.yaml"
    last = "l9" if "lol9" in bomb else "a"
    for where in ("mcp", "io", "browser", "prompt"):   # the bomb as the value of real fields
        pipe.write_text(bomb + f"stages:\n  - id: s1\n    {where}: *{last}\n")
        r = cli("validate", "--no-tool-check", str(pipe), timeout=30)
        assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout, r.stdout + r.stderr
        assert len(r.stdout) < 100_000, "the alias was expanded into the report"


def test_huge_files_are_refused_quickly(tmp_path):
    big = tmp_path / "sites.yaml"
    with open(big, "wb") as fh:
        fh.write(b"version: 1\n")
        fh.truncate(MAX_POLICY_BYTES + 1)                  # sparse: cheap to make
    r = cli("policy", "validate", str(big), timeout=30)
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
    assert "over the 64 MiB limit" in r.stdout + r.stderr, r.stdout + r.stderr
    pipe = tmp_path / "pipeline.yaml"
    pipe.write_bytes(b"stages: []\n" + b"#" * MAX_PIPELINE_BYTES)
    r = cli("validate", "--no-tool-check", str(pipe), timeout=30)
    assert r.returncode != 0 and "larger than 1 MiB" in r.stdout + r.stderr, r.stdout + r.stderr
