"""oneDNN-prepacked linear layers (bfloat16 on CPU): bit-identical to ``F.linear``, and to the unpacked model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import build_random_model, generate, write_jsonl
from torch.nn import functional as F

from batchgen.models.packed_linear import PackedLinear, prepack_linears, prepack_supported

pytestmark = pytest.mark.skipif(
    not prepack_supported(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's oneDNN has no bfloat16 kernels (torch.ops.mkldnn._is_mkldnn_bf16_supported() is False)",
)


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"), [(1, 64, 48), (5, 576, 192), (64, 576, 3072), (300, 1536, 576)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = PackedLinear(weight, b)
    assert torch.equal(packed(x), F.linear(x, weight, b))
    assert torch.equal(packed(x[:1]), F.linear(x[:1], weight, b))  # one packing serves every row count


def test_prepack_replaces_every_linear() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    model = model.bfloat16()
    x = torch.randn(3, 8).bfloat16()
    want = model(x)
    assert prepack_linears(model) == 2
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(model(x), want)


def test_engine_outputs_equal_with_and_without_prepacking(
    random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 runs (untied, tied output projection, q/k/v biases; greedy and sampled rows, top logprobs) give
    the same tokens and bit-identical logprobs with packed weights as with ``F.linear``."""
    tied = build_random_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    rng = random.Random(3)
    rows = [
        {
            "id": str(i),
            "prompt_token_ids": [0] + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 40))],
            "max_new_tokens": 8,
            "temperature": 0 if i % 2 else 0.8,
            "seed": i,
            "top_logprobs": 3,
        }
        for i in range(6)
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    for name, model in (("llama", random_models["llama"]), ("qwen2", random_models["qwen2"]), ("tied", tied)):
        packed = generate(dataset, tmp_path / f"{name}_packed.jsonl", model, "--dtype", "bfloat16")
        monkeypatch.setenv("BATCHGEN_CPU_PREPACK", "0")
        plain = generate(dataset, tmp_path / f"{name}_plain.jsonl", model, "--dtype", "bfloat16")
        monkeypatch.delenv("BATCHGEN_CPU_PREPACK")
        for rid, want in plain.items():
            got = packed[rid]
            assert got["output_token_ids"] == want["output_token_ids"], (name, rid)
            assert got["output_logprobs"] == want["output_logprobs"], (name, rid)
            assert got["top_logprobs"] == want["top_logprobs"], (name, rid)


def test_bfloat16_cpu_models_load_packed(random_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.models.source import ModelSource

    def packed_layers() -> int:
        model = ModelSource.open(str(random_models["llama"])).load(torch.bfloat16, torch.device("cpu"), 64)
        return sum(isinstance(m, PackedLinear) for m in model.modules())

    assert packed_layers() == 2 * 4 + 1  # qkv, o, gate_up and down in each of 2 layers; the output projection
    monkeypatch.setenv("BATCHGEN_CPU_PREPACK", "0")
    assert packed_layers() == 0
