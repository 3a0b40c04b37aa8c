"""Tiny random-weight models of every supported architecture (and their tokenizer), the shared stories260k
model, and a perturbed copy of a model to serve as a draft model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

REPO = Path(__file__).resolve().parents[2]


SHARED = REPO.parent / "shared"


STORIES = SHARED / "models" / "stories260k"


GREEDY_REFERENCE = SHARED / "models" / "greedy_reference.json"


needs_shared = pytest.mark.skipif(
    not STORIES.exists(), reason="needs ../shared/models (the workplace's shared folder; not in a fresh clone)"
)


_CORPUS = [
    "Once upon a time there was a little girl named Lily who loved to play in the park.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire.",
    "Numbers like 12345 and symbols such as #, %, & and emoji 🙂 appear in text too.",
    "Café, naïve and jalapeño use accents; 日本語 and русский use other scripts.",
] * 4


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on a tiny corpus: 256 bytes + merges + <s>, </s>; adds BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(out_dir)
    return fast


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE with byte fallback (as Llama 2's, Mistral's and stories260k's): ``▁`` for spaces,
    the 256 bytes as ``<0xNN>`` tokens for characters it lacks (every non-ASCII one), and the decoder that writes a
    run of byte tokens as UTF-8, or as U+FFFD where the run is not valid UTF-8."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:.,":
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


ARCH_CONFIGS: dict[str, Callable[..., Any]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "phi3": Phi3Config,
    "smollm3": SmolLM3Config,
}


def build_random_model(out_dir: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight model of ``arch`` (hidden 64, 2 layers, GQA 4/2 heads) with our test tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    kwargs: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        rms_norm_eps=1e-5,
    )
    if arch in ("qwen2", "qwen3"):
        kwargs["head_dim"] = 16
    if arch == "smollm3":
        kwargs["no_rope_layer_interval"] = 2  # its second layer without RoPE (SmolLM3-3B: every fourth)
    kwargs.update(overrides)
    config = ARCH_CONFIGS[arch](**kwargs)
    config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights give peaked next-token distributions, so greedy paths have clear margins.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    return out_dir


def perturbed_copy(model_dir: Path, out: Path, scale: float = 0.005) -> Path:
    """Save ``model_dir``'s model with Gaussian noise of std ``scale`` (seeded) on its matrices, and its tokenizer:
    a draft model that agrees with the target often but not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out
