"""Linear layers on bfloat16 or float16 weights computed in float32 (``half_linear.cpp``), for CPUs where those
dtypes' GEMMs run in float32 (no BF16 units: AVX2 alone, or AVX-512 without BF16;
:func:`~batchgen.models.packed_linear.cpu_gemm_dtype`).

There a half-precision model's linear layers run in float32 for every row count, reading the model's own weights
(half the bytes of a float32 copy) and widening them to float32: a round of many rows through PyTorch's float32
brgemm on each block of weights widened in cache, a round of a few rows (bound by reading the weights) on stream
tiles that read them from memory once. Each output is one chain of fused multiply-adds over the inner dimension in
order, then the bias, on either route (:func:`routes_agree`), so a row's result never depends on the other rows
of its round: the layers are batch invariant as they stand, ``--deterministic`` or not.
"""

from __future__ import annotations

import functools

import torch

from batchgen.kernels.cpu import build_problem

COLUMN_BLOCK = 64  # output columns per packed block (kColumnBlock in half_linear.cpp)


def pack_half_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` bfloat16 or float16 as blocks of :data:`COLUMN_BLOCK` output columns, each block
    ``W^T``'s rows for its columns: ``[ceil(out / COLUMN_BLOCK), in, COLUMN_BLOCK]`` in the weight's dtype, the
    last block padded with zero columns.

    Raises:
        ValueError: ``weight`` is not 2-D bfloat16 or float16.
    """
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2:
        raise ValueError(f"pack_half_weight needs a 2-D bfloat16 or float16 weight, got {weight.dtype} {weight.shape}")
    out_features, in_features = weight.shape
    blocks = -(-out_features // COLUMN_BLOCK)
    padded = weight.detach().new_zeros(blocks * COLUMN_BLOCK, in_features)
    padded[:out_features] = weight.detach()
    return padded.view(blocks, COLUMN_BLOCK, in_features).transpose(1, 2).contiguous()


def half_weight_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b`` in float32: ``x`` ``[rows, in]`` float32 or the weight's dtype, ``packed`` from
    :func:`pack_half_weight`, ``bias`` ``[out_features]`` float32 or ``None``; returns ``[rows, out_features]``
    float32, unrounded. Each output is ``fma`` over ``k = 0 .. in - 1`` in order from zero, plus the bias: a row's
    result depends on that row only.

    Raises:
        RuntimeError: (``batchgen::half_weight_linear: ...``) other dtypes, shapes that disagree, tensors off the
            CPU or not contiguous; the extension's build problem when it did not build.
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    out: torch.Tensor = torch.ops.batchgen.half_weight_linear(x, packed, out_features, bias)
    return out


@functools.cache
def routes_agree() -> bool:
    """Whether the kernel's two routes give the same bits here: PyTorch's float32 brgemm forms the same chain of
    fused multiply-adds as the kernel's stream tiles (oneDNN's ukernel, with oneDNN enabled and AVX2 or better;
    its sgemm fallback blocks the sum otherwise), tried once at run time. Where they do not, the kernel runs every
    round on stream tiles (still batch invariant, slower for many rows) and the model's layers take float32 copies
    for oneDNN instead (:func:`~batchgen.models.packed_linear.half_weight_runs`). ``False`` where the kernels do not
    build."""
    return build_problem() is None and bool(torch.ops.batchgen.half_linear_routes_agree())
