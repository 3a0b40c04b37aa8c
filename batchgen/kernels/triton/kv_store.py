"""Store the round's new keys and values into the paged KV pool in one Triton kernel.

The torch path (``TokenToKVPool.set_kv``) transposes k and v to the pool's head-major layout and then runs
two ``index_copy_`` calls: three to four kernels and a temporary per layer. Here one program per (token, KV
head) reads that token's K and V row and writes them straight to slot ``loc[token]`` of both buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import block_d, check_last_dim_contiguous


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    loc_ptr,
    k_buf_ptr,
    v_buf_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bh,
    stride_bs,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < head_dim
    slot = tl.load(loc_ptr + token)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + offs, mask=mask)
    dst = head * stride_bh + slot * stride_bs + offs
    tl.store(k_buf_ptr + dst, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` to slots ``loc`` (int64 ``[T]``) of one layer's
    ``k_buffer``/``v_buffer`` ``[num_kv_heads, slots, head_dim]``, converting to the buffers' dtype.

    Slots in ``loc`` must be distinct, except the dummy slot 0 (padding tokens), whose content is never read
    as data.

    Raises:
        ValueError: a tensor whose last dimension is not contiguous.
    """
    check_last_dim_contiguous(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        loc,
        k_buffer,
        v_buffer,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        head_dim,
        BLOCK_D=block_d(head_dim),
    )
