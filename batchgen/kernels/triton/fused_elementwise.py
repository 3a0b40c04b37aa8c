"""RMSNorm (optionally after a residual add), SiLU-and-multiply and rotary embeddings, each one Triton kernel.

In eager PyTorch these run as chains of small kernels: RMSNorm as eight (cast, square, mean, add, rsqrt, multiply,
cast back, weight), RoPE as fourteen for q and k, SwiGLU's activation as two. At small decode batches on a GPU
such kernels cost more than the layer's weights take to read, so each chain here is one launch. The arithmetic
follows the torch code in :mod:`batchgen.models.llama` and :mod:`batchgen.models.rotary` step for step, rounding
to the activations' dtype wherever that code does (after the normalisation and before the weight, after the
SiLU, after each RoPE product), so half-precision results agree with it to the last place except for summation
order (RMSNorm's mean) and exp: compiled for a GPU, ``tl.exp`` is the hardware's approximate exponential, a few
float32 places off (more for large arguments: ~14 places at 30), which moves a half-precision rounding rarely and
a float32 model's SiLU by ~1e-6 relative. RoPE is launched without multiply-add fusion, which would otherwise
round one product of each sum together with the sum instead of before it as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import check_last_dim_contiguous


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    sum_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_s,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 elements in a long prefill
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the activations' dtype as torch's add is, before the norm reads it.
        summed = (r + x).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019, as transformers' ``LlamaRMSNorm``) of ``x`` ``[rows, hidden]``, or of
    ``residual + x`` when ``residual`` (same shape and dtype) is given.

    Returns ``(normed, summed)``, both ``[rows, hidden]`` in ``x``'s dtype: ``weight * (s * rsqrt(mean(s²) + eps))``
    with ``s`` the input in float32, the normalised value rounded to the dtype before the weight; ``summed`` is
    ``residual + x`` (``x`` itself without a residual), the next residual stream.

    Raises:
        ValueError: a tensor whose last dimension is not contiguous.
    """
    check_last_dim_contiguous(x=x, weight=weight)
    if residual is not None:
        check_last_dim_contiguous(residual=residual)
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            summed,
            weight,
            out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            summed.stride(0),
            out.stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n_cols),
            num_warps=4 if n_cols <= 2048 else 8,
        )
    return out, summed


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * n]`` holding gate then
    up. Returns ``[rows, n]`` in the input's dtype, the SiLU rounded to it before the product (as ``F.silu``).

    Raises:
        ValueError: a last dimension that is odd or not contiguous.
    """
    check_last_dim_contiguous(gate_up=gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must hold gate and up halves, got a last dimension of {width}")
    n_cols = width // 2
    out = torch.empty(rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n_cols, BLOCK=block
        )
    return out


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_table,
    num_q_heads,
    half,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    pos = tl.load(positions_ptr + token)
    # The tables repeat their first half (HF's layout); cast to the activations' dtype as transformers does.
    cos = tl.load(cos_ptr + pos * stride_table + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + offs, mask=mask, other=0.0)
    if head < num_q_heads:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out_ptr + (token * num_q_heads + head) * 2 * half
    else:
        kv_head = head - num_q_heads
        src = k_ptr + token * stride_kt + kv_head * stride_kh
        dst = k_out_ptr + (token * (tl.num_programs(1) - num_q_heads) + kv_head) * 2 * half
    dtype = q_out_ptr.dtype.element_ty
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded to the dtype before the sum, as in the torch code.
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-(x2 * sin)).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(dst + offs, out1.to(dtype), mask=mask)
    tl.store(dst + half + offs, out2.to(dtype), mask=mask)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (Su et al. 2021) in transformers' rotate-half layout on q ``[T, H, D]`` and k ``[T, Hkv, D]`` (same
    dtype; rows may be strided, as views of a fused QKV output) at ``positions`` (int64 ``[T]``), from float32
    tables ``[max_positions, D]`` whose two halves repeat (:class:`batchgen.models.rotary.RotaryEmbedding`).

    Returns new contiguous ``(q, k)`` of the same shapes and dtype.

    Raises:
        ValueError: a tensor whose last dimension is not contiguous, or an odd head_dim.
    """
    check_last_dim_contiguous(q=q, k=k, cos_table=cos_table, sin_table=sin_table)
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens, num_heads + k.shape[1])](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos_table,
            sin_table,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_table.stride(0),
            num_heads,
            half,
            BLOCK=triton.next_power_of_2(half),
            enable_fp_fusion=False,
        )
    return q_out, k_out
