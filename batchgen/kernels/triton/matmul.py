"""A batch-invariant GEMM in Triton: ``y = x W^T + b`` whose row ``i`` depends only on row ``i`` of ``x``.

cuBLAS picks its kernel, tile shape and split of the inner dimension (split-K) from the whole problem shape, the
row count included, so one row of a linear layer gets other bits in a batch of 1 than in a batch of 64 (He and
Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025, whose ``batch_invariant_ops`` replaces
the GEMM the same way). Here the tiles are fixed by the dtype and ``N`` alone, each program owns whole output tiles
(no split-K), and it walks the inner dimension in ``BLOCK_K`` steps from 0 upwards, accumulating in float32 in that
order: every output element is the same sequence of tile products whatever ``M`` is and whichever tile row it
falls in. ``--deterministic`` on the triton path runs every linear layer and the LM head through it
(:class:`batchgen.models.triton_linear.TritonLinear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from batchgen.kernels.triton import check_last_dim_contiguous, dot_settings


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + offs_k
        mask_k = k < K
        # Lanes past K load zeros, so a partial last step adds exact zeros to every sum.
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # W loaded already transposed, [BLOCK_K, BLOCK_N] (see the attention kernels: a dot on a tl.trans view is
        # slow in the interpreter).
        w_mask = mask_k[:, None] & mask_n[None, :]
        w_t = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w_t = w_t.to(tl.float32)
        acc = tl.dot(x, w_t, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


# True when Triton's interpreter runs this module's kernel: TRITON_INTERPRET=1 when it was imported.
INTERPRETED = isinstance(_matmul_kernel, InterpretedFunction)


@dataclass(frozen=True)
class MatmulTiles:
    """The tile of one program (``block_m`` rows by ``block_n`` outputs) and the inner-dimension step ``block_k``."""

    block_m: int
    block_n: int
    block_k: int


def matmul_tiles(n: int, dtype: torch.dtype) -> MatmulTiles:
    """The tiles of a GEMM with ``n`` outputs per row in ``dtype``: never a function of the row count, so a row's
    reduction order does not depend on the batch.

    Narrow outputs get narrower tiles so that a decode step (one tile of rows) still spreads over many programs, a
    GEMM of few rows being bound by reading the weights. float32 multiplies on the CUDA cores (IEEE products, see
    :func:`batchgen.kernels.triton.dot_settings`), whose accumulator lives in registers: a shorter ``block_k``.
    """
    block_n = 32 if n <= 4096 else 64
    return MatmulTiles(block_m=64, block_n=block_n, block_k=32 if dtype == torch.float32 else 64)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with each row's result independent of the other rows and of their count.

    Products and sums in float32 (IEEE float32 products for float32 inputs, the tensor cores' exact products of
    half-precision ones), the bias added in float32, one rounding to ``x``'s dtype at the end (as cuBLAS's and
    oneDNN's half-precision GEMMs do); the sum over ``K`` runs in ``block_k`` steps in order
    (:func:`matmul_tiles`).

    Args:
        x: ``[M, K]`` activations, float32/bfloat16/float16, unit stride along ``K``.
        weight: ``[N, K]`` (``nn.Linear``'s layout), x's dtype, unit stride along ``K``.
        bias: ``[N]`` in x's dtype, or ``None``.

    Returns:
        ``[M, N]`` in x's dtype, contiguous.

    Raises:
        ValueError: shapes or dtypes that do not match, an unsupported dtype, or a ``K`` stride other than 1.
    """
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w or weight.dtype != x.dtype or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype)):
        bias_shape = None if bias is None else (tuple(bias.shape), bias.dtype)
        raise ValueError(
            f"matmul of x {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)} {weight.dtype}, "
            f"bias {bias_shape}"
        )
    check_last_dim_contiguous(x=x, weight=weight)
    dots = dot_settings(x.dtype, INTERPRETED)
    tiles = matmul_tiles(n, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _matmul_kernel[(triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))](
        x,
        weight,
        bias if bias is not None else weight,  # not read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        UPCAST=dots.upcast,
        PRECISION=dots.precision,
        num_warps=4,
    )
    return out
