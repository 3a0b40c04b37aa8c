"""PyTorch elementwise ops whose result for a row does not depend on the rows beside it, for ``--deterministic`` on
the CPU where batchgen's own kernels do not run (float32 and float16 models)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

# PyTorch's CPU elementwise ops split their flat index range over threads once a call holds more elements than
# this (at::internal::GRAIN_SIZE); a call of fewer runs on one thread.
_ONE_THREAD_ELEMENTS = 32768


def silu_and_mul_by_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate_up = [gate | up]`` (``[rows, 2 * width]`` → ``[rows, width]``, any float
    dtype), computed in blocks of whole rows small enough to run on one thread each.

    Why: over a whole round, PyTorch splits the op's elements across threads wherever the flat index falls, so the
    row that straddles a split computes part of its SiLU on the vectorized ``exp`` and part on the scalar one,
    which round differently; that row's bits would then depend on the rows around it (``--deterministic`` promises
    they do not). On one thread every row of the ``[rows, width]`` view runs the same vectorized loop and the same
    scalar tail as it would alone.
    """
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(gate_up.shape[0], width)
    step = max(1, _ONE_THREAD_ELEMENTS // width)
    for start in range(0, gate_up.shape[0], step):
        block = gate_up[start : start + step]
        torch.mul(F.silu(block[:, :width]), block[:, width:], out=out[start : start + step])
    return out
