"""The house's shape, as issue 19 states it: few top-level modules, short files, no import cycle between
packages, the environment read in one module, and ``loop/`` (the engine) below the job and the CLI.

Imports are read from the source with :mod:`ast`. An import under ``if TYPE_CHECKING:`` is left out: it never
runs, and annotations naming a type of a higher layer (``ForwardBatch`` in a model's signature) are not a
dependency of the code.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "batchgen"
MAX_LINES = 300
# The one module that reads the process environment; everything else is handed what it needs.
ENVIRONMENT_READERS = {"batchgen/environment.py"}


def _product_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in suffixes and "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(path: Path) -> set[str]:
    """Modules of ``batchgen`` that ``path`` imports when it runs (top level and inside functions)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("batchgen"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name.startswith("batchgen"):
                found.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _package_of(module: str) -> str:
    """``batchgen.loop.engine`` → ``loop``; a top-level module is its own package (``errors``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "batchgen"


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _product_files(".py"):
        here = _package_of(_module_name(path))
        for target in _runtime_imports(path):
            there = _package_of(target)
            if there not in (here, "batchgen"):
                graph[here].add(there)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's nodes, found by a depth-first search from each node (the graph has ~10)."""
    cycles: list[list[str]] = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                cycles.append([*path, start])
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return cycles


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_packages() -> None:
    cycles = _cycles(_package_graph())
    assert not cycles, f"packages importing each other at run time: {[' -> '.join(c) for c in cycles]}"


def test_the_engine_imports_nothing_above_it() -> None:
    graph = _package_graph()
    assert {"kernels", "models", "sampling"} <= graph["loop"]  # the walk sees the loop's own imports
    for lower in ("loop", "models", "kernels", "sampling", "speculative"):
        above = graph.get(lower, set()) & {"cli", "job", "io", "bench"}
        assert not above, f"batchgen/{lower}/ imports {sorted(above)}"
    # speculative/ implements the loop's Drafter protocol; the loop never imports it.
    assert "speculative" not in graph["loop"]


def test_few_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py")
    assert len(top) <= 4, top


def test_no_product_file_over_300_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _product_files(".py", ".cpp", ".h")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_environment_is_read_in_one_module() -> None:
    readers = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in _product_files(".py")
        if "os.environ" in (text := p.read_text()) or "getenv(" in text
    )
    assert set(readers) <= ENVIRONMENT_READERS, f"read os.environ: {readers}"
