"""The package's shape, read from its source: tiers only import downward, no import cycle
(lazy in-function imports included), entry points live in ``domino.commands``, and no source
file outgrows about 450 lines. ``docs/architecture.md`` shows the same tiers."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first; a module may import from its own tier and the ones below. A name matches a
# module and everything under it; the longest match decides. (The package itself is at the
# bottom: it holds the version and only lazy exports.)
TIERS: list[tuple[str, ...]] = [
    ("domino", "domino.utils", "domino.safe_files", "domino.enums", "domino.plan", "domino.runtime",
     "domino.config", "domino.config_rules", "domino.config_fields", "domino.data",
     "domino.memory",
     "domino.distributed", "domino.supervisor",
     "domino.rank_fork", "domino.netem", "domino.flops", "domino.gemm_rate", "domino.precision",
     "domino.parallel_dims"),
    ("domino.tensor_parallel", "domino.context_parallel", "domino.timing"),
    ("domino.parallel_state", "domino.megatron_compat"),
    ("domino.transformer",),
    ("domino.models", "domino.language_model", "domino.gpt_model"),
    ("domino.pipeline",),
    ("domino.checkpoint",),
    ("domino.inference",),
    ("domino.training", "domino.bench"),
    ("domino.commands", "domino.cli"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "domino").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The domino modules ``path`` imports anywhere (functions too; not under TYPE_CHECKING,
    which never runs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("domino"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "domino"}
    return {m for m in found if m in modules}


def _tier(module: str) -> int:
    best, tier = -1, None
    for i, names in enumerate(TIERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, tier = len(name), i
    assert tier is not None, f"{module} is in no tier: add it to TIERS (and the architecture page)"
    return tier


def test_tiers_only_import_downward() -> None:
    modules = _modules()
    upward = [f"{m} (tier {_tier(m)}) imports {d} (tier {_tier(d)})"
              for m, path in sorted(modules.items()) for d in sorted(_imports(path, modules))
              if _tier(d) > _tier(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # A package's __init__ re-exporting its own modules is not a cycle with them.
    for m in graph:
        graph[m] = {d for d in graph[m] if not (m.startswith(d + ".") and modules[d].name
                                               == "__init__.py")}
    cycles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_entry_points_live_in_commands() -> None:
    from domino.cli import SUBCOMMANDS

    modules = _modules()
    entry = sorted(m for m, p in modules.items()
                   if {"add_arguments", "run"} <= {n.name for n in ast.parse(p.read_text())
                                                   .body if isinstance(n, ast.FunctionDef)})
    assert entry and all(m.startswith("domino.commands.") for m in entry), entry
    assert sorted(f"domino.commands.{module}" for module, _ in SUBCOMMANDS.values()) == entry


def test_no_source_file_over_450_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in (SRC / "domino").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}
    assert not long, long


def test_no_function_over_80_lines() -> None:
    """Functions a reader can hold: none longer than 80 lines (decorators and docstring
    included), so a long one is split by concept rather than squeezed."""
    long = {}
    for path in (SRC / "domino").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - start + 1) > 80:
                    long[f"{path.relative_to(SRC)}:{node.lineno} {node.name}"] = n
    assert not long, long


def test_ruff_clean_at_the_project_rules() -> None:
    """``ruff check`` passes on src, tests and scripts with pyproject's rules (line length 100,
    complexity 12, 50 statements per function)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    root = SRC.parent
    done = subprocess.run([ruff, "check", "--no-cache", "src", "tests", "scripts"], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
