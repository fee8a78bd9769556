"""The CLI as a user meets it: every command and subcommand has help, `--version`, one
exit-code table (0 ok, 1 the check failed, 2 usage or input error, 3 guard not running), no
traceback for anything typed, read-only commands create nothing, hints keep --home, and shell
completion generated from the parser. Each case is a subprocess."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sfguard(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, **(env or {}))
    full.pop("SFGUARD_HOME", None) if env is None or "SFGUARD_HOME" not in env else None
    proc = subprocess.run([sys.executable, "-m", "sfguard.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=full, input=stdin)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr, proc.stderr
    return proc


def all_commands() -> list[tuple[str, ...]]:
    sys.path.insert(0, str(ROOT))
    from sfguard.cli.completion_cmd import tree
    from sfguard.cli.main import build_parser
    return [n["path"] for n in tree(build_parser(["--help"]))]


COMMANDS = all_commands()


def test_every_command_is_listed():
    names = {p for p in COMMANDS if len(p) == 1}
    for expected in ("start", "status", "proxy", "policy", "profiles", "audit", "sweep", "validate",
                     "demo", "doctor", "completion"):
        assert (expected,) in names
    for sub in (("policy", "test"), ("policy", "replay"), ("policy", "diff"), ("profiles", "check"),
                ("profiles", "login"), ("audit", "verify")):
        assert sub in COMMANDS


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "sfguard")
def test_help_has_a_description(path):
    proc = sfguard(*path, "--help")
    assert proc.returncode == 0, proc.stderr
    usage, _, rest = proc.stdout.partition("\n\n")
    assert usage.startswith("usage: sfguard")
    description = rest.split("\n\n", 1)[0].strip()
    assert description and not description.startswith(("positional arguments", "options")), proc.stdout
    assert "--home HOME" not in proc.stdout        # one spelling: --home DIR
    assert "ACTION" not in usage                   # one spelling: SUBCOMMAND
    if len(path) == 1 and any(len(p) == 2 and p[0] == path[0] for p in COMMANDS):
        assert "SUBCOMMAND" in usage, usage


def test_top_level_help_names_every_command_and_the_exit_codes():
    out = sfguard("--help").stdout
    for word in ("profiles", "check", "login", "completion", "exit codes: 0 ok, 1", "3 the guard is not running"):
        assert word in out


def test_version():
    proc = sfguard("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("sfguard ") and proc.stdout.split()[1][0].isdigit()
    doctor = sfguard("doctor")
    assert f"ok       {proc.stdout.strip()}" in doctor.stdout


def test_doctor_json():
    import json
    proc = sfguard("doctor", "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["ok"] else 1)
    assert out["version"] and {c["what"] for c in out["checks"]} >= {"browser", "agent-browser", "display"}


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


# (argv with HOME for the home, expected exit code, text in stderr)
TABLE = [
    (["status", "--home", "HOME"], 3, "start it with `sfguard start --home HOME`"),
    (["status", "--home", "HOME", "--json"], 3, "no guard is running on HOME"),
    (["approvals", "list", "--home", "HOME"], 3, "no guard is running on HOME"),
    (["approvals", "approve", "ap_0123456789abcdef0123", "--home", "HOME"], 3, "no guard is running on HOME"),
    (["profiles", "check", "p1", "--url", "http://127.0.0.1:9/", "--logged-in", "*/in", "--home", "HOME"], 3,
     "`sfguard start --home HOME`"),
    (["profiles", "login", "p1", "--url", "http://127.0.0.1:9/", "--home", "HOME"], 3, "no guard is running"),
    (["profiles", "list", "--home", "HOME"], 2, "no guard home at HOME"),
    (["profiles", "show", "p1", "--home", "HOME"], 2, "no guard home at HOME"),
    (["audit", "verify", "--home", "HOME"], 2, "no guard home at HOME"),
    (["audit", "show", "--home", "HOME"], 2, "no guard home at HOME"),
    (["keys", "status", "--home", "HOME"], 2, "no guard home at HOME"),
    (["keys", "status", "--json", "--home", "HOME"], 2, "no guard home at HOME"),
    (["keys", "retire", "one", "--home", "HOME"], 2, "VERSION: a key version number"),
    (["sweep", "--home", "HOME"], 2, "no guard home at HOME"),
    (["validate", "MISSING"], 2, "cannot read"),
    (["policy", "validate", "MISSING"], 2, "cannot read"),
    (["policy", "explain", "a.com", "--policy", "MISSING"], 2, "not valid"),
    (["policy", "test", "MISSING"], 2, "no such file"),
    (["nosuchcommand"], 2, "invalid choice"),
    (["profiles", "show", "../etc", "--home", "HOME"], 2, ""),
]


@pytest.mark.parametrize("argv,code,text", TABLE, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_exit_code_table_and_no_state_created(tmp_path, argv, code, text):
    home = tmp_path / "typo-home"
    missing = tmp_path / "missing.yaml"
    argv = [str(home) if a == "HOME" else str(missing) if a == "MISSING" else a for a in argv]
    before = _tree(tmp_path)
    proc = sfguard(*argv)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert text.replace("HOME", str(home)) in proc.stderr
    assert _tree(tmp_path) == before          # nothing created, not even the home


@pytest.mark.parametrize("argv", [
    ["profiles", "list"], ["profiles", "show", "p1"], ["audit", "verify"], ["audit", "show"],
    ["profiles", "create", "p1"], ["status"], ["sweep"], ["start"],
])
def test_home_that_is_a_file_is_a_clear_input_error(tmp_path, argv):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    proc = sfguard(*argv, "--home", str(afile))
    assert proc.returncode in (2, 3), proc.stdout + proc.stderr
    assert str(afile) in proc.stderr
    assert "FileExistsError" not in proc.stderr


def test_read_only_commands_on_an_existing_home_create_nothing(tmp_path):
    home = tmp_path / "home"
    env = {"SFGUARD_HOME": str(home), "SFGUARD_KEY_PROVIDER": "file"}
    assert sfguard("profiles", "create", "p1", env=env).returncode == 0
    before = _tree(home)
    for argv in (["profiles", "list"], ["profiles", "show", "p1"], ["profiles", "list", "--json"],
                 ["audit", "verify"], ["audit", "verify", "--json"], ["audit", "show"],
                 ["keys", "status"], ["keys", "status", "--json"]):
        proc = sfguard(*argv, env=env)
        assert proc.returncode == 0, (argv, proc.stderr)
        assert _tree(home) == before, argv
    assert "p1" in sfguard("profiles", "list", env=env).stdout


def test_audit_verify_json_reports_damage(tmp_path):
    import json
    home = tmp_path / "home"
    env = {"SFGUARD_HOME": str(home), "SFGUARD_KEY_PROVIDER": "file"}
    sfguard("profiles", "create", "p1", env=env)
    ok = json.loads(sfguard("audit", "verify", "--json", env=env).stdout)
    assert ok["ok"] is True and ok["records"] >= 1
    log = home / "audit.log"
    log.write_text(log.read_text().replace("p1", "p2"))
    proc = sfguard("audit", "verify", "--json", env=env)
    assert proc.returncode == 1
    bad = json.loads(proc.stdout)
    assert bad["ok"] is False and bad["line"] == 1 and "edited" in bad["problem"]


def test_bash_completion_completes_commands_and_options():
    bash = shutil.which("bash")
    if bash is None:
        pytest.fail("bash is required for the completion test")
    script = sfguard("completion", "bash").stdout
    probe = script + "\n" + "\n".join([
        'COMP_WORDS=(sfguard pol); COMP_CWORD=1; _sfguard; echo "1:${COMPREPLY[*]}"',
        'COMP_WORDS=(sfguard policy ""); COMP_CWORD=2; _sfguard; echo "2:${COMPREPLY[*]}"',
        'COMP_WORDS=(sfguard policy explain --e); COMP_CWORD=3; _sfguard; echo "3:${COMPREPLY[*]}"',
        'COMP_WORDS=(sfguard profiles list --h); COMP_CWORD=3; _sfguard; echo "4:${COMPREPLY[*]}"',
    ])
    out = subprocess.run([bash, "-c", probe], capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert out[0] == "1:policy"
    assert set(out[1][2:].split()) >= {"validate", "explain", "test", "replay", "diff"}
    assert out[2] == "3:--exit-code"
    assert set(out[3][2:].split()) == {"--help", "--home"}


def test_zsh_completion_names_every_subcommand():
    script = sfguard("completion", "zsh").stdout
    assert script.startswith("#compdef sfguard")
    for path in COMMANDS:
        if len(path) >= 1:
            assert "_sfguard_" + "_".join(w.replace("-", "_") for w in path) + "()" in script
    assert "'--home[" in script and ":value:_files'" in script
