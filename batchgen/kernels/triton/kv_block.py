"""One online-softmax step over a block of the paged pool's keys, shared by the decode and extend kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_kv_block(
    q,
    acc,
    m_i,
    l_i,
    k_head,
    v_head,
    token_row,
    block_start,
    end,
    last_pos,
    scale,
    stride_ks,
    stride_vs,
    offs_n,
    offs_d,
    mask_d,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The keys and values at positions ``block_start + offs_n`` below ``end`` (slots from ``token_row``, one
    request's row of ``req_to_token``) added to the running softmax of each query row of ``q`` ``[rows, BLOCK_D]``
    that sees them: query ``i`` sees positions ``<= last_pos[i]``. Milakov & Gimelshein's online softmax
    (2018): ``m_i`` ``[rows]`` the running max, ``l_i`` ``[rows]`` the running sum of ``exp(s - m_i)``, ``acc``
    ``[rows, BLOCK_D]`` float32 the running ``P . V``; returns the three updated. Scores are ``q . k * scale`` in
    float32; ``P`` is rounded to V's dtype for its product (float32 where ``UPCAST``), as FlashAttention-2 does.

    A row must see some key of the first block it is given (its max is then finite): later blocks it sees none of
    give it ``p = 0`` and leave its max and sum as they were.
    """
    pos = block_start + offs_n
    mask_n = pos < end
    slots = tl.load(token_row + pos, mask=mask_n, other=0)
    # K is loaded already transposed, [BLOCK_D, BLOCK_N]: in the interpreter a dot on a tl.trans view took ~8 ms per
    # block against ~30 us on a fresh array; on a GPU the compiler picks the layout.
    k_t = tl.load(
        k_head + slots[None, :] * stride_ks + offs_d[:, None], mask=mask_d[:, None] & mask_n[None, :], other=0.0
    )
    if UPCAST:
        k_t = k_t.to(tl.float32)
    s = tl.dot(q, k_t, input_precision=PRECISION) * scale
    s = tl.where(mask_n[None, :] & (pos[None, :] <= last_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_head + slots[:, None] * stride_vs + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
    )
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i
