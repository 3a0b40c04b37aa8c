"""Fused elementwise ops for bfloat16 models on the CPU (``elementwise.cpp``): RMSNorm with the residual add,
SiLU-and-multiply and RoPE (with the new tokens' K/V store folded in: :func:`rotary_embedding_kv`), one pass over
memory each instead of a chain of PyTorch ops.

The same three functions, with the same signatures, as :mod:`batchgen.kernels.triton.fused_elementwise`, so
:meth:`batchgen.models.llama.LlamaForCausalLM.use_fused_ops` takes either module. Each rounds to bfloat16 where
the PyTorch code it replaces does: RoPE, the residual add and SiLU-and-multiply give the same bits (SiLU's exp
differs from PyTorch's within ~1 ulp of float32, which no bfloat16 input's rounded result shows: all 65,536 are
tested); RMSNorm can differ by one bfloat16 step where its float32 sum, taken in another order, rounds across a
boundary. ``BATCHGEN_CPU_FUSED_OPS=0`` keeps the PyTorch code.

Their inputs may also be float32, a float32 GEMM's unrounded output (:mod:`batchgen.models.packed_linear`), which
they round to bfloat16 as they load it; ``out_dtype=torch.float32`` writes bfloat16 values as float32 for the
next float32 GEMM. Carried so (:meth:`batchgen.models.llama.LlamaForCausalLM.carry_float32`), every value is
that of the all-bfloat16 chain, without the casts before and after each GEMM; ``BATCHGEN_CPU_FLOAT32_CARRIER=0``
keeps the casts.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.kernels.cpu import build_problem


def fused_ops_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` can run these ops: bfloat16 on the CPU and the extension built
    (whether it should is ``KernelSwitches.cpu_fused_ops``). float32 stays on the PyTorch code, the reference
    path."""
    return device.type == "cpu" and dtype == torch.bfloat16 and build_problem() is None


def _ops() -> Any:
    """``torch.ops.batchgen`` with the extension loaded (built on the first call)."""
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    return torch.ops.batchgen


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019, as transformers' ``LlamaRMSNorm``) of ``x`` ``[rows, hidden]`` (bfloat16,
    or float32 rounded to bfloat16 on load), or of ``residual + x`` (bfloat16 ``residual``, the sum rounded to
    bfloat16) when ``residual`` is given.

    Returns ``(normed, summed)`` ``[rows, hidden]``: ``normed = bf16(weight * bf16(s * rsqrt(mean(s²) + eps)))``
    with ``s`` the input in float32, in ``out_dtype`` (bfloat16, the default, or float32); ``summed`` is the
    bfloat16 ``residual + x`` (``x`` itself without a residual).

    Raises:
        RuntimeError: (``batchgen::rms_norm: ...``) tensors of other dtypes or off the CPU, mismatched shapes, or
            a last dimension that is not contiguous; the extension's build problem when it did not build.
    """
    normed, summed = _ops().rms_norm(x, weight, eps, residual, out_dtype)
    return normed, summed


def silu_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``bf16(bf16(silu(gate)) * up)`` for ``gate_up`` ``[rows, 2 * n]``
    holding gate then up (bfloat16, or float32 rounded to bfloat16 on load); returns ``[rows, n]`` in
    ``out_dtype`` (bfloat16, the default, or float32).

    Raises:
        RuntimeError: (``batchgen::silu_and_mul: ...``) another dtype or off the CPU, an odd or non-contiguous
            last dimension; the extension's build problem when it did not build.
    """
    out: torch.Tensor = _ops().silu_and_mul(gate_up, out_dtype)
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (Su et al. 2021) in transformers' rotate-half layout on q ``[T, H, D]`` and k ``[T, Hkv, D]``, both
    bfloat16 or both float32 (rounded to bfloat16 on load; rows may be strided views of a fused QKV output), at
    ``positions`` (int64 ``[T]``), from float32 tables ``[max_positions, D]`` rounded to bfloat16 as transformers
    casts them.

    Returns new contiguous bfloat16 ``(q, k)`` of the same shapes, bit-identical to
    :class:`batchgen.models.rotary.RotaryEmbedding`'s PyTorch code on the bfloat16 inputs.

    Raises:
        RuntimeError: (``batchgen::rotary_embedding: ...``) wrong dtypes or shapes, an odd head_dim, or a position
            outside the tables; the extension's build problem when it did not build.
    """
    q_out, k_out = _ops().rotary_embedding(positions, q, k, cos_table, sin_table)
    return q_out, k_out


def rotary_embedding_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """:func:`rotary_embedding` and the KV store in one pass: returns the rotated q (new, contiguous bfloat16
    ``[T, H, D]``) and writes the rotated k and v (``[T, Hkv, D]``, like k; float32 rounded to bfloat16) into one
    layer of the pool, ``k_cache[:, loc[t]]`` and ``v_cache[:, loc[t]]`` (bfloat16 ``[Hkv, slots, D]``), the same
    bits as ``rotary_embedding`` followed by :meth:`batchgen.loop.kv_pool.TokenToKVPool.set_kv`.

    Raises:
        RuntimeError: (``batchgen::rotary_embedding...``) wrong dtypes or shapes, a position outside the tables
            or a slot outside the pool; the extension's build problem when it did not build.
    """
    q_out: torch.Tensor = _ops().rotary_embedding_kv(positions, q, k, v, cos_table, sin_table, k_cache, v_cache, loc)
    return q_out
