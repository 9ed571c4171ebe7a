"""Layers import only downward: the import graph of eplb/ and planners/, built from the source.

Every `import` and `from ... import` counts, inside functions too (a lazy import hides an edge
from start-up time, not from the design). `from eplb import stats` is an edge to `eplb.stats`;
`eplb/__init__.py` is the facade: no module may import a name from `eplb` itself. The table
below is docs/design.md's; a module matches its longest listed prefix, so a new module of a
listed package (eplb.formats.x) needs no entry, and a new top-level module must get one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FACADE = "eplb"

LAYERS: dict[str, int] = {
    "eplb.errors": 0, "eplb._version": 0,
    "eplb.core": 1,
    "eplb.stats": 2,
    "eplb.dispatch": 3,
    "planners.api": 4,
    "planners": 5, "eplb.migration": 5,
    "eplb.planning": 6,
    "eplb.serving": 7, "eplb.evaluate": 7,
    "eplb.formats": 8,
    "eplb.runtime": 9,
    "eplb.integrations": 10,
    FACADE: 11,
}
"""Package (or module) -> layer, lowest first (docs/design.md, "Layers"). `eplb` itself (the
facade, `cli`, `__main__`, `commands/`) is the top: a module no other entry names lands there,
so nothing below may import it until it gets a row of its own."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    files = sorted((ROOT / "eplb").rglob("*.py")) + sorted((ROOT / "planners").rglob("*.py"))
    return {module_name(p): p for p in files}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported project module, line) for every import statement of `module`'s source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from eplb import stats` imports the submodule eplb.stats; `from eplb.x import y` imports eplb.x.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] not in ("eplb", "planners"):
                continue
            while t not in known and "." in t:  # `import eplb.formats.sglang` names a module; so does its prefix
                t = t.rpartition(".")[0]
            if t != module:
                found.append((t, node.lineno))
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    src = sources()
    known = set(src)
    return {m: imports(m, p, known) for m, p in src.items()}


def test_every_module_has_a_layer():
    missing = [m for m in sources() if layer_of(m) is None]
    assert not missing, f"modules without a layer in LAYERS (and docs/design.md): {missing}"


def test_no_module_imports_the_facade():
    bad = [f"{m} line {line}" for m, edges in graph().items() if m != FACADE
           for t, line in edges if t == FACADE]
    assert not bad, f"import a name from its own module, not from the eplb facade: {bad}"


def test_no_edge_points_to_a_higher_layer():
    bad = []
    for m, edges in graph().items():
        for t, line in edges:
            if t != FACADE and layer_of(t) > layer_of(m):
                bad.append(f"{m} (layer {layer_of(m)}) -> {t} (layer {layer_of(t)}), line {line}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    g = {m: sorted({t for t, _ in edges if t != FACADE}) for m, edges in graph().items()}
    # A package imports its own submodules (eplb.formats re-exports eplb.formats.detect): that
    # is one node, not a cycle, unless a submodule imports its package back for a name.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in g.get(m, ()):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def docs_table() -> dict[str, int]:
    """docs/design.md's layer table: each path in a row's second column -> the row's layer."""
    doc = (ROOT / "docs" / "design.md").read_text()
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for path in re.findall(r"`([^`]+)`", cells[1]):
                rows[path] = int(cells[0])
    return rows


def entry_path(name: str) -> str:
    """A LAYERS entry as docs/design.md writes it: `eplb/core/`, `planners/api.py`."""
    if name == FACADE:
        return "eplb/__init__.py"
    base = ROOT / Path(*name.split("."))
    return f"{name.replace('.', '/')}/" if base.is_dir() else f"{name.replace('.', '/')}.py"


def test_the_table_matches_docs_design():
    """docs/design.md's table is this one: every entry in its row, every row's path a real
    package or module at the layer this table gives it (the doc is the design)."""
    rows = docs_table()
    wrong = [f"{entry_path(m)}: LAYERS says {n}, docs/design.md {rows.get(entry_path(m), 'nothing')}"
             for m, n in LAYERS.items() if rows.get(entry_path(m)) != n]
    for path, n in rows.items():
        if not (ROOT / path).exists():
            wrong.append(f"{path}: in docs/design.md's table, not in the tree")
            continue
        name = module_name(ROOT / path) if path.endswith(".py") else path.rstrip("/").replace("/", ".")
        if layer_of(name) != n:
            wrong.append(f"{path}: docs/design.md says layer {n}, LAYERS {layer_of(name)}")
    assert not wrong, "docs/design.md's layer table and LAYERS differ:\n" + "\n".join(wrong)


def test_the_facade_imports_nothing_until_used():
    """`import planners.robust` first runs eplb/__init__.py (via eplb.errors): were the facade to
    import the upper layers there, they would import the half-initialised planner (a cycle that
    broke the kernels' side-process compiles). A fresh interpreter shows what it really loads."""
    import subprocess
    import sys

    code = ("import sys, planners.robust, planners.greedy, eplb.migration\n"
            "upper = sorted(m for m in sys.modules if m.startswith(('eplb.serving.policy', 'eplb.serving.rebalance',"
            " 'eplb.evaluate.replay', 'eplb.planning')))\n"
            "assert not upper, upper\n"
            "import eplb\n"
            "assert sorted(eplb.__all__) == sorted(eplb._EXPORTS), 'eplb.__all__ and its export table differ'\n"
            "assert eplb.Rebalancer.__module__ == 'eplb.serving.rebalance'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
