"""The float32 carrier: on a CPU where a bfloat16 model's GEMMs run in float32, their outputs reach the fused CPU
ops unrounded and the ops hand float32 to the next GEMM. Each op given float32 must give the bits it gives on the
same input rounded by PyTorch's ``.to(torch.bfloat16)`` (round to nearest even: ties, infinities, NaN), and a
float32 output must hold exactly its bfloat16 output; a whole model so carried must give the logits of the model
that rounds after every GEMM, bit for bit, in prefill chunks and decode rounds alike. Skips, saying why, where the
extension cannot be built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from batchgen.bench.one_batch import OneBatchRunner
from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu.fused_elementwise import rms_norm, rotary_embedding, silu_and_mul
from batchgen.loop.engine import Engine
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.options import EngineOptions
from batchgen.loop.schedule_batch import ScheduleBatch
from batchgen.models import source
from batchgen.models.packed_linear import PackedLinear
from batchgen.models.rotary import RotaryEmbedding
from tests.helpers.models import build_random_model

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    problem = cpu_kernels.build_problem()
    if problem is not None:
        pytest.skip(f"the C++ kernels cannot be built on this machine: {problem}")


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal dtypes and bit patterns (NaN included, which ``torch.equal`` counts unequal)."""
    as_int = {BF16: torch.int16, F32: torch.int32}
    return got.dtype == expected.dtype and torch.equal(got.view(as_int[got.dtype]), expected.view(as_int[got.dtype]))


def _float32_input(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random float32 values with the cases rounding must get right spread through: halfway between two bfloat16
    numbers (ties go to the even one), just above halfway, the largest float32 (rounds to infinity), infinities
    and NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 4
    bits = x.view(torch.int32)
    tie = (bits & ~0xFFFF) | 0x8000  # exactly halfway: the low 16 bits are 0x8000
    bits[:, 1::7] = tie[:, 1::7]
    bits[:, 2::7] = tie[:, 2::7] + 1
    x[0, :4] = torch.tensor([torch.finfo(F32).max, float("inf"), -float("inf"), float("nan")])
    return x


@pytest.mark.parametrize("cols", [64, 1003])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rounds_a_float32_input_as_torch_does(cols: int, with_residual: bool) -> None:
    """1003 columns leave a tail past the vector chunks."""
    x = _float32_input(9, cols, cols)
    weight = (1 + 0.2 * torch.randn(cols, generator=torch.Generator().manual_seed(1))).to(BF16)
    residual = (torch.randn(9, cols, generator=torch.Generator().manual_seed(2)) * 3).to(BF16)
    if not with_residual:
        residual = None
    normed, summed = rms_norm(x.to(BF16), weight, 1e-6, residual)
    carried, carried_sum = rms_norm(x, weight, 1e-6, residual, out_dtype=F32)
    assert same_bits(carried, normed.float())
    assert same_bits(rms_norm(x, weight, 1e-6, residual)[0], normed)
    if with_residual:
        assert same_bits(carried_sum, summed)


@pytest.mark.parametrize("cols", [64, 1003])
def test_silu_and_mul_rounds_a_float32_input_as_torch_does(cols: int) -> None:
    gate_up = _float32_input(9, 2 * cols, cols)
    expected = silu_and_mul(gate_up.to(BF16))
    carried = silu_and_mul(gate_up, out_dtype=F32)
    assert same_bits(carried, expected.float())
    assert same_bits(silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_embedding_rounds_float32_q_and_k_as_torch_does(head_dim: int) -> None:
    """q and k strided views of one float32 QKV output; head_dim 40 takes the scalar loop."""
    config = LlamaConfig(hidden_size=8 * head_dim, num_attention_heads=8, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, head_dim, 512, torch.device("cpu"))
    positions = torch.tensor([0, 7, 511, 3, 3])
    qkv = _float32_input(5, 16 * head_dim, head_dim)
    q, k, _ = qkv.split([8 * head_dim, 4 * head_dim, 4 * head_dim], dim=-1)
    q, k = q.view(5, 8, head_dim), k.view(5, 4, head_dim)
    q_out, k_out = rotary_embedding(positions, q, k, rotary.cos_table, rotary.sin_table)
    q_ref, k_ref = rotary_embedding(positions, q.to(BF16), k.to(BF16), rotary.cos_table, rotary.sin_table)
    assert same_bits(q_out, q_ref) and same_bits(k_out, k_ref)


def test_bad_carrier_inputs_are_clear_errors() -> None:
    x, weight = torch.zeros(2, 8), torch.ones(8, dtype=BF16)
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32, got Half"):
        rms_norm(x, weight, 1e-6, out_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="residual must be a bfloat16 CPU tensor, got Float"):
        rms_norm(x, weight, 1e-6, torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="x must be a bfloat16 or float32 CPU tensor, got Double"):
        rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(RuntimeError, match="q and k must have one dtype, got Float and BFloat16"):
        tables = [torch.zeros(4, 8)] * 2
        rotary_embedding(torch.tensor([0]), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8, dtype=BF16), *tables)


def _logits_of_prefill_chunks_and_decodes(engine: Engine) -> list[torch.Tensor]:
    """Three prompts (48, 17 and 33 tokens) prefilled in one EXTEND round that cuts the first after 20 tokens,
    its rest in a second round, then three DECODE rounds of all three; each round's logits."""
    runner = OneBatchRunner(engine, seed=5)
    reqs = runner.make_reqs(3, 48, 8)
    reqs[1].prompt_ids, reqs[2].prompt_ids = reqs[1].prompt_ids[:17], reqs[2].prompt_ids[:33]
    # (mode, requests, tokens each, requests whose prompt is then done); each batch built when it runs, since a
    # ScheduleBatch notes at construction which rows sample.
    rounds = [
        (ForwardMode.EXTEND, reqs, [20, 17, 33], reqs[1:]),
        (ForwardMode.EXTEND, reqs[:1], [28], reqs[:1]),
        *((ForwardMode.DECODE, reqs, [1, 1, 1], reqs) for _ in range(3)),
    ]
    logits = []
    try:
        for mode, batch_reqs, lens, done in rounds:
            decodes = len(batch_reqs) if mode == ForwardMode.DECODE else 0
            round_logits, sample = runner.run_round(ScheduleBatch(mode, batch_reqs, lens, decodes))
            logits.append(round_logits.clone())
            tokens = sample.next_token_ids.tolist()
            assert len(tokens) == len(done)
            for req, token in zip(done, tokens):
                req.output_ids.append(token)
    finally:
        runner.release(reqs)
    return logits


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {})],
    ids=["llama", "tied", "qwen2-biases", "qwen3-qk-norm"],
)
def test_a_carried_model_gives_the_same_logits_bit_for_bit(
    arch: str, overrides: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GEMMs packed as float32 on any CPU (where oneDNN has bfloat16 kernels it would pack them as bfloat16 and
    carry nothing); with and without the carrier. Qwen3's q/k norms run in torch, so its q/k/v projection still
    rounds."""
    monkeypatch.setattr(source, "cpu_gemm_dtype", lambda dtype, device, prepack, deterministic=False: F32)
    model_dir = build_random_model(tmp_path / "m", arch, **overrides)
    logits = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("BATCHGEN_CPU_FLOAT32_CARRIER", switch)
        engine = Engine(EngineOptions(model=str(model_dir), dtype="bfloat16", device="cpu"))
        layer = engine.runner.model.model.layers[0]
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        assert all(isinstance(linear, PackedLinear) for linear in linears)
        carried = [not linear.round_output for linear in linears]
        assert carried == ([arch != "qwen3", True, True, True] if switch == "1" else [False] * 4)
        logits[switch] = _logits_of_prefill_chunks_and_decodes(engine)
    for plain, carried_logits in zip(logits["0"], logits["1"]):
        assert same_bits(carried_logits, plain)
