"""What a test's guards left in the memory-backed runtime bases: bridge folders (`sfb-...`,
supervisor/stage/stage_bridge.py) and runtime folders (`sfg-...`, supervisor/home.py).

Both names end in a tag derived from the guard home's path, so a folder is matched to a home
exactly, by name: this looks only at folders of homes inside one test's (or this session's)
temporary folders, never at those of other test sessions running on the same machine, and it
never removes anything."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

MAX_DEPTH = 4          # homes sit at tmp_path/home, tmp_path/h, mktemp(...)/home, ...


def bases() -> list[Path]:
    """Where runtime and bridge folders can be (sfguard.supervisor.home.runtime_path's candidates)."""
    out = []
    for b in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm", tempfile.gettempdir()):
        if b and os.path.isdir(b) and Path(b) not in out:
            out.append(Path(b))
    return out


def _tag(path: Path) -> str:
    return hashlib.sha256(str(path).encode()).hexdigest()[:10]


def candidate_homes(root: Path, depth: int = MAX_DEPTH) -> list[Path]:
    """Every folder under `root` (itself included), `depth` levels deep, no symlinks followed."""
    out, level = [], [root]
    for _ in range(depth + 1):
        nxt = []
        for d in level:
            out.append(d)
            try:
                nxt += [p for p in d.iterdir() if p.is_dir() and not p.is_symlink()]
            except OSError:
                pass
        level = nxt
    return out


def left_by(root: Path, prefixes: tuple[str, ...] = ("sfb",)) -> list[Path]:
    """The `prefixes` folders that exist for any home under `root` (bridge folders by default)."""
    if not root.is_dir():
        return []
    names = {f"{p}-{os.getuid()}-{_tag(h)}" for h in candidate_homes(root) for p in prefixes}
    return sorted(b / n for b in bases() for n in names if (b / n).exists())
