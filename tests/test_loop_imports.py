"""The loop depends on no package above it: ``batchgen/loop`` imports nothing from speculative/, job/, io/ or cli/
at run time (speculative/ implements the loop's ``Drafter`` protocol, the job feeds the engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import batchgen.loop

ABOVE_THE_LOOP = ("batchgen.speculative", "batchgen.job", "batchgen.io", "batchgen.cli")


def _runtime_imports(path: Path) -> list[str]:
    """Modules ``path`` imports, leaving out ``if TYPE_CHECKING:`` blocks (never run)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_loop_imports_nothing_above_it() -> None:
    loop_dir = Path(batchgen.loop.__file__).parent
    found = {
        f"{path.name}: {name}"
        for path in sorted(loop_dir.glob("*.py"))
        for name in _runtime_imports(path)
        if name.startswith(ABOVE_THE_LOOP)
    }
    assert found == set()
    # The walk does see the loop's own imports (a walk that finds nothing at all would pass vacuously).
    assert "batchgen.loop.kv_cache" in _runtime_imports(loop_dir / "scheduler.py")
