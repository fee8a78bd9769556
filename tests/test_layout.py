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
#: which parts of sfguard each part may import (cli -> supervisor -> proxy_addons -> policy);
#: every part may also import sfguard.errors (SfguardError, below them all: it imports nothing)
BELOW_ALL = "sfguard.errors"
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
            if mod == BELOW_ALL:
                continue
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


def supervisor_rooms() -> list[str]:
    """supervisor's rooms, bottom to top, as docs/design.md section 3 writes them (the one place
    the order is written down)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("<!-- supervisor rooms, bottom to top", 1)[1].split("<!-- /supervisor rooms -->", 1)[0]
    lines = block.splitlines()[1:]     # after the marker's own line
    return [line.split()[0] for line in lines if line.strip() and not line.startswith("```")]


def rooms_on_disk() -> set[str]:
    sup = ROOT / "supervisor"
    return ({p.stem for p in sup.glob("*.py") if p.name != "__init__.py"}
            | {p.parent.name for p in sup.glob("*/__init__.py")})


def supervisor_targets(path: Path) -> list[tuple[int, str]]:
    """(line, room) of every import of a supervisor room in `path`: at the top, inside a
    function, or under `if TYPE_CHECKING:` alike."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "sfguard.supervisor":
            out.extend((node.lineno, a.name) for a in node.names)    # from sfguard.supervisor import home
        elif isinstance(node, ast.ImportFrom) and node.module:
            bits = node.module.split(".")
            if bits[:2] == ["sfguard", "supervisor"] and len(bits) > 2:
                out.append((node.lineno, bits[2]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                bits = a.name.split(".")
                if bits[:2] == ["sfguard", "supervisor"] and len(bits) > 2:
                    out.append((node.lineno, bits[2]))
    return out


def test_supervisor_rooms_are_all_in_the_written_order():
    order = supervisor_rooms()
    assert len(order) == len(set(order)), f"a room twice in docs/design.md: {order}"
    on_disk = rooms_on_disk()
    assert set(order) == on_disk, {"rooms missing from docs/design.md": sorted(on_disk - set(order)),
                                   "listed but absent": sorted(set(order) - on_disk)}


def test_supervisor_rooms_import_only_rooms_below_them():
    """Each room of supervisor/ imports only rooms below it in docs/design.md's order, so the
    rooms never import each other in a loop. A lazy import inside a function and a
    `TYPE_CHECKING` import count as much as one at the top: the first is still a dependency when
    it runs, the second still means one room cannot be read without the other, and both are how
    a loop comes back unnoticed."""
    rank = {room: i for i, room in enumerate(supervisor_rooms())}
    wrong = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        rel = path.relative_to(ROOT / "supervisor")
        if "__pycache__" in rel.parts or rel.parts == ("__init__.py",):
            continue
        mine = rel.parts[0].removesuffix(".py")
        for line, target in supervisor_targets(path):
            if target == mine:
                continue
            if target not in rank or mine not in rank or rank[target] > rank[mine]:
                wrong.append(f"supervisor/{rel}:{line}: {mine} imports {target}")
    assert not wrong, "imports against the room order of docs/design.md section 3:\n" + "\n".join(wrong)


def test_the_error_root_imports_nothing():
    """sfguard/errors.py is below every part: it imports nothing of sfguard (nor anything else),
    so that policy stays pure and stage-exec's fast entry (python -I -S) can import it."""
    tree = ast.parse((ROOT / "sfguard" / "errors.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
