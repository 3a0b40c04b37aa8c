"""FLOPs and bytes of a forward pass, for the achieved-FLOP/s and bandwidth figures of the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.models.config import ModelConfig


def layer_params(config: ModelConfig) -> int:
    """Weights multiplied per token inside the decoder layers (q/k/v/o and the MLP)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    per_layer = (
        config.hidden_size * (q + 2 * kv) + q * config.hidden_size + 3 * config.hidden_size * config.intermediate_size
    )
    return config.num_layers * per_layer


def forward_flops(
    config: ModelConfig, new_tokens: Sequence[int], prefix_lens: Sequence[int], sampled_rows: int
) -> float:
    """FLOPs of one round: 2 per weight per token, the LM head for the sampled rows, and attention
    (QK^T and PV: 4 · heads · head_dim per query-key pair, causal within the new tokens)."""
    tokens = sum(new_tokens)
    flops = 2.0 * layer_params(config) * tokens + 2.0 * config.hidden_size * config.vocab_size * sampled_rows
    pairs = sum(n * p + n * (n + 1) / 2 for n, p in zip(new_tokens, prefix_lens))
    return flops + 4.0 * config.num_layers * config.num_heads * config.head_dim * pairs


def decode_bytes(config: ModelConfig, dtype: torch.dtype, weight_dtype: torch.dtype, seq_lens: Sequence[int]) -> float:
    """Bytes a DECODE round must read at least: every layer weight and the LM head once, stored in
    ``weight_dtype``, and the K/V of every cached token of every request in ``dtype`` (plus writing the new
    tokens' K/V)."""
    weights = (layer_params(config) + config.hidden_size * config.vocab_size) * weight_dtype.itemsize
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    return weights + kv_per_token * (sum(seq_lens) + len(seq_lens))


def generation_flops(config: ModelConfig, prompt_lens: Sequence[int], output_len: int) -> float:
    """FLOPs of generating ``output_len`` tokens after each prompt (:func:`forward_flops` summed over the rounds):
    each prompt's prefill, which samples its first token, then ``output_len - 1`` single-token steps, the step
    that samples token ``t`` seeing a prefix of ``prompt + t - 1`` tokens."""
    steps = max(output_len - 1, 0)
    flops = forward_flops(config, prompt_lens, [0] * len(prompt_lens), len(prompt_lens))
    for t in range(1, steps + 1):
        flops += forward_flops(config, [1] * len(prompt_lens), [n + t - 1 for n in prompt_lens], len(prompt_lens))
    return flops
