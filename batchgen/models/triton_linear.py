"""Linear layers on Triton's batch-invariant GEMM (``--deterministic`` on the triton path).

Importing this module imports ``triton``: :meth:`batchgen.models.source.ModelSource.load` does so only when the
mode asks for it.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.triton.matmul import matmul


class TritonLinear(nn.Module):
    """``y = x W^T + b`` by :func:`batchgen.kernels.triton.matmul.matmul`: a row's output bits depend only on that
    row, never on how many rows share the call.

    Args:
        weight: ``[out_features, in_features]``, kept as it is (a tied output projection shares the embedding's).
        bias: ``[out_features]`` or ``None``.

    ``forward(x [T, in_features]) → [T, out_features]`` in the weight's dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)
