"""batchgen's fused Triton RMSNorm, SiLU-and-multiply and RoPE kernels, run by Triton's interpreter on the CPU,
against the torch code they replace (``batchgen.models.llama`` and ``batchgen.models.rotary``, themselves checked
token for token against HF transformers) and, for RMSNorm and RoPE, against float64 formulas written here.

Odd widths (576: SmolLM2's hidden size; 1000) exercise the masked tail of the power-of-two tiles; q and k are
strided views of one fused QKV output, as the model passes them.

Tolerances are in units of the dtype's epsilon (``places``). float16 runs natively in the interpreter, rounding
to nearest as a GPU does, so its cases check where the kernels round. The interpreter converts float32 to
bfloat16 by truncation (its ``_convert_float`` gets no rounding mode; on a GPU the conversion rounds to nearest),
so bfloat16 results may sit one place lower per rounding there: bfloat16 cases allow two places more.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.triton import use_triton_interpreter

use_triton_interpreter()

from batchgen.environment import kernel_switches  # noqa: E402
from batchgen.errors import BatchgenError  # noqa: E402
from batchgen.kernels.switches import TRITON_FUSED_OPS  # noqa: E402
from batchgen.kernels.triton.fused_elementwise import rms_norm, rotary_embedding, silu_and_mul  # noqa: E402
from batchgen.models.llama import RMSNorm  # noqa: E402
from batchgen.models.rotary import RotaryEmbedding  # noqa: E402
from batchgen.models.source import ModelSource, triton_fused_ops_requested  # noqa: E402
from tests.helpers.cli import generate, write_jsonl  # noqa: E402
from tests.helpers.hf_greedy import check_against_hf, greedy_prompts  # noqa: E402
from tests.helpers.reference import assert_within, assert_within_rounding_noise, deviation  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def within(got: torch.Tensor, expected: torch.Tensor, places: float, scale: float = 1.0) -> None:
    """``assert_within`` with two places more for bfloat16 (the interpreter's truncating conversion)."""
    assert_within(got, expected, places + (2 if got.dtype == torch.bfloat16 else 0), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_matches_the_torch_module_and_the_formula(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    module = RMSNorm(hidden, 1e-6).to(dtype)
    module.weight.data.copy_(weight)
    out, summed = rms_norm(x, weight, 1e-6)
    assert summed is x and out.dtype == dtype
    within(out, module(x), 2)  # the mean's summation order and rsqrt's last bit
    x64 = x.double()
    expected = weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    within(out, expected, 4)  # rounded after the normalisation and after the weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_after_a_residual_add(dtype: torch.dtype) -> None:
    """``residual + x`` is rounded to the dtype (as torch's add) and then normalised; the sum is returned."""
    gen = torch.Generator().manual_seed(1)
    residual, x = (torch.randn(5, 576, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(dtype)
    module = RMSNorm(576, 1e-5).to(dtype)
    module.weight.data.copy_(weight)
    out, summed = rms_norm(x, weight, 1e-5, residual=residual)
    within(summed, residual + x, 0)  # one rounding, as torch's add
    within(out, module(residual + x), 2)


def test_rms_norm_of_no_rows_and_strided_rows() -> None:
    weight = torch.ones(64)
    out, _ = rms_norm(torch.empty(0, 64), weight, 1e-6)
    assert out.shape == (0, 64)
    wide = torch.randn(3, 100)
    torch.testing.assert_close(rms_norm(wide[:, :64], weight, 1e-6)[0], rms_norm(wide[:, :64].clone(), weight, 1e-6)[0])
    with pytest.raises(ValueError, match="x must have a contiguous last dimension"):
        rms_norm(wide.t(), torch.ones(3), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [128, 1000, 1536])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(6, 2 * n, generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(n, dim=-1)
    out = silu_and_mul(gate_up)
    assert out.shape == (6, n) and out.dtype == dtype
    # The interpreter's exp differs from torch's in the last float32 places (a GPU's approximate exp by a few more:
    # see the kernel module), which can move a half-precision rounding tie by one place.
    within(out, F.silu(gate) * up, 4)
    with pytest.raises(ValueError, match="gate and up halves"):
        silu_and_mul(gate_up[:, :-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (9, 3, 64), (4, 1, 128), (2, 2, 96)])
def test_rotary_embedding_matches_torch_on_qkv_views(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """q and k are strided views of a fused QKV output; positions repeat and jump (a batch of ragged rows)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, head_dim, 4096, torch.device("cpu"))
    positions = torch.tensor([0, 1, 2, 3, 0, 17, 4095, 1000, 1001], dtype=torch.int64)
    t = positions.numel()
    gen = torch.Generator().manual_seed(heads * head_dim)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)
    q_out, k_out = rotary_embedding(positions, q, k, rotary.cos_table, rotary.sin_table)
    q_ref, k_ref = rotary(positions, q, k)
    assert q_out.is_contiguous() and k_out.dtype == dtype
    # Each product is rounded as in the torch code; float32 may fuse a product into the add (one rounding less).
    # Errors scale with the inputs (|x| up to ~4), not with the difference of the two products.
    within(q_out, q_ref, 1, scale=4.0)
    within(k_out, k_ref, 1, scale=4.0)
    # The rotation itself, in float64, with the tables' cos and sin (their angles are float32 products, as in
    # transformers; the tables are checked through the model against HF elsewhere):
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    half = head_dim // 2
    cos = rotary.cos_table[positions, :half].double()[:, None, :]
    sin = rotary.sin_table[positions, :half].double()[:, None, :]
    x1, x2 = q.double()[..., :half], q.double()[..., half:]
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    within(q_out, expected, 3, scale=4.0)  # cos/sin and products rounded to the dtype, then the sum


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_models_with_fused_ops_equal_hf(
    arch: str, random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``BATCHGEN_TRITON_FUSED_OPS=1``: greedy tokens and logprobs equal HF transformers in float32 with chunked
    prefill (qwen3: q/k norms stay in torch beside the fused kernels)."""
    monkeypatch.setenv(TRITON_FUSED_OPS, "1")
    rows = greedy_prompts(vocab=300)[::2]
    dataset = write_jsonl(tmp_path / "prompts.jsonl", rows)
    results = generate(dataset, tmp_path / "out.arrow", random_models[arch], "--chunked-prefill-size", "16")
    check_against_hf(random_models[arch], rows, results)


def test_fused_ops_model_really_runs_the_kernels(
    random_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.kernels.triton import fused_elementwise

    model = ModelSource.open(str(random_models["llama"])).load(
        torch.float32, torch.device("cpu"), 64, kernel_switches()
    )
    assert model.rotary.fused_kernel is None and model.model.norm.fused_kernel is None
    monkeypatch.setenv(TRITON_FUSED_OPS, "1")
    for arch in ("llama", "qwen3"):
        model = ModelSource.open(str(random_models[arch])).load(
            torch.float32, torch.device("cpu"), 64, kernel_switches()
        )
        assert model.rotary.fused_kernel is fused_elementwise.rotary_embedding
        assert model.model.norm.fused_kernel is fused_elementwise.rms_norm
        for layer in model.model.layers:
            assert layer.input_layernorm.fused_kernel is fused_elementwise.rms_norm
            assert layer.post_attention_layernorm.fused_kernel is fused_elementwise.rms_norm
            assert layer.mlp.silu_and_mul is fused_elementwise.silu_and_mul
            # q/k norms see [tokens, heads, head_dim] views: they stay in torch.
            assert all(
                norm is None or norm.fused_kernel is None for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm)
            )
        assert arch != "qwen3" or model.model.layers[0].self_attn.q_norm is not None


def test_fused_ops_on_the_cpu_without_the_interpreter_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRITON_FUSED_OPS, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BatchgenError, match="BATCHGEN_TRITON_FUSED_OPS=1 needs a CUDA device"):
        triton_fused_ops_requested(torch.device("cpu"), kernel_switches())
    monkeypatch.setenv(TRITON_FUSED_OPS, "maybe")
    with pytest.raises(BatchgenError, match="BATCHGEN_TRITON_FUSED_OPS must be 1 or 0, got 'maybe'"):
        triton_fused_ops_requested(torch.device("cpu"), kernel_switches())
    for off in ("0", "off", ""):
        monkeypatch.setenv(TRITON_FUSED_OPS, off)
        assert not triton_fused_ops_requested(torch.device("cpu"), kernel_switches())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(TRITON_FUSED_OPS, "true")
    assert triton_fused_ops_requested(torch.device("cpu"), kernel_switches())


def test_fused_ops_are_on_by_default_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRITON_FUSED_OPS, raising=False)
    assert triton_fused_ops_requested(torch.device("cuda"), kernel_switches())
    assert not triton_fused_ops_requested(torch.device("cpu"), kernel_switches())
    monkeypatch.setenv(TRITON_FUSED_OPS, "0")
    assert not triton_fused_ops_requested(torch.device("cuda"), kernel_switches())
    # Without triton the default quietly keeps the PyTorch code; asking for the kernels is an error.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delenv(TRITON_FUSED_OPS)
    assert not triton_fused_ops_requested(torch.device("cuda"), kernel_switches())
    monkeypatch.setenv(TRITON_FUSED_OPS, "1")
    with pytest.raises(BatchgenError, match="needs triton"):
        triton_fused_ops_requested(torch.device("cuda"), kernel_switches())


def test_fused_ops_in_float16_are_as_close_to_float32_as_torch(
    random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half precision through the whole model: the fused kernels round where the torch code does, so their
    float16 run is as close to float32 as torch's own float16 run (float16 because the interpreter rounds it to
    nearest as a GPU does; its bfloat16 conversion truncates, which here doubles the error of any kernel that
    rounds in bfloat16)."""
    rng = random.Random(3)
    rows = [
        {
            "id": f"r{i}",
            "prompt_token_ids": [0] + [rng.randrange(2, 300) for _ in range(n)],
            "max_new_tokens": 12,
            "temperature": 0,
            "top_logprobs": 2,
            "ignore_eos": True,
        }
        for i, n in enumerate([1, 5, 16, 17, 40, 63, 90, 120])
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    model = random_models["llama"]
    ref = generate(dataset, tmp_path / "ref.arrow", model)
    noise = deviation(ref, generate(dataset, tmp_path / "torch.arrow", model, "--dtype", "float16"))
    monkeypatch.setenv(TRITON_FUSED_OPS, "1")
    fused = deviation(ref, generate(dataset, tmp_path / "fused.arrow", model, "--dtype", "float16"))
    assert noise.max > 0  # float16 really rounds here, so the comparison is not vacuous
    assert_within_rounding_noise(fused, noise, "fused ops, float16")
