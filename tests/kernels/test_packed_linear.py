"""oneDNN-prepacked linear layers on the CPU: bit-identical to ``F.linear`` where oneDNN has bfloat16 kernels; as
float32 GEMMs elsewhere, where each output is the exact product rounded once to the model's dtype (up to the
order of the float32 sums), and the engine stays within bfloat16 rounding noise of HF's float32 run."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from batchgen.environment import kernel_switches
from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu import brgemm_bf16_supported
from batchgen.models import packed_linear, source
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.packed_linear import PackedLinear, cpu_gemm_dtype, prepack_linears
from tests.helpers.cli import generate, write_jsonl
from tests.helpers.models import REPO, build_random_model
from tests.helpers.reference import assert_within_rounding_noise, deviation, greedy_rows, hf_float32_rows

CPU = torch.device("cpu")
# oneDNN takes bfloat16 on any AVX-512 CPU (converting it where the CPU has no BF16 units); the engine packs a
# bfloat16 model's weights as bfloat16 only where it has them.
ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_onednn_bf16 = pytest.mark.skipif(
    not ONEDNN_BF16,
    reason="this CPU's oneDNN has no bfloat16 kernels (torch.ops.mkldnn._is_mkldnn_bf16_supported() is False)",
)
needs_native_bf16 = pytest.mark.skipif(
    cpu_gemm_dtype(torch.bfloat16, CPU) != torch.bfloat16,
    reason="this CPU has neither AVX512-BF16 nor AMX: bfloat16 models run their linear layers in float32 there",
)
SHAPES = [(1, 64, 48), (5, 576, 192), (64, 576, 3072), (300, 1536, 576)]


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def test_gemm_dtype_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other devices and the switch keep ``F.linear``; float32 packs as itself (MKL's ``F.linear`` is the slower
    on AMD CPUs); bfloat16 packs as itself on a CPU with AVX512-BF16 or AMX-BF16 (the flags of /proc/cpuinfo) and as
    float32 on one with neither, AVX-512 or not (where oneDNN has no bfloat16 kernels, or converts it to float32
    inside its GEMM)."""
    assert cpu_gemm_dtype(torch.float32, CPU) == torch.float32
    assert cpu_gemm_dtype(torch.bfloat16, torch.device("cuda")) is None
    flags = _cpu_flags()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert cpu_gemm_dtype(torch.bfloat16, CPU) == torch.bfloat16
    elif flags:
        assert cpu_gemm_dtype(torch.bfloat16, CPU) == torch.float32
    if flags and not any(f.startswith("avx512") for f in flags) and "avx_ne_convert" not in flags:
        assert cpu_gemm_dtype(torch.bfloat16, CPU) == torch.float32
        assert cpu_gemm_dtype(torch.float16, CPU) == torch.float32
    monkeypatch.setenv("BATCHGEN_CPU_PREPACK", "0")
    assert cpu_gemm_dtype(torch.bfloat16, CPU, kernel_switches().cpu_prepack) is None
    assert cpu_gemm_dtype(torch.float32, CPU, kernel_switches().cpu_prepack) is None
    # --deterministic packs every dtype, the switch notwithstanding.
    assert cpu_gemm_dtype(torch.float32, CPU, False, deterministic=True) == torch.float32
    assert cpu_gemm_dtype(torch.bfloat16, CPU, False, deterministic=True) in (torch.bfloat16, torch.float32)
    assert cpu_gemm_dtype(torch.float32, torch.device("cuda"), deterministic=True) is None


# The batch-invariant GEMMs: oneDNN's float32 one; for bfloat16 brgemm (where it has bfloat16) and oneDNN's calls of
# a fixed row count (where it has none, and for float16 models), the second forced here where brgemm would run; the
# half-weight kernel, batch invariant whether deterministic or not (float32 GEMMs on bfloat16 or float16 weights).
INVARIANT_PATHS = [
    pytest.param(torch.float32, "onednn", id="float32"),
    pytest.param(torch.bfloat16, "onednn", marks=needs_onednn_bf16, id="bfloat16-onednn-calls"),
    pytest.param(torch.bfloat16, "brgemm", id="bfloat16-brgemm"),
    pytest.param(torch.bfloat16, "half", id="bfloat16-half-weight"),
    pytest.param(torch.float16, "half", id="float16-half-weight"),
]


@pytest.mark.parametrize(("gemm_dtype", "path"), INVARIANT_PATHS)
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 192), (576, 960), (1536, 576), (576, 8192)])
def test_a_rows_output_depends_on_that_row_only(
    gemm_dtype: torch.dtype, path: str, in_features: int, out_features: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``--deterministic`` rests on: built with ``deterministic``, a row's output is the same bits in every
    window of 1 to 300 rows (at three offsets) as in one call of 1,000 rows. (Plain calls are not: MKL's float32
    ``F.linear`` gives other bits for 1, 2-15 and 16+ rows, oneDNN's bfloat16 kernels for 33-130 rows of 576 inputs
    among others, on an AMX CPU.)"""
    if path == "brgemm" and not brgemm_bf16_supported():
        pytest.skip("PyTorch's brgemm has no bfloat16 on this CPU (it needs AVX512-BF16 or AMX), or no C++ kernels")
    if path == "half" and cpu_kernels.build_problem() is not None:
        pytest.skip(f"the C++ kernels cannot be built on this machine: {cpu_kernels.build_problem()}")
    if path == "onednn":
        monkeypatch.setattr(packed_linear, "brgemm_bf16_supported", lambda: False)
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(gemm_dtype)
    x = torch.randn(1000, in_features, generator=gen).to(gemm_dtype)
    if path == "half":
        linear = PackedLinear(weight, None, torch.float32, half_weight=True)
    else:
        linear = PackedLinear(weight, None, deterministic=True)
    assert (linear.brgemm_weight is not None) == (path == "brgemm")
    reference = linear(x)
    for rows in [*range(1, 131), 255, 300]:
        for start in (0, 3, 50):
            assert torch.equal(linear(x[start : start + rows]), reference[start : start + rows]), (rows, start)


_FALLBACK_PROBE = """
import torch
from batchgen.kernels.cpu import brgemm_bf16_supported
from batchgen.models.packed_linear import PackedLinear, cpu_gemm_dtype
gemm = cpu_gemm_dtype(torch.bfloat16, torch.device("cpu"))
linear = PackedLinear(torch.randn(96, 64).bfloat16(), None, gemm, deterministic=True)
x = torch.randn(5, 64).bfloat16()
assert torch.equal(linear(x)[2:3], linear(x[2:3]))
print(brgemm_bf16_supported(), gemm, linear.brgemm_weight is None, linear.call_rows, linear.min_rows)
"""


def test_without_bfloat16_in_brgemm_the_layers_fall_back_to_onednn_calls() -> None:
    """On a CPU with AVX-512 but no BF16 (Skylake to Ice Lake Xeons), imitated by capping oneDNN's instruction set,
    brgemm cannot generate a bfloat16 kernel (oneDNN raises its own error, not PyTorch's): the probe says so, and
    ``--deterministic``'s bfloat16 layers run oneDNN calls of 64 rows where the CPU itself has BF16 units, float32
    GEMMs where it has none (a real AVX-512 part without BF16), still row-invariant."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    done = subprocess.run([sys.executable, "-c", _FALLBACK_PROBE], env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    supported, gemm, no_brgemm, call_rows, min_rows = done.stdout.split()
    assert (supported, no_brgemm) == ("False", "True")
    if gemm == "torch.bfloat16":
        assert (call_rows, min_rows) == (str(packed_linear.DETERMINISTIC_CALL_ROWS), "1")
    else:
        assert (gemm, call_rows, min_rows) == ("torch.float32", "0", "2")


@needs_onednn_bf16
@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = PackedLinear(weight, b)
    assert torch.equal(packed(x), F.linear(x, weight, b))
    assert torch.equal(packed(x[:1]), F.linear(x[:1], weight, b))  # one packing serves every row count


def _one_step_of(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at each float64 value: 2^(exponent) times its epsilon."""
    magnitude = reference.abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_gemms_round_the_exact_product_once(
    dtype: torch.dtype, rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    """A bfloat16/float16 layer packed as float32 returns the float64 product of its inputs rounded to the dtype:
    exactly for almost every element, and otherwise within one step of the dtype plus float32 summation's own
    error bound (``K u Σ|x_i w_i|``, u = 2^-24, Higham's "Accuracy and Stability of Numerical Algorithms" §3.1),
    which matters only where the sum cancels to near 0; in the layer's dtype, for any row count."""
    gen = torch.Generator().manual_seed(rows + in_features + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    magnitudes = F.linear(x.double().abs(), weight.double().abs(), None if b is None else b.double().abs())
    summation = (in_features + 1) * 2.0**-24 * magnitudes
    packed = PackedLinear(weight, b, torch.float32)
    for got, want, bound in ((packed(x), exact, summation), (packed(x[:1]), exact[:1], summation[:1])):
        assert got.dtype == dtype and got.shape == want.shape
        off = (got.double() - want.to(dtype).double()).abs()
        assert (off <= _one_step_of(want, dtype) + bound).all()
        assert (off == 0).double().mean() >= 0.99


@pytest.mark.parametrize("gemm_dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
def test_prepack_replaces_every_linear(gemm_dtype: torch.dtype) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    model = model.bfloat16()
    x = torch.randn(3, 8).bfloat16()
    want = model(x)
    assert prepack_linears(model, gemm_dtype) == 2
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(m.gemm_dtype == gemm_dtype for m in model.modules() if isinstance(m, PackedLinear))
    got = model(x)
    if gemm_dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)


@needs_native_bf16
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tied", [False, True])
def test_float32_gemm_engine_within_rounding_noise_of_hf_float32(
    dtype: str, tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half-precision model whose linear layers (the tied output projection too) run as float32 GEMMs, forced on
    any CPU, deviates from HF's float32 greedy run no more than the same model on PyTorch's own half-precision
    ``F.linear`` does (``assert_within_rounding_noise``)."""
    model_dir = build_random_model(
        tmp_path / "m", "llama", hidden_size=256, intermediate_size=512, tie_word_embeddings=tied
    )
    rows = greedy_rows((5, 30, 64, 100), 12, seed=4)
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    reference = hf_float32_rows(model_dir, rows, 12)
    monkeypatch.setenv("BATCHGEN_CPU_PREPACK", "0")
    noise = deviation(reference, generate(dataset, tmp_path / "plain.arrow", model_dir, "--dtype", dtype))
    monkeypatch.delenv("BATCHGEN_CPU_PREPACK")
    monkeypatch.setattr(source, "cpu_gemm_dtype", lambda d, device, prepack, deterministic=False: torch.float32)
    packed = deviation(reference, generate(dataset, tmp_path / "packed.arrow", model_dir, "--dtype", dtype))
    assert_within_rounding_noise(packed, noise, f"{dtype} through float32 GEMMs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_models_load_packed(
    dtype: torch.dtype, random_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def packed_layers() -> list[PackedLinear]:
        model = source.ModelSource.open(str(random_models["llama"])).load(dtype, CPU, 64, kernel_switches())
        return [m for m in model.modules() if isinstance(m, PackedLinear)]

    layers = packed_layers()
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up and down in each of 2 layers; the output projection
    assert {layer.gemm_dtype for layer in layers} == {cpu_gemm_dtype(dtype, CPU)}
    monkeypatch.setenv("BATCHGEN_CPU_PREPACK", "0")
    assert packed_layers() == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_gemm_models_read_their_half_weights(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a half-precision model's GEMMs run in float32 (forced here on any CPU), every linear layer, the tied
    output projection too, runs on its own half-precision weights, packed in their dtype (no float32 copy), under
    ``--deterministic`` as without it; not with ``BATCHGEN_CPU_HALF_WEIGHT_LINEAR=0``."""
    if cpu_kernels.build_problem() is not None:
        pytest.skip(f"the C++ kernels cannot be built on this machine: {cpu_kernels.build_problem()}")
    tied = build_random_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    monkeypatch.setattr(source, "cpu_gemm_dtype", lambda d, device, prepack, deterministic=False: torch.float32)

    def load(deterministic: bool = False) -> LlamaForCausalLM:
        return source.ModelSource.open(str(tied)).load(dtype, CPU, 64, kernel_switches(), deterministic)

    for deterministic in (False, True):
        model = load(deterministic)
        layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert len(layers) == 2 * 4 + 1 and model.tied_lm_head in layers
        assert all(layer.half_weight is not None and layer.half_weight.dtype == dtype for layer in layers)
        assert not any(hasattr(layer, "packed") for layer in layers)
    monkeypatch.setenv("BATCHGEN_CPU_HALF_WEIGHT_LINEAR", "0")
    assert all(m.half_weight is None for m in load().modules() if isinstance(m, PackedLinear))
