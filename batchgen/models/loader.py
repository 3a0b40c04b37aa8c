"""Build our decoder for a Hugging Face checkpoint directory and fill it from its safetensors files."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from batchgen.errors import BatchgenError, one_line
from batchgen.models.config import ModelConfig
from batchgen.models.llama import LlamaForCausalLM

# Checkpoint tensor name pattern → (our fused parameter, which shard of it). Shard order inside the fused
# weight is q, k, v and gate, up; a checkpoint that stores them fused so (Phi-3's qkv_proj, gate_up_proj) loads by name.
_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
# Tensors that checkpoints carry but that we derive ourselves.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _fused_target(name: str, config: ModelConfig) -> tuple[str, int, int] | None:
    """For a checkpoint tensor that feeds a fused parameter: (param name, row offset, row count)."""
    m = _FUSED.match(name)
    if m is None:
        return None
    prefix, _, qkv, gate_up, kind = m.groups()
    if qkv is not None:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        offset, rows = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[qkv]
        return f"{prefix}self_attn.qkv_proj.{kind}", offset, rows
    inter = config.intermediate_size
    return f"{prefix}mlp.gate_up_proj.{kind}", 0 if gate_up == "gate" else inter, inter


def _allocate(hf_config: object, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    """The model with uninitialised parameters (built on the meta device, then given real storage)."""
    config = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, rotary_device=device)
    return model.to_empty(device=device).to(dtype)


def random_model(
    hf_config: object, dtype: torch.dtype, device: torch.device, max_positions: int, seed: int = 0
) -> LlamaForCausalLM:
    """A model with random weights (normal, std 0.02; norms 1), for benchmarks of a shape without a checkpoint."""
    model = _allocate(hf_config, dtype, device, max_positions)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.eval()


def load_model(
    model_dir: Path, hf_config: object, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    """Create the model on ``device`` in ``dtype`` and load every weight from ``model_dir/*.safetensors``.

    Parameters are allocated without initialisation (built on the meta device first), then filled; a
    parameter that no checkpoint tensor filled is an error rather than silent garbage.

    Raises:
        BatchgenError: unsupported architecture, no safetensors files, a missing or mis-shaped tensor.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BatchgenError(f"{model_dir}: no *.safetensors weights found")
    model = _allocate(hf_config, dtype, device, max_positions)
    config = model.config
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for file in files:
        for name, tensor in _tensors(file, config.tie_word_embeddings):
            target = _fused_target(name, config)
            pname, offset, rows = target if target else (name, 0, tensor.shape[0] if tensor.dim() else 0)
            param = params.get(pname)
            if param is None:
                raise BatchgenError(f"{file.name}: unexpected tensor '{name}' for {config.architecture}")
            dest = param.data[offset : offset + rows] if target else param.data
            if dest.shape != tensor.shape:
                raise BatchgenError(
                    f"{file.name}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dtype))
            filled[pname] = filled.get(pname, 0) + (rows if target else param.shape[0])
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
    if missing:
        raise BatchgenError(f"{model_dir}: weights missing from the checkpoint: {', '.join(missing[:5])}")
    return model.eval()


def _tensors(file: Path, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the checkpoint ``file`` a model loads, by name (not the LM head of a model whose embeddings
    are ``tied``, nor the buffers :data:`_IGNORED` names).

    Raises:
        BatchgenError: the file is no safetensors file or is cut short (found by a helper: a traceback).
    """
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if not (_IGNORED.search(name) or (name == "lm_head.weight" and tied)):
                    yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise BatchgenError(f"{file}: cannot read the weights: {one_line(e)}") from None
