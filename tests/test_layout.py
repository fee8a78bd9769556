"""The shape of the tree (docs/design.md section 3): imports point one way, every package is
in the wheel, no production module grows past what one person reads in a sitting."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"policy": "policy", "proxy_addons": "proxy_addons", "supervisor": "supervisor", "cli": "cli",
         "fixtures": "fixtures", "sfguard": "sfguard"}
#: which parts of sfguard each part may import (cli -> supervisor -> proxy_addons -> policy)
MAY_IMPORT = {
    "policy": {"policy"},
    "proxy_addons": {"proxy_addons", "policy"},
    "supervisor": {"supervisor", "proxy_addons", "policy"},
    "cli": {"cli", "supervisor", "proxy_addons", "policy", "fixtures"},
    "fixtures": {"fixtures"},
    "sfguard": {"cli"},          # python -m sfguard
}
MAX_LINES = 500


def modules() -> list[tuple[str, Path]]:
    return [(part, p) for part, folder in PARTS.items()
            for p in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts]


def sfguard_imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.ImportFrom) and node.module == "sfguard":
            out.extend((node.lineno, f"sfguard.{a.name}") for a in node.names)  # from sfguard import policy
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return [(n, m) for n, m in out if m.startswith(("sfguard", ".")) or m.split(".")[0] in PARTS]


def test_imports_point_one_way():
    wrong = []
    for part, path in modules():
        rel = path.relative_to(ROOT)
        for line, mod in sfguard_imports(path):
            bits = mod.split(".")
            if mod.startswith(".") or bits[0] != "sfguard":
                wrong.append(f"{rel}:{line}: {mod} (import it as sfguard.X, absolute)")
                continue
            if len(bits) == 1:
                continue  # the namespace root itself (the stage-exec fast entry extends its path)
            target = bits[1]
            allowed = MAY_IMPORT[part]
            if part == "supervisor" and target == "fixtures" and rel.parts[1] == "demo":
                continue  # the demo starts the fixture login site
            if target not in allowed:
                wrong.append(f"{rel}:{line}: {part} imports {mod}")
            if part == "supervisor" and rel.parts[1] == "client" and bits[2:3] == ["demo"]:
                wrong.append(f"{rel}:{line}: the runner-side client imports the demo")
    assert not wrong, "\n".join(wrong)


def test_every_package_is_in_the_wheel():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(conf["packages"]), conf["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            sub = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *sub)))
    assert found == listed, {"missing from pyproject": sorted(found - listed),
                             "listed but absent": sorted(listed - found)}


@pytest.mark.parametrize("part", sorted(set(PARTS) - {"sfguard"}))
def test_no_production_module_over_500_lines(part):
    long = {str(p.relative_to(ROOT)): n for q, p in modules() if q == part
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
