"""House rules a reviewer would otherwise check by hand: no import cycle (a failure), and modules over 400 lines (a
warning: size is a smell to look at, never a reason to split one idea in two).

The import graph counts every import of a project module, at any depth of the file (an import
inside a function that dodges a cycle is still the cycle), and `from package import module`
as an import of the module.
"""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "runners")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_data" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules a module imports (resolving relative imports and `from pkg import mod`)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_edges_ok(a: str, b: str) -> bool:
    """A package's __init__ re-exporting its own modules is not a cycle with them."""
    return b.startswith(a + ".")


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: {m for m in _imports(n, p, known) if not _package_edges_ok(n, m)} for n, p in mods.items()}


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles (every import counts, inside functions too):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_runners_never_import_harness():
    graph = import_graph()
    bad = sorted(f"{n} imports {m}" for n, deps in graph.items() if n.startswith("runners") for m in deps if m.startswith("harness"))
    assert not bad, "\n".join(bad)


SIZE_ONLY = ("tests", "benchmarks")  # held to the size limit too; their imports are not a package graph


def _sized() -> dict[str, Path]:
    return {**_modules(), **{str(p.relative_to(ROOT)): p for d in SIZE_ONLY for p in sorted((ROOT / d).rglob("*.py"))}}


def test_long_modules_are_reported_as_a_warning():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _sized().items()}
    assert "harness" in sizes and "runners" in sizes  # the packages were found: nothing to report would be a silent pass
    long = sorted((n, name) for name, n in sizes.items() if n > MAX_LINES)
    if long:
        warnings.warn(f"modules over {MAX_LINES} lines (look at them; split only along an idea's seams): "
                      + ", ".join(f"{name} ({n})" for n, name in reversed(long)), stacklevel=1)


PROPERTY_ID = re.compile(r"P\d+(/.*)?|(P\d+,)+P\d+")  # "P3", "P1/I3 ...", "P1,P3,P4"


def test_no_property_id_literal_outside_the_registry():
    """A property is named by its registered object (harness/props): a string "P3" anywhere else is the id spread again."""
    bad = []
    for name, path in _modules().items():
        if not name.startswith("harness.") or name.startswith("harness.props"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and PROPERTY_ID.fullmatch(node.value):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not bad, "\n".join(bad)


# The private design note's file name, built from pieces so this file never names it itself.
PRIVATE_NOTE = "DESIGN" + "." + "md"
CITING = ("harness", "runners", "benchmarks", "tests")  # every module, and the pages that ship inside a package


def _product_text() -> list[Path]:
    files = [p for d in CITING for suffix in ("*.py", "*.md") for p in (ROOT / d).rglob(suffix) if "__pycache__" not in p.parts]
    return sorted(files + [ROOT / "conftest.py", ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def test_nothing_cites_the_private_design_note():
    """The design note does not ship: what a reader needs is in docs/ and the docstrings, in the project's own words."""
    files = _product_text()
    assert ROOT / "harness" / "props" / "reference.md" in files and ROOT / "docs" / "index.md" in files  # the walk found them
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
           for i, line in enumerate(p.read_text().splitlines(), 1) if PRIVATE_NOTE in line]
    assert not bad, f"{len(bad)} line(s) cite {PRIVATE_NOTE}, which does not ship (point to docs/ instead):\n" + "\n".join(bad)
