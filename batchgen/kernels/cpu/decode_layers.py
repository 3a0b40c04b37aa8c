"""A decode round's decoder layers in one C++ call (``decode_layers.cpp``), for bfloat16 Llama-family models
whose linear layers run on the half-precision weights (:mod:`batchgen.kernels.cpu.half_linear`: CPUs without BF16
units) or on brgemm (:mod:`batchgen.kernels.cpu.brgemm_linear`: ``--deterministic``
where brgemm runs bfloat16).

A small batch's decode step is ten short ops a layer; run from Python, the interpreter and the dispatcher's
Python entry between them are a large part of the step (docs/performance.md). The C++ op runs the
same ops (:mod:`batchgen.kernels.cpu.fused_elementwise`, :func:`batchgen.kernels.cpu.half_linear.half_weight_linear`
or :func:`batchgen.kernels.cpu.brgemm_linear.brgemm_linear`, :func:`batchgen.kernels.cpu.paged_attention`) in the
same order on the same inputs through the dispatcher's C++ entry: the same bits as the Python layers (with the
float32 carrier, :meth:`batchgen.models.llama.LlamaForCausalLM.carry_float32`, on the half-precision weights), in
less time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.kernels.cpu import BrgemmRows, build_problem


def decode_layers(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    norms: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    eps: float,
    num_heads: int,
    rope_tables: tuple[torch.Tensor, torch.Tensor],
    kv_buffers: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    brgemm: BrgemmRows,
    out_features: Sequence[int],
    float32_carrier: bool,
    gate_up_silu: Sequence[bool] = (),
    attention_seconds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every decoder layer and the final RMSNorm over ``T`` new tokens, each layer RMSNorm (with the residual
    add) → qkv projection → RoPE and KV store → paged attention → o projection → RMSNorm (with the residual add) →
    gate/up projection → SiLU-and-multiply → down projection, as :class:`batchgen.models.llama.DecoderLayer`.

    Args:
        hidden: ``[T, hidden_size]`` bfloat16, the tokens' embeddings.
        positions, loc: int64 ``[T]``: the tokens' positions and the KV slots they write.
        norms: ``2L + 1`` bfloat16 ``[hidden_size]`` RMSNorm weights: each layer's input and post-attention norm,
            then the final norm.
        weights: ``4L`` weights of each layer's qkv (q, then k, then v rows), o, gate/up (gate rows, then up rows)
            and down projections: with ``float32_carrier`` as
            :func:`~batchgen.kernels.cpu.half_linear.pack_half_weight` packs them (activations handed on in
            float32), else as :func:`~batchgen.kernels.cpu.brgemm_linear.pack_for_brgemm` packs them (every
            activation bfloat16).
        biases: ``2L`` float32 biases of each layer's qkv and o projections, ``None`` for none.
        eps: the norms' epsilon. num_heads: query heads (the KV heads are the pool's).
        rope_tables: float32 ``(cos, sin)`` ``[max_positions, head_dim]``.
        kv_buffers: the KV pool's ``(k_buffer, v_buffer)``, bfloat16 ``[L, num_kv_heads, slots, head_dim]``;
            the new tokens' K/V are written into them.
        req_to_token: int64 ``[max_reqs, context_len]``.
        rows: int64 ``[n]`` ``(req_pool_indices, seq_lens, q_starts, q_lens)`` of the round's rows, as
            :func:`batchgen.kernels.cpu.paged_attention` takes them.
        scale: the attention's score scale, ``head_dim ** -0.5``.
        brgemm: the rows :func:`batchgen.kernels.cpu.paged_attention` runs through brgemm, as the round's
            attention backend chooses them.
        out_features: each packed weight's output width (``4L`` ints).
        float32_carrier: the weights are packed for :func:`~batchgen.kernels.cpu.half_linear.half_weight_linear`.
        gate_up_silu: empty, or ``L`` flags: where set, the layer's gate/up projection and SiLU-and-multiply run as
            one op (:func:`~batchgen.kernels.cpu.brgemm_linear.brgemm_linear_silu_and_mul`, the same bits), as the
            model's :class:`batchgen.models.llama.MLP` runs them; only with brgemm-packed weights.
        attention_seconds: a float64 ``[1]`` tensor to which the call adds the wall seconds of its attention (the
            benchmarks' attention clock, :mod:`batchgen.bench.attention_time`); ``None``: not timed.

    Returns:
        ``[T, hidden_size]`` bfloat16: the final norm's output.

    Raises:
        RuntimeError: (``batchgen::...: ...``) lists whose lengths disagree with the pool's layers, or what the
            ops it calls raise on their inputs; the extension's build problem when it did not build.
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    out: torch.Tensor = torch.ops.batchgen.decode_layers(
        hidden,
        positions,
        norms,
        weights,
        biases,
        eps,
        num_heads,
        *rope_tables,
        *kv_buffers,
        loc,
        req_to_token,
        *rows,
        scale,
        int(brgemm),
        out_features,
        float32_carrier,
        gate_up_silu,
        attention_seconds,
    )
    return out
