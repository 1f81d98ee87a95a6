"""The package's layout: no import cycle among ``remat/`` modules, no module over ~450 lines, no
script reaching the zoo through ``sys.path``.

Imports are read with ``ast`` (nothing is imported). An import is one of three kinds:

- **module-level**: runs when the module is imported (at the top, or under a top-level
  ``if``/``try``, but not under ``if TYPE_CHECKING:``);
- **function-level**: inside a function body, runs when the function is first called;
- **type-only**: under ``if TYPE_CHECKING:``, never runs.

Every kind counts. A function-level or type-only import that closes a cycle is still a cycle
between the two modules' jobs (each needs the other); deferring it only keeps the interpreter
from failing. So: module-level imports may form no cycle at all, with no exception; over all
imports together, the only cycles allowed are those closed by an edge in ``KNOWN_CYCLE_EDGES``,
each listed with why it is still there, and each such edge must still exist (remove it from the
list when its cycle is fixed). Importing ``a.b.c`` also runs the package ``a.b``'s
``__init__``; those implicit edges are not counted (every module would then import the
package that imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parents[1] / "remat"
MAX_LINES = 450

# (importer, imported): edges that close a cycle today, with why each is still there (none today).
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, kind: str) -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement under ``node`` with its kind (see the module docstring)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, kind
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _imports(child, "function" if kind == "module" else kind)
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.body:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), "type")
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), kind)
        else:
            yield from _imports(child, kind)


def _targets(module: str, is_package: bool, stmt: ast.stmt) -> list[str]:
    """The ``remat`` modules an import statement imports."""
    if isinstance(stmt, ast.Import):
        return [a.name for a in stmt.names if a.name in MODULES]
    assert isinstance(stmt, ast.ImportFrom)
    if stmt.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (stmt.level - 1)]
        source = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        source = stmt.module or ""
    out = []
    for alias in stmt.names:
        if f"{source}.{alias.name}" in MODULES:      # from package import submodule
            out.append(f"{source}.{alias.name}")
        elif source in MODULES:
            out.append(source)
    return out


def import_edges() -> dict[tuple[str, str], set[str]]:
    """(importer, imported) -> the kinds of import between them, over every ``remat`` module."""
    edges: dict[tuple[str, str], set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for stmt, kind in _imports(tree, "module"):
            for target in _targets(module, path.name == "__init__.py", stmt):
                if target != module:
                    edges.setdefault((module, target), set()).add(kind)
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(components: list[list[str]], edges: dict[tuple[str, str], set[str]]) -> str:
    return "; ".join(
        " / ".join(f"{a} -> {b} ({', '.join(sorted(edges[(a, b)]))})" for a in c for b in c if (a, b) in edges)
        for c in components)


def test_reads_the_package() -> None:
    edges = import_edges()
    assert len(MODULES) > 40 and "remat.passes.plan" in MODULES
    assert edges[("remat.passes.plan", "remat.passes.solve_greedy")] == {"module"}
    assert "type" in edges[("remat.compile_cache", "remat.compiled_graph")]


def test_no_cycle_among_module_level_imports() -> None:
    edges = import_edges()
    found = cycles({e for e, kinds in edges.items() if "module" in kinds})
    assert not found, f"import cycles among module-level imports: {_describe(found, edges)}"


def test_no_cycle_but_the_known_ones() -> None:
    edges = import_edges()
    gone = sorted(e for e in KNOWN_CYCLE_EDGES if e not in edges)
    assert not gone, f"known cycle edges no longer imported, remove them from KNOWN_CYCLE_EDGES: {gone}"
    found = cycles(set(edges) - set(KNOWN_CYCLE_EDGES))
    assert not found, f"import cycles (function-level and type-only imports count): {_describe(found, edges)}"
    # each known edge still closes a cycle; one that no longer does is no longer an exception
    for edge in KNOWN_CYCLE_EDGES:
        assert cycles(set(edges) - set(KNOWN_CYCLE_EDGES) | {edge}), (
            f"{edge[0]} -> {edge[1]} closes no cycle any more: remove it from KNOWN_CYCLE_EDGES")


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert cycles({("a", "b"), ("b", "c")}) == []


def test_no_module_over_the_line_limit() -> None:
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in MODULES.values()}
    over = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


# Scripts that still edit sys.path, with why: the zoo and the step helpers are importable
# (remat.testing.zoo, remat.testing.steps), so none of these is for the models.
KNOWN_SYS_PATH_EDITS: dict[str, str] = {
    "tests/test_solvers.py": "the determinism check's subprocess imports test_solvers itself",
}


def test_no_sys_path_edits_but_the_known_ones() -> None:
    root = PACKAGE.parent
    editing = {str(p.relative_to(root)) for folder in ("examples", "benchmarks", "tools", "tests")
               for p in sorted((root / folder).rglob("*.py"))
               if p.name != "test_layout.py" and ("sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text())}
    assert not editing - KNOWN_SYS_PATH_EDITS.keys(), (
        f"scripts editing sys.path: {sorted(editing - KNOWN_SYS_PATH_EDITS.keys())}; "
        "import the zoo from remat.testing.zoo and the step helpers from remat.testing.steps")
    stale = sorted(KNOWN_SYS_PATH_EDITS.keys() - editing)
    assert not stale, f"no longer editing sys.path, remove them from KNOWN_SYS_PATH_EDITS: {stale}"
