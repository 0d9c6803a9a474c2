"""docs/architecture.md names only what exists: every module it names (``domino.x.y``, or a name
defined in such a module, and ``x/y.py`` paths) is in the source, and its tier table gives each
module the tier ``tests/test_architecture.py`` does. A renamed or moved module fails here until
the page follows."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from test_architecture import _modules, _tier

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
DOTTED = re.compile(r"(?<![\w.])domino(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.py)`")
TIER_LINE = re.compile(r"^(\d+)\s+(.*)$")


@cache
def _defined(module_path: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(module_path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return frozenset(names)


def _resolves(dotted: str, modules: dict[str, Path]) -> bool:
    """``dotted`` is a module, or a name its longest module prefix defines (a class, ...)."""
    if dotted in modules:
        return True
    parent, _, name = dotted.rpartition(".")
    return parent in modules and name in _defined(modules[parent])


def _tier_table(text: str) -> dict[str, int]:
    """The modules of the page's first code block under "## Tiers", by the tier it shows."""
    block = text.split("## Tiers", 1)[1].split("```", 2)[1]
    tiers, current = {}, None
    for line in block.splitlines():
        m = TIER_LINE.match(line.strip())
        if m:
            current, line = int(m.group(1)), m.group(2)
        for name in re.findall(r"domino(?:\.\w+)*", line):
            tiers[name] = current
    return tiers


def test_every_module_the_page_names_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    modules = _modules()
    named = sorted(set(DOTTED.findall(text)))
    assert len(named) > 50, f"only {len(named)} module names found: the extraction broke"
    missing = [n for n in named if not _resolves(n, modules)]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_path_the_page_names_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    paths = sorted(set(PATH.findall(text)))
    assert paths, "no x/y.py paths found: the extraction broke"
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "src" / "domino").rglob("*.py")]
    missing = [p for p in paths
               if not ((ROOT / p).is_file() or any(f.endswith("/" + p) for f in files))]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_the_tier_table_matches_the_architecture_test() -> None:
    shown = _tier_table(PAGE.read_text(encoding="utf-8"))
    assert len(shown) > 20, f"only {len(shown)} modules in the tier table: the extraction broke"
    modules = _modules()
    unknown = sorted(n for n in shown if n not in modules)
    assert not unknown, f"the tier table names modules that do not exist: {unknown}"
    wrong = {n: (t, _tier(n)) for n, t in shown.items() if _tier(n) != t}
    assert not wrong, f"page tier vs tests/test_architecture.py's TIERS: {wrong}"
    top = {m for m in modules if m.count(".") == 1}
    absent = sorted(top - set(shown))
    assert not absent, f"top-level modules and packages the tier table leaves out: {absent}"


def test_every_file_the_extending_recipes_name_exists() -> None:
    """docs/extending.md's recipes name every file an addition touches: each must exist (a
    placeholder such as ``<name>.py`` is not a path and is skipped)."""
    text = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    paths = sorted(set(PATH.findall(text)))
    assert len(paths) > 20, f"only {len(paths)} paths found: the extraction broke"
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "src" / "domino").rglob("*.py")]
    missing = [p for p in paths
               if not ((ROOT / p).is_file() or any(f.endswith("/" + p) for f in files))]
    assert not missing, f"docs/extending.md names files that do not exist: {missing}"
