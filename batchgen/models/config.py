"""The few numbers of a Hugging Face config that our Llama-family modules need, read once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.errors import BatchgenError
from batchgen.models.rotary import rope_settings

# architectures value in config.json → the variant flags our single decoder implementation needs.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    # Phi-3 and Phi-4: Llama's layers with q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), as ours are.
    "Phi3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    # SmolLM3: Llama's layers, every fourth without RoPE (no_rope_layers).
    "SmolLM3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
}
# Architectures whose attention reads ``sliding_window`` itself, without ``layer_types``.
_WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "Phi3ForCausalLM")


def sliding_window(hf_config: Any) -> int | None:
    """The sliding attention window of a model whose layers (some or all) attend only to their last ``W`` positions,
    as transformers reads the config: ``layer_types`` naming ``sliding_attention`` layers (Qwen2, Qwen3 with
    ``use_sliding_window``), or Mistral's and Phi-3's ``sliding_window``; ``None`` for full attention. A query at
    position ``q`` sees keys ``q - W < k <= q`` (transformers' ``sliding_window_causal_mask``), so up to ``W``
    positions the window is full causal attention, which is what batchgen computes."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if window and "sliding_attention" in layer_types else None
    archs = getattr(hf_config, "architectures", None) or []
    return int(window) if window and any(arch in archs for arch in _WINDOWED_ARCHITECTURES) else None


def model_positions(hf_config: Any) -> tuple[int, str | None]:
    """The most positions the model holds and, where its RoPE rather than ``max_position_embeddings`` sets them,
    why: YaRN's ``original_max_position_embeddings`` times its factor where that is more (vLLM's rule: Qwen3's
    long-context setting keeps 40,960 and reaches 131,072); longrope's ``original_max_position_embeddings``, past
    which transformers turns the whole batch to its long factors (Phi-3's 128k models: batchgen's one table holds
    the short ones)."""
    positions = int(hf_config.max_position_embeddings)
    params, kind = rope_settings(hf_config)
    # A top-level value wins over rope_scaling's, as transformers' standardize_rope_params reads them (its tables
    # take it at the model's load, after this runs: found by a review).
    top = getattr(hf_config, "original_max_position_embeddings", None)
    original = top or params.get("original_max_position_embeddings")
    if kind == "yarn" and original and params.get("factor"):
        return max(positions, int(float(params["factor"]) * int(original))), None
    if kind == "longrope" and original and int(original) < positions:
        return int(original), f"its longrope RoPE holds {int(original)} positions with the factors batchgen runs"
    return positions, None


def context_limit(hf_config: Any, asked: int | None) -> tuple[int, str | None]:
    """A run's context length: ``asked`` (``--context-length``), else the most positions the model holds
    (:func:`model_positions`) or, below them, its sliding window (:func:`sliding_window`), up to which batchgen's
    full causal attention is the window's; and a note saying so when the window or the RoPE set it, else ``None``.

    Raises:
        BatchgenError: ``asked`` exceeds that limit (one line naming it).
    """
    positions, rope_note = model_positions(hf_config)
    window = sliding_window(hf_config)
    if window is None or window >= positions:
        if asked is not None and asked > positions:
            why = f" ({rope_note})" if rope_note else ""
            raise BatchgenError(f"--context-length {asked} exceeds the model's {positions} positions{why}")
        if asked is None and rope_note is not None:
            return positions, f"the model's context length set to {positions}: {rope_note}"
        return asked or positions, None
    if asked is not None and asked > window:
        raise BatchgenError(f"--context-length {asked} exceeds the model's sliding window of {window}")
    if asked is not None:
        return asked, None
    return (
        window,
        f"the model attends over a sliding window of {window} tokens; context length set to {window}, "
        "where full attention is the same",
    )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder.

    ``hf_config`` is kept for what only transformers knows how to read (RoPE scaling parameters).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_proj_bias: bool
    # Whether each layer applies RoPE (SmolLM3's no_rope_layers: 1 where it does; all others do).
    rope_layers: tuple[bool, ...]
    hf_config: Any

    @staticmethod
    def from_hf(hf_config: Any) -> ModelConfig:
        """Read a ``transformers.PretrainedConfig``.

        Raises:
            BatchgenError: the architecture is not one we implement, or it uses an option we do not (activation
                other than SiLU, MLP biases).
        """
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise BatchgenError(
                f"unsupported model architecture {archs or '(none in config.json)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise BatchgenError(f"unsupported hidden_act '{act}' for {arch}; only silu is implemented")
        if getattr(hf_config, "mlp_bias", False):
            raise BatchgenError(f"unsupported mlp_bias=true for {arch}")
        flags = SUPPORTED_ARCHITECTURES[arch]
        num_heads, num_layers = hf_config.num_attention_heads, hf_config.num_hidden_layers
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return ModelConfig(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias"] or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=flags["qk_norm"],
            # Qwen2 puts biases on q/k/v only; Llama's attention_bias covers o_proj as well.
            o_proj_bias=bool(getattr(hf_config, "attention_bias", False)) and arch != "Qwen2ForCausalLM",
            rope_layers=_rope_layers(hf_config, arch, num_layers),
            hf_config=hf_config,
        )


def _rope_layers(hf_config: Any, arch: str, num_layers: int) -> tuple[bool, ...]:
    """Whether each layer applies RoPE: SmolLM3's ``no_rope_layers`` (1 where it does; transformers indexes the list,
    so a longer one's tail is unused), which only SmolLM3's modules read; every layer of the others.

    Raises:
        BatchgenError: the list is shorter than the layers.
    """
    if arch != "SmolLM3ForCausalLM" or getattr(hf_config, "no_rope_layers", None) is None:
        return (True,) * num_layers
    flags = list(hf_config.no_rope_layers)
    if len(flags) < num_layers:  # transformers fails at the first missing layer's index (found by a review)
        raise BatchgenError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(bool(x) for x in flags[:num_layers])
