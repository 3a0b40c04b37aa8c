"""Paged extend (prefill) attention in Triton: new tokens after a cached prefix, causal among themselves.

Algorithm: FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", 2023): one program per (request, query head, block of ``BLOCK_M`` new tokens) keeps its
queries in registers and streams K/V blocks of ``BLOCK_N`` positions with an online softmax (Milakov &
Gimelshein 2018), normalising once at the end. Keys and values of the prefix *and* of the new tokens are
read in place from the paged pool through ``req_to_token`` (the new tokens' K/V are stored before the
call), so there is no separate pass over the new tokens. Blocks past the diagonal are skipped.

Rows are ragged: request ``b``'s queries are rows ``qo_start[b] .. qo_start[b] + extend_lens[b]`` of
``q``. MIXED rounds need nothing special: a decoding row is a request extending one token.

Batch invariance (``--deterministic``): a query's result depends on its own row only. Key blocks start at position
0 for every query, the tiles are fixed by ``head_dim``, and a block past a query's position (the rest of its tile
may need it) changes nothing for it (its scores are -inf: the running max stays, its weights are exact zeros). So
the same query gives the same bits in any chunk of any prefill, as a verify row, and as a DECODE round's query run
through this kernel as an extend of one token (:class:`batchgen.kernels.attention.triton_backend.TritonAttnBackend`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from batchgen.kernels.triton import block_d, check_attention_shapes, check_last_dim_contiguous, dot_settings
from batchgen.kernels.triton.kv_block import attend_kv_block


@triton.jit
def _extend_kernel(
    q_ptr,
    o_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    qo_start_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_req,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP

    extend_len = tl.load(extend_lens_ptr + b)
    prefix_len = tl.load(prefix_lens_ptr + b)
    qo_start = tl.load(qo_start_ptr + b)
    req_row = tl.load(req_pool_indices_ptr + b)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < head_dim
    q_pos = prefix_len + offs_m

    q_rows = qo_start + offs_m
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Causal: the block's last query sees positions < prefix + min(end of block, extend_len). The grid is
    # sized for the longest request, so blocks past a shorter request's end run no iterations at all.
    block_end = tl.minimum((m_block + 1) * BLOCK_M, extend_len)
    kv_end = tl.where(m_block * BLOCK_M < extend_len, prefix_len + block_end, 0)

    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    token_row = req_to_token_ptr + req_row * stride_req
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Position 0 is visible to every row, so after the first block every row's max is finite.
    for block_start in range(0, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_block(
            q, acc, m_i, l_i, k_head, v_head, token_row, block_start, kv_end, q_pos, scale, stride_ks, stride_vs,
            offs_n, offs_d, mask_d, UPCAST, PRECISION,
        )  # fmt: skip

    # l_i is 0 only in a block past the request's end, whose rows are not stored.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


# True when Triton's interpreter runs this module's kernels: TRITON_INTERPRET=1 when it was imported.
INTERPRETED = isinstance(_extend_kernel, InterpretedFunction)


def extend_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    max_extend_len: int,
) -> torch.Tensor:
    """Attention of each request's new tokens over its cached prefix and, causally, over each other.

    Request ``b``'s query rows ``qo_start[b] + i`` (``i < extend_lens[b]``, at position
    ``prefix_lens[b] + i``) attend to the K/V in slots ``req_to_token[req_pool_indices[b], :prefix_lens[b]
    + i + 1]`` (page size 1; the new tokens' K/V already stored). Scale ``head_dim ** -0.5``; scores,
    softmax and accumulation in float32. Grid ``(batch, num_heads, cdiv(max_extend_len, BLOCK_M))``.

    Args:
        q: ``[T, num_heads, head_dim]``, all requests' new tokens back to back, same dtype as the buffers.
        k_buffer, v_buffer: one layer of the pool, ``[num_kv_heads, slots, head_dim]``.
        out: ``[T, num_heads, head_dim]``, written in place for every row some request owns.
        req_to_token: int64 ``[rows, max_context_len]`` KV slot of each (request row, position).
        req_pool_indices, prefix_lens, extend_lens, qo_start: int64 ``[batch]``: request rows, cached prefix
            lengths, new-token counts (tokens) and each request's first row in ``q``.
        max_extend_len: host int, ``max(extend_lens)``: sizes the grid.

    Returns:
        ``out``.

    Raises:
        ValueError: mismatched dtypes or shapes, an unsupported dtype, a non-contiguous head dimension, or
            ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[0]
    check_attention_shapes(q, k_buffer, v_buffer, out)
    check_last_dim_contiguous(q=q, k_buffer=k_buffer, v_buffer=v_buffer, out=out)
    batch = req_pool_indices.shape[0]
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return out
    dots = dot_settings(k_buffer.dtype, INTERPRETED)
    bd = block_d(head_dim)
    # 64x64 tiles keep q, K, V and the float32 accumulator in registers up to head_dim 128.
    block_m, block_n = (64, 64) if bd <= 128 else (32, 32)
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        qo_start,
        head_dim**-0.5,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=bd,
        UPCAST=dots.upcast,
        PRECISION=dots.precision,
        num_warps=4,
    )
    return out
