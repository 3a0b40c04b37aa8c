"""batchgen: offline batch generation for Hugging Face-format causal LMs.

:class:`Generator` and :func:`run` are the Python API (docs/python.md); they are imported on first use, so that
``import batchgen`` stays light (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.api.generator import Generator
    from batchgen.api.run import RunInterrupted, run

__version__ = "0.1.0"
__all__ = ["Generator", "RunInterrupted", "__version__", "run"]

_LAZY = {"Generator": "batchgen.api.generator", "run": "batchgen.api.run", "RunInterrupted": "batchgen.api.run"}


def __getattr__(name: str) -> Any:
    """``batchgen.Generator``, ``batchgen.run`` and ``batchgen.RunInterrupted``, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module 'batchgen' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
