"""Paged decode attention in Triton: one query token per request, split-K over the sequence.

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023).
A single query row gives too little parallelism per (request, head), so the sequence is cut into ``NUM_KV_SPLITS``
slices. Stage 1 runs one program per (request, KV head, slice): an online-softmax (Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022) pass over its slice for every query head of the GQA group at once, so each K/V row
is loaded once per group. It writes the slice's normalised partial output and log-sum-exp. Stage 2 runs one program
per (request, query head) and merges the slices, each weighted by ``exp(lse_slice - lse_total)``.

The slice bounds are computed in the kernels from ``seq_lens``, and both grids depend only on the batch size, so one
launch serves any sequence lengths: a captured CUDA graph stays valid on replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from batchgen.kernels.triton import block_d, check_attention_shapes, check_last_dim_contiguous, dot_settings
from batchgen.kernels.triton.kv_block import attend_kv_block


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_req,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    head_dim,
    GROUP: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < head_dim
    heads = kv_head * GROUP + offs_g

    seq_len = tl.load(seq_lens_ptr + b)
    req_row = tl.load(req_pool_indices_ptr + b)
    # Same formula in stage 2, which derives from it which slices hold any token.
    split_len = tl.cdiv(seq_len, NUM_KV_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    token_row = req_to_token_ptr + req_row * stride_req
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # Every query of the group sees the whole slice, and each block holds a key below end (block_start).
    last_pos = end - 1 + tl.zeros([BLOCK_H], tl.int64)
    for block_start in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_kv_block(
            q, acc, m_i, l_i, k_head, v_head, token_row, block_start, end, last_pos, scale, stride_ks, stride_vs,
            offs_n, offs_d, mask_d, UPCAST, PRECISION,
        )  # fmt: skip

    # An empty slice (short sequence) writes nothing; stage 2 skips it by the same bounds. The condition is folded
    # into the head bound, not and-ed in as a scalar: the interpreter makes that an int32 mask tl.store rejects.
    mask_out = offs_g < tl.where(end > start, GROUP, 0)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l_i is 0 only in an empty slice, whose results are not stored
    tl.store(
        mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
        acc / l_safe[:, None],
        mask=mask_out[:, None] & mask_d[None, :],
    )
    tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log(l_safe), mask=mask_out)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    seq_lens_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    head_dim,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim

    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(seq_len, NUM_KV_SPLITS)
    # Slices stage 1 left empty were never written: their scratch holds stale values, so mask them out.
    valid = (offs_s < NUM_KV_SPLITS) & (offs_s * split_len < seq_len)
    lse = tl.load(mid_lse_ptr + b * stride_mlb + head * stride_mlh + offs_s, mask=valid, other=float("-inf"))
    o = tl.load(
        mid_o_ptr + b * stride_mob + head * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=valid[:, None] & mask_d[None, :],
        other=0.0,
    )
    # A padded row with seq_len 0 has no valid slice: its max is -inf, so shift by 0 instead and output 0.
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.where(valid, tl.exp(lse - lse_max), 0.0)
    w_sum = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(o_ptr + b * stride_ob + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)


# True when Triton's interpreter runs this module's kernels: TRITON_INTERPRET=1 when it was imported.
INTERPRETED = isinstance(_decode_split_kernel, InterpretedFunction)


def decode_scratch(
    batch_size: int, num_heads: int, head_dim: int, num_kv_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the split results :func:`decode_attention_fwd` writes between its two stages.

    Returns:
        ``(mid_o, mid_lse)``: float32 ``[batch_size, num_heads, num_kv_splits, head_dim]`` normalised
        partial outputs and float32 ``[batch_size, num_heads, num_kv_splits]`` log-sum-exps (natural log).
        Uninitialised: stage 1 writes every slice stage 2 reads.
    """
    mid_o = torch.empty((batch_size, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((batch_size, num_heads, num_kv_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    num_kv_splits: int,
) -> torch.Tensor:
    """Attention of one new query token per request over its whole paged sequence (Flash-Decoding split-K).

    Request ``b`` attends to the K/V in slots ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` (page
    size 1), its own new token included (stored before the call). Scale ``head_dim ** -0.5``; scores,
    softmax and accumulation in float32. No host sync: lengths are read on the device, and the grids are
    ``(batch, num_kv_heads, num_kv_splits)`` and ``(batch, num_heads)``, so the call is CUDA-graph safe.

    Args:
        q: ``[batch, num_heads, head_dim]`` queries, same dtype as the buffers (float32/bfloat16/float16).
        k_buffer, v_buffer: one layer of the pool, ``[num_kv_heads, slots, head_dim]``.
        out: ``[batch, num_heads, head_dim]``, written in place; its dtype is the output dtype.
        req_to_token: int64 ``[rows, max_context_len]`` KV slot of each (request row, position).
        req_pool_indices, seq_lens: int64 ``[batch]`` request rows and sequence lengths (tokens, >= 1;
            a row of length 0 gets a zero output).
        mid_o, mid_lse: float32 scratch from :func:`decode_scratch` with at least ``batch`` rows and exactly
            ``num_kv_splits`` slices; their contents on entry do not matter.
        num_kv_splits: slices per sequence; a fixed constant per caller (a new value compiles a new kernel).

    Returns:
        ``out``.

    Raises:
        ValueError: mismatched dtypes or shapes, an unsupported dtype, a non-contiguous head dimension, or
            ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[0]
    check_attention_shapes(q, k_buffer, v_buffer, out)
    if (
        mid_o.shape[0] < batch
        or mid_o.shape[1:] != (num_heads, num_kv_splits, head_dim)
        or mid_lse.shape != mid_o.shape[:3]
        or mid_o.dtype != torch.float32
        or mid_lse.dtype != torch.float32
    ):
        raise ValueError(
            f"mid_o {tuple(mid_o.shape)} {mid_o.dtype}, mid_lse {tuple(mid_lse.shape)} {mid_lse.dtype}: not float32 "
            f"scratch for {batch} rows of {num_heads} heads and {num_kv_splits} splits"
        )
    check_last_dim_contiguous(q=q, k_buffer=k_buffer, v_buffer=v_buffer, out=out, mid_o=mid_o, mid_lse=mid_lse)
    if batch == 0:
        return out
    dots = dot_settings(k_buffer.dtype, INTERPRETED)
    group = num_heads // num_kv_heads
    bd = block_d(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        head_dim**-0.5,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        head_dim,
        GROUP=group,
        NUM_KV_SPLITS=num_kv_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        # Wide heads get fewer keys per block so K, V and the float32 accumulator fit in registers.
        BLOCK_N=64 if bd <= 128 else 32,
        BLOCK_D=bd,
        UPCAST=dots.upcast,
        PRECISION=dots.precision,
        num_warps=4,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        out,
        seq_lens,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        NUM_KV_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_D=bd,
        num_warps=4,
    )
    return out
