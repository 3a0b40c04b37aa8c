"""A built wheel holds every file batchgen reads from its own folders at run time (the C++ kernel sources and
headers, the random-model presets): each non-Python file under ``batchgen/`` matches ``pyproject.toml``'s
package-data for its package, as setuptools selects them."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from batchgen.kernels import cpu
from batchgen.models.random_presets import PRESETS_DIR

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "batchgen"


def _package_data() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+ (tomllib)")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def _shipped(path: Path, package_data: dict[str, list[str]]) -> bool:
    """Whether setuptools puts ``path`` in the wheel: a pattern of its nearest enclosing package matches the path
    relative to that package (patterns may name subfolders, as ``presets/*.json``)."""
    package = path.parent
    while not (package / "__init__.py").exists():
        package = package.parent
    name = ".".join(package.relative_to(ROOT).parts)
    relative = path.relative_to(package).as_posix()
    return any(fnmatch.fnmatch(relative, pattern) for pattern in package_data.get(name, []))


def test_every_data_file_under_the_package_ships() -> None:
    package_data = _package_data()
    files = [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    data_files = [p for p in files if p.suffix not in (".py", ".pyc")]
    assert data_files, "expected the kernel sources and presets under batchgen/"
    missing = [str(p.relative_to(ROOT)) for p in data_files if not _shipped(p, package_data)]
    assert not missing, f"not in pyproject.toml's package-data, so missing from a built wheel: {missing}"


def test_the_files_read_at_run_time_are_under_the_package() -> None:
    read_at_run_time = [*cpu._SOURCES, *cpu._HEADERS, *PRESETS_DIR.glob("*.json")]
    assert len(list(PRESETS_DIR.glob("*.json"))) >= 2  # random:llama-58m and random:llama-1b at least
    for path in read_at_run_time:
        assert path.is_file() and path.resolve().is_relative_to(PACKAGE), path
