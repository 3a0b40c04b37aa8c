"""batchgen's fused elementwise C++ ops for bfloat16 on the CPU (RMSNorm with the residual add, SiLU-and-multiply,
RoPE) against HF transformers' own modules in bfloat16 (``LlamaRMSNorm``, the ``silu`` activation,
``apply_rotary_pos_emb``), which round at the same steps: RoPE, the residual add and SiLU-and-multiply must give
the same bits (SiLU on every bfloat16 gate too); RMSNorm the same bits but where its float32 sum lands on the
other side of a bfloat16 rounding boundary (then one bfloat16 step apart, at most 1 element in 1,000).
Then their errors, the switch, and the model's wiring. Skips, saying why, where the extension cannot be built (no
compiler or ninja).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from batchgen.environment import kernel_switches
from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu.fused_elementwise import (
    fused_ops_supported,
    rms_norm,
    rotary_embedding,
    rotary_embedding_kv,
    silu_and_mul,
)
from batchgen.kernels.switches import KernelSwitches
from batchgen.models.rotary import RotaryEmbedding
from batchgen.models.source import ModelSource

BF16 = torch.bfloat16
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    problem = cpu_kernels.build_problem()
    if problem is not None:
        pytest.skip(f"the C++ kernels cannot be built on this machine: {problem}")


def _hf_llama() -> Any:
    """transformers' Llama modeling module, imported when a test runs: importing it imports triton, which must
    not happen while pytest collects, before tests/kernels/test_fused_elementwise.py selects Triton's interpreter."""
    from transformers.models.llama import modeling_llama

    return modeling_llama


def assert_equal_but_rare_boundary_cases(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits, but for at most 1 element in 1,000, each one bfloat16 step (2^-7 relative) from expected."""
    assert got.dtype == expected.dtype == BF16 and got.shape == expected.shape
    differ = got != expected
    assert int(differ.sum()) <= max(1, got.numel() // 1000), f"{int(differ.sum())} of {got.numel()} differ"
    step = expected[differ].float().abs() * 2.0**-7
    assert bool(((got[differ].float() - expected[differ].float()).abs() <= step * 1.01).all())


@pytest.mark.parametrize("hidden", [64, 576, 1000, 1003])
def test_rms_norm_with_and_without_residual_matches_hf(hidden: int) -> None:
    """576 is SmolLM2's hidden size; 1000 and 1003 leave tails past the 16- and 8-lane chunks. x is a strided
    view."""
    LlamaRMSNorm = _hf_llama().LlamaRMSNorm
    gen = torch.Generator().manual_seed(hidden)
    wide = (torch.randn(300, hidden + 8, generator=gen) * 3).to(BF16)
    x = wide[:, :hidden]
    residual = (torch.randn(300, hidden, generator=gen) * 3).to(BF16)
    hf = LlamaRMSNorm(hidden, eps=1e-6).to(BF16)
    hf.weight.data.copy_(1 + 0.2 * torch.randn(hidden, generator=gen))
    with torch.no_grad():
        normed, summed = rms_norm(x, hf.weight, 1e-6)
        assert summed is x
        assert_equal_but_rare_boundary_cases(normed, hf(x))
        normed, summed = rms_norm(x, hf.weight, 1e-6, residual)
        assert torch.equal(summed, residual + x)
        assert_equal_but_rare_boundary_cases(normed, hf(residual + x))


def test_rms_norm_of_no_rows() -> None:
    normed, summed = rms_norm(torch.empty(0, 64, dtype=BF16), torch.ones(64, dtype=BF16), 1e-6)
    assert normed.shape == summed.shape == (0, 64)


@pytest.mark.parametrize("n", [128, 500, 1536])
def test_silu_and_mul_matches_hf(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(257, 2 * n, generator=gen) * 4).to(BF16)
    gate, up = gate_up.split(n, dim=-1)
    from transformers.activations import ACT2FN

    assert torch.equal(silu_and_mul(gate_up), ACT2FN["silu"](gate) * up)


def _every_gate() -> torch.Tensor:
    """All 65,536 bfloat16 bit patterns, as one gate_up row per up value (1 and 1e30)."""
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(BF16)
    return torch.stack([torch.cat([gates, torch.full_like(gates, up)]) for up in (1.0, 1e30)])


def _assert_silu_of_every_gate(got: torch.Tensor, gate_up: torch.Tensor) -> None:
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
    assert bool(same.all()), gate[~same][:8].tolist()


def test_silu_and_mul_equals_torch_for_every_bfloat16_gate() -> None:
    """All 65,536 bfloat16 bit patterns as gates (NaN, infinities, subnormals, and the gates below -87 where the
    kernel's exp needs its subnormal branch), times 1 and 1e30: the same bits as ``F.silu(gate) * up``."""
    gate_up = _every_gate()
    _assert_silu_of_every_gate(silu_and_mul(gate_up), gate_up)


# Run in a child process: the ops built without AVX-512 (8 float32 lanes, as on AVX2 CPUs), on the parent's
# inputs. Its own process, since one process can load the batchgen op library once only.
_AVX2_BUILD = """
import sys, torch
from batchgen.kernels import cpu
from batchgen.kernels.cpu import fused_elementwise as ops
cpu._CFLAGS.append("-mno-avx512f")
gate_up, x, residual, weight, positions, q, k, cos, sin = torch.load(sys.argv[1])
normed, summed = ops.rms_norm(x, weight, 1e-6, residual)
torch.save((ops.silu_and_mul(gate_up), normed, summed, *ops.rotary_embedding(positions, q, k, cos, sin)), sys.argv[2])
"""
_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


def test_the_8_lane_build_of_an_avx2_cpu_gives_the_same_results(tmp_path: Path) -> None:
    """On a CPU with AVX-512 the tests above run 16-lane code; this builds the ops without it, as for AVX2 CPUs,
    and checks them against HF's modules the same way."""
    if " avx512f" not in _FLAGS:
        pytest.skip("this CPU has no AVX-512: the tests above already ran the 8-lane code")
    gen = torch.Generator().manual_seed(9)
    x, residual = ((torch.randn(300, 1003, generator=gen) * 3).to(BF16) for _ in range(2))
    weight = (1 + 0.2 * torch.randn(1003, generator=gen)).to(BF16)
    config = LlamaConfig(hidden_size=8 * 64, num_attention_heads=8, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, 64, 512, CPU)
    positions = torch.tensor([0, 5, 511, 3])
    q, k = (torch.randn(4, 8, 64, generator=gen) * 3).to(BF16), (torch.randn(4, 2, 64, generator=gen) * 3).to(BF16)
    inputs = (_every_gate(), x, residual, weight, positions, q, k, rotary.cos_table, rotary.sin_table)
    torch.save(inputs, tmp_path / "in.pt")
    subprocess.run(
        [sys.executable, "-c", _AVX2_BUILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], check=True, timeout=600
    )
    silu, normed, summed, q_out, k_out = torch.load(tmp_path / "out.pt")
    _assert_silu_of_every_gate(silu, inputs[0])
    hf = _hf_llama().LlamaRMSNorm(1003, eps=1e-6).to(BF16)
    hf.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(summed, residual + x)
        assert_equal_but_rare_boundary_cases(normed, hf(residual + x))
    cos = rotary.cos_table[positions].to(BF16)[None]
    sin = rotary.sin_table[positions].to(BF16)[None]
    q_ref, k_ref = _hf_llama().apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1)) and torch.equal(k_out, k_ref[0].transpose(0, 1))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(8, 4, 64), (9, 3, 64), (4, 1, 128), (2, 2, 96), (2, 1, 40), (2, 1, 16), (2, 2, 48)],
)
def test_rotary_embedding_equals_hf_on_qkv_views(heads: int, kv_heads: int, head_dim: int) -> None:
    """q and k strided views of one fused QKV output, positions that repeat and jump; head_dim 40 takes the scalar
    loop (its half is a multiple of neither 8 nor 16), 16 and 48 the vector loop of 8 lanes only. Bit-identical to
    transformers' ``apply_rotary_pos_emb``."""
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, head_dim, 4096, CPU)
    positions = torch.tensor([0, 1, 2, 3, 0, 17, 4095, 1000, 1001], dtype=torch.int64)
    t = positions.numel()
    gen = torch.Generator().manual_seed(heads * head_dim)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(BF16)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)
    q_out, k_out = rotary_embedding(positions, q, k, rotary.cos_table, rotary.sin_table)
    # transformers' layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim] in the dtype.
    cos = rotary.cos_table[positions].to(BF16)[None]
    sin = rotary.sin_table[positions].to(BF16)[None]
    q_ref, k_ref = _hf_llama().apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(k_out, k_ref[0].transpose(0, 1))


@pytest.mark.parametrize("turns", [True, False], ids=["rope", "no-rope-layer"])
@pytest.mark.parametrize("carrier", [BF16, torch.float32], ids=["bfloat16", "float32-carrier"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 128), (2, 1, 40)])
def test_rotary_embedding_kv_equals_hf_rope_then_the_pool_store(
    heads: int, kv_heads: int, head_dim: int, carrier: torch.dtype, turns: bool
) -> None:
    """The RoPE that stores K/V: q equals transformers' rotated q, and the pool afterwards equals a pool into which
    transformers' rotated k and the bfloat16 v were index-copied at the same slots (float32 inputs, as a float32
    GEMM hands them on, are rounded to bfloat16 first, as the model's casts do); every other slot is untouched. On
    the table that turns nothing (a SmolLM3 layer without RoPE) q and k come out as transformers leaves them there,
    unrotated."""
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, head_dim, 2048, CPU, turns=turns)
    positions = torch.tensor([0, 5, 6, 2047, 300, 1], dtype=torch.int64)
    loc = torch.tensor([7, 3, 12, 1, 20, 9], dtype=torch.int64)
    t = positions.numel()
    gen = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(carrier)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)
    k_cache = torch.randn(kv_heads, 24, head_dim, generator=gen).to(BF16)
    v_cache = torch.randn(kv_heads, 24, head_dim, generator=gen).to(BF16)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    q_out = rotary_embedding_kv(positions, q, k, v, rotary.cos_table, rotary.sin_table, k_cache, v_cache, loc)
    cos = rotary.cos_table[positions].to(BF16)[None]
    sin = rotary.sin_table[positions].to(BF16)[None]
    q16, k16 = q.to(BF16).transpose(0, 1)[None], k.to(BF16).transpose(0, 1)[None]
    q_ref, k_ref = _hf_llama().apply_rotary_pos_emb(q16, k16, cos, sin) if turns else (q16, k16)
    k_want[:, loc] = k_ref[0]
    v_want[:, loc] = v.to(BF16).transpose(0, 1)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(k_cache, k_want)
    assert torch.equal(v_cache, v_want)


def test_rotary_embedding_kv_refuses_a_slot_outside_the_pool() -> None:
    q, k = torch.zeros(1, 2, 8, dtype=BF16), torch.zeros(1, 1, 8, dtype=BF16)
    cache = torch.zeros(1, 4, 8, dtype=BF16)
    with pytest.raises(RuntimeError, match="slot 4 is outside the pool's 4 slots"):
        rotary_embedding_kv(
            torch.tensor([0]),
            q,
            k,
            k.clone(),
            torch.zeros(4, 8),
            torch.zeros(4, 8),
            cache,
            cache.clone(),
            torch.tensor([4]),
        )


def _rope(position: int = 0, q_shape: tuple[int, ...] = (1, 2, 8), sin_rows: int = 4) -> Any:
    """RoPE of one token (head_dim 8) over tables of 4 positions, with one input changed."""
    q, k = torch.zeros(q_shape, dtype=BF16), torch.zeros(1, 1, 8, dtype=BF16)
    return rotary_embedding(torch.tensor([position]), q, k, torch.zeros(4, 8), torch.zeros(sin_rows, 8))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: rms_norm(torch.zeros(2, 8, dtype=BF16), torch.ones(8), 1e-6),
            "rms_norm: weight must be contiguous bfloat16",
        ),
        (
            lambda: rms_norm(
                torch.zeros(2, 8, dtype=BF16), torch.ones(8, dtype=BF16), 1e-6, torch.zeros(3, 8, dtype=BF16)
            ),
            "residual has 3 rows, x 2",
        ),
        (lambda: silu_and_mul(torch.zeros(2, 7, dtype=BF16)), "gate and up halves, got a last dimension of 7"),
        (lambda: _rope(position=5), "position 5 is outside the tables' 4 rows"),
        (lambda: rms_norm(torch.tensor(1.0, dtype=BF16), torch.ones(1, dtype=BF16), 1e-6), "x must be 2-D"),
        (lambda: silu_and_mul(torch.zeros(8, dtype=BF16)), "gate_up must be 2-D"),
        (lambda: _rope(q_shape=(1, 8)), "q must be 3-D"),
        (lambda: _rope(sin_rows=2), "the cos and sin tables must have the same rows, got 4 and 2"),
    ],
    ids=[
        "float32-weight",
        "residual-rows",
        "odd-width",
        "position-outside-table",
        "0-d",
        "1-d",
        "2-d-q",
        "short-sin-table",
    ],
)
def test_bad_inputs_are_clear_errors(call: object, message: str) -> None:
    with pytest.raises(RuntimeError, match=message) as err:
        call()  # type: ignore[operator]
    assert "batchgen::" in str(err.value)


def test_supported_for_bfloat16_on_the_cpu_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_CPU_FUSED_OPS", raising=False)
    assert kernel_switches().cpu_fused_ops and fused_ops_supported(BF16, CPU)
    assert not fused_ops_supported(torch.float32, CPU)  # the reference path stays PyTorch's
    assert not fused_ops_supported(torch.float16, CPU)
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("BATCHGEN_CPU_FUSED_OPS", off)
        assert not kernel_switches().cpu_fused_ops


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_bfloat16_cpu_model_is_wired_to_the_ops(monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    """(tests/kernels/test_float32_carrier.py covers the wiring with the float32 carrier, off here.)"""
    monkeypatch.setenv("BATCHGEN_CPU_FUSED_OPS", switch)
    monkeypatch.setenv("BATCHGEN_CPU_FLOAT32_CARRIER", "0")
    model = ModelSource.open("random:llama-58m").load(BF16, CPU, 256, kernel_switches())
    norms = [n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    wired = [n.fused_kernel for n in [*norms, model.model.norm]]
    wired += [layer.mlp.silu_and_mul for layer in model.model.layers] + [model.rotary.fused_kernel]
    if switch == "1":
        assert set(wired) == {rms_norm, silu_and_mul, rotary_embedding}
    else:
        assert set(wired) == {None}
    model = ModelSource.open("random:llama-58m").load(torch.float32, CPU, 256, KernelSwitches())
    assert model.rotary.fused_kernel is None
