"""Rotary position embeddings (Su et al. 2021, "RoFormer"), in Hugging Face's rotate-half layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchgen.errors import BatchgenError

# RoPE variants one cos/sin table serves for every position batchgen runs: transformers changes dynamic's and
# longrope's frequencies for a whole batch only past max_position_embeddings and original_max_position_embeddings,
# where batchgen's context stops (batchgen.models.config.context_limit).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_settings(hf_config: Any) -> tuple[dict[str, Any], str]:
    """The config's RoPE settings as transformers holds them (``rope_parameters``) and their type (``default`` where
    it names none; older configs say ``type``)."""
    params: dict[str, Any] = dict(getattr(hf_config, "rope_parameters", None) or {})
    return params, str(params.get("rope_type", params.get("type", "default")))


def rope_inverse_frequencies(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 and the cos/sin scale factor.

    The default is ``theta ** (-2i / d)``; the scaled types of :data:`ROPE_TYPES` come from transformers'
    ``ROPE_INIT_FUNCTIONS`` (the reference implementation our outputs are compared with) as it builds them before
    any batch: ``yarn`` with its attention factor as the scale (Peng et al. 2023, "YaRN"), ``dynamic`` as the
    default table, ``longrope`` with its short factors and attention factor (Phi-3's).

    Raises:
        BatchgenError: another RoPE type, or RoPE on part of each head (``partial_rotary_factor`` below 1,
            Phi-4-mini's 0.75).
    """
    params, rope_type = rope_settings(hf_config)
    partial = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise BatchgenError(f"unsupported partial_rotary_factor {partial}: RoPE on part of each head")
    if rope_type not in ROPE_TYPES:
        raise BatchgenError(f"unsupported rope_scaling type '{rope_type}'; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        return inv_freq, 1.0
    # The model is built under a meta-device context; these tables must hold real numbers.
    with torch.device("cpu"):
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class RotaryEmbedding:
    """Applies RoPE to q ``[T, H, D]`` and k ``[T, Hkv, D]`` at integer ``positions`` ``[T]`` (none with ``turns``
    false).

    cos/sin are tabulated in float32 for positions ``[0, max_positions)`` on ``device`` and cast to the
    activations' dtype before use, as transformers does, so bf16 results match the reference too. Not an
    ``nn.Module``: the tables are derived data, never loaded from or saved to a checkpoint. ``fused_kernel``
    (:func:`batchgen.kernels.triton.fused_elementwise.rotary_embedding`, when set) does the same in one kernel.
    """

    def __init__(
        self, hf_config: Any, head_dim: int, max_positions: int, device: torch.device, turns: bool = True
    ) -> None:
        # Not ``turns`` (SmolLM3's layers without RoPE): frequencies 0, so cos 1 and sin 0 give q and k back bit for
        # bit through the same kernels (RoPE fused with the KV store) as the other layers.
        zero = (torch.zeros(head_dim // 2, device="cpu"), 1.0)  # real numbers under the model's meta device
        inv_freq, scale = rope_inverse_frequencies(hf_config, head_dim) if turns else zero
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        emb = torch.outer(positions, inv_freq.cpu()).repeat(1, 2)
        self.cos_table = (emb.cos() * scale).to(device)
        self.sin_table = (emb.sin() * scale).to(device)
        self.fused_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        # RoPE that also stores the new K/V in the pool (LlamaForCausalLM.store_kv_in_rope), when set.
        self.kv_store_kernel: Callable[..., torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_kernel is not None:
            return self.fused_kernel(positions, q, k, self.cos_table, self.sin_table)
        cos = self.cos_table[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_table[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
