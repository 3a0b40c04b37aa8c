"""Linear layers of bfloat16 models whose every output sums in one fixed order (``brgemm_linear.cpp``): what
``--deterministic`` runs on CPUs where PyTorch's brgemm (oneDNN's batch-reduce GEMM ukernel) has bfloat16, that is
AMX or AVX512-BF16 (:func:`~batchgen.kernels.cpu.brgemm_bf16_supported`).

oneDNN's bfloat16 GEMM picks its kernel by the row count, so a row's output changes in its last bits with the
rows beside it; a brgemm call sums each output over the inner dimension in one order whatever the number of rows,
so a row's output is the same alone and in any round. Products are exact and sums float32, as in oneDNN's GEMM,
in another order: results can differ from ``F.linear``'s in their last float32 bits.
"""

from __future__ import annotations

import torch

from batchgen.kernels.cpu import build_problem

# Columns (rows of W) per packed block: one brgemm call's width.
COLUMN_BLOCK = 64


def pack_for_brgemm(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` bfloat16 (``in`` even) as blocks of :data:`COLUMN_BLOCK` output columns in brgemm's
    VNNI layout: ``[ceil(out / COLUMN_BLOCK), in / 2, COLUMN_BLOCK, 2]``, the last block padded with zero columns.

    Raises:
        ValueError: ``weight`` is not 2-D bfloat16 with an even ``in``.
    """
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(
            f"pack_for_brgemm needs a 2-D bfloat16 weight of even width, got {weight.dtype} {weight.shape}"
        )
    out_features, in_features = weight.shape
    blocks = -(-out_features // COLUMN_BLOCK)
    padded = weight.detach().new_zeros(blocks * COLUMN_BLOCK, in_features)
    padded[:out_features] = weight.detach()
    return padded.view(blocks, COLUMN_BLOCK, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def brgemm_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, round_to_bf16: bool = False
) -> torch.Tensor:
    """``x W^T + b``: ``x`` ``[rows, in]`` bfloat16, ``packed`` from :func:`pack_for_brgemm`, ``bias``
    ``[out_features]`` float32 or ``None``; returns ``[rows, out_features]`` float32, unrounded, or with
    ``round_to_bf16`` each float32 sum rounded once to bfloat16 (to nearest even). A row's result depends on that
    row only.

    Raises:
        RuntimeError: (``batchgen::brgemm_linear: ...``) other dtypes, shapes that disagree, tensors off the CPU or
            not contiguous; the extension's build problem when it did not build.
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    out: torch.Tensor = torch.ops.batchgen.brgemm_linear(x, packed, out_features, bias, round_to_bf16)
    return out


def brgemm_linear_silu_and_mul(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """SwiGLU's activation over its gate/up projection in one pass: ``bf16(bf16(silu(g)) * u)`` for ``g`` and
    ``u`` the bfloat16-rounded gate and up halves of ``x W^T``, where ``W`` ``[2 * intermediate, in]`` holds the gate
    rows then the up rows and ``packed`` is :func:`pack_for_brgemm`'s. The bits of :func:`brgemm_linear` with
    ``round_to_bf16`` followed by :func:`batchgen.kernels.cpu.fused_elementwise.silu_and_mul`, without writing the
    ``[rows, 2 * intermediate]`` projection to memory and reading it back.

    ``x`` ``[rows, in]`` bfloat16 → ``[rows, intermediate]`` bfloat16; ``intermediate`` a multiple of
    :data:`COLUMN_BLOCK`. A row's result depends on that row only.

    Raises:
        RuntimeError: (``batchgen::brgemm_linear_silu_and_mul: ...``) as :func:`brgemm_linear`, or an
            ``intermediate`` that ``packed`` does not hold as two whole halves of blocks; the extension's build
            problem when it did not build.
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    out: torch.Tensor = torch.ops.batchgen.brgemm_linear_silu_and_mul(x, packed, intermediate)
    return out
