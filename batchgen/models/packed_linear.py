"""Linear layers with oneDNN-prepacked weights, for bfloat16 models on the CPU.

A bfloat16 ``F.linear`` on the CPU runs oneDNN, which reorders the weight into its blocked layout on every call;
for the short GEMMs of a decode step (a few dozen rows) that reorder is a large part of the call. Packing each
weight once at load time (``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's CPU weight prepacking
uses) and calling ``torch.ops.mkldnn._linear_pointwise`` on the packed weight gives the same kernel the same
inputs: outputs are bit-identical to ``F.linear`` (tests/test_packed_linear.py), 15-45 % faster on this
workload's decode shapes. One packed weight serves every row count.
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENV_SWITCH = "BATCHGEN_CPU_PREPACK"
_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; any row count runs on the packed weight


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of ``dtype`` on ``device`` are packed: bfloat16 on a CPU whose oneDNN has bf16 kernels,
    unless ``$BATCHGEN_CPU_PREPACK`` is ``0``. float32 stays on ``F.linear`` (MKL), the reference path."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "off", "no"):
        return False
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over a oneDNN-packed ``W``.

    Args:
        weight: ``[out_features, in_features]`` bfloat16 on the CPU (copied into the packed layout).
        bias: ``[out_features]`` or ``None``.

    ``forward(x [T, in_features]) → [T, out_features]``, bfloat16.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear` of its weights; return how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += prepack_linears(child)
    return count
