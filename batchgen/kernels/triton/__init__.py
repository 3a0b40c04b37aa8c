"""Triton kernels for attention over the paged KV pool, plus the launch settings they share.

This ``__init__`` does not import ``triton``: only the kernel submodules do, and the ``triton`` attention
backend loads them on demand, so ``import batchgen`` works without triton installed.

Submodules:
    decode_attention: one query token per request, FlashDecoding split-K over the sequence.
    extend_attention: several new tokens per request after a cached prefix, FlashAttention-2 tiling.
    kv_block: one online-softmax step over a block of the pool's keys, which both attention kernels take.
    kv_store: the round's new K/V written to their pool slots.
    matmul: a GEMM whose rows do not depend on the row count (linear layers under ``--deterministic``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DotSettings:
    """How the kernels run their two matrix products (``q @ k^T`` and ``p @ v``).

    Attributes:
        upcast: load K/V (and q) as float32 and multiply in float32; ``p`` then stays float32 too.
        precision: ``input_precision`` of ``tl.dot``: ``"ieee"`` for float32 products (the default TF32
            would round inputs to a 10-bit mantissa, ~1e-3 relative error), ``"tf32"`` (the default,
            ignored for half-precision inputs) otherwise.
    """

    upcast: bool
    precision: str


def dot_settings(dtype: torch.dtype, interpreted: bool) -> DotSettings:
    """The :class:`DotSettings` for K/V of ``dtype``, compiled or in Triton's interpreter (``interpreted``).

    float32 multiplies in IEEE float32. float16/bfloat16 multiply in their own type with a float32
    accumulator, ``p`` rounded to that type first (as FlashAttention-2 does). bfloat16 in the interpreter
    (``TRITON_INTERPRET=1``, how the kernels run on the CPU) is upcast: the interpreter keeps bfloat16 as raw
    ``uint16`` bits, numpy having no bfloat16, and its ``tl.dot`` hands those bits to ``np.matmul`` as
    integers, so a bfloat16 dot returns garbage (a 16x16 product of N(0, 1) entries is off by ~1e10).
    Products of two bfloat16 values are exact in float32, so the upcast dot computes what a GPU's bfloat16
    MMA computes, up to summation order. float16 has a numpy type and runs natively in the interpreter.

    Raises:
        ValueError: for a dtype other than float32, bfloat16, float16.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Triton attention supports float32, bfloat16 and float16, not {dtype}")
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted):
        return DotSettings(upcast=True, precision="ieee")
    return DotSettings(upcast=False, precision="tf32")


def block_d(head_dim: int) -> int:
    """Width of the head-dimension tile: ``head_dim`` rounded up to a power of two, at least 16.

    Power of two because ``tl.arange`` needs one; at least 16 because ``tl.dot`` on GPUs needs every
    dimension >= 16. Lanes past ``head_dim`` are masked to zero, so they add nothing to the products.
    """
    return max(16, 1 << (head_dim - 1).bit_length())


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels index the head dimension with unit stride.

    Raises:
        ValueError: naming the first tensor whose last dimension is not contiguous.
    """
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def check_attention_shapes(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor) -> None:
    """q and out ``[tokens, num_heads, head_dim]`` against one layer's K/V ``[num_kv_heads, slots, head_dim]``.

    Raises:
        ValueError: dtypes that differ, a head count not a multiple of ``num_kv_heads``, a head size or buffer
            shape that does not match, or ``out`` not shaped like ``q``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    if q.dtype != k_buffer.dtype or v_buffer.dtype != k_buffer.dtype:
        raise ValueError(f"q, k_buffer, v_buffer dtypes differ: {q.dtype}, {k_buffer.dtype}, {v_buffer.dtype}")
    if num_heads % k_buffer.shape[0] or k_buffer.shape[2] != head_dim or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit K/V buffers {tuple(k_buffer.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} differs from q {tuple(q.shape)}")
