"""Run Triton kernels in its CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch


def use_triton_interpreter() -> None:
    """Call at the top of a test module, before it imports any Triton kernel: runs the kernels in Triton's CPU
    interpreter (``TRITON_INTERPRET=1``). Skips the module where triton is missing, and on a CUDA machine: the
    interpreter is chosen when a kernel is decorated, once per process, so setting it there would make every Triton
    kernel of the pytest run interpreted, the GPU tests' too (tests/gpu/test_cuda.py checks the compiled kernels)."""
    if torch.cuda.is_available():
        pytest.skip(
            "Triton's CPU interpreter tests; on a CUDA machine tests/gpu/test_cuda.py checks the compiled kernels",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's import, which reads it
    pytest.importorskip("triton", reason="triton is not installed (pip install triton); its kernels cannot be tested")
