"""A DECODE round's layers in one C++ call (``batchgen.models.one_call_decode``,
``batchgen/kernels/cpu/decode_layers.cpp``) must give the bits the Python layers give on the same round: the final
hidden states and the K/V it writes into the pool, for every row count it serves, with and without the q/k/v and
o projections' biases, on requests of different lengths; and the model runner's rounds the logits they get
without it. Where it must not run (another setup of the layers, other rounds) it does not. Two setups of the
layers: few rows on the half-precision weights, with the GEMMs packed as float32 on any CPU, as on one without
AVX-512, so that the path runs wherever the extension builds; and ``--deterministic``'s brgemm-packed layers, where
brgemm runs bfloat16 (skipped elsewhere, saying so). Skips, saying why, where the extension cannot be built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.bench.attention_time import timing_attention
from batchgen.bench.one_batch import OneBatchRunner
from batchgen.kernels import cpu as cpu_kernels
from batchgen.kernels.cpu.brgemm_linear import COLUMN_BLOCK
from batchgen.loop.engine import Engine
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.loop.schedule_batch import ScheduleBatch
from batchgen.models import source
from batchgen.models.one_call_decode import OneCallDecode
from batchgen.models.packed_linear import PackedLinear
from tests.helpers.models import build_random_model


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    problem = cpu_kernels.build_problem()
    if problem is not None:
        pytest.skip(f"the C++ kernels cannot be built on this machine: {problem}")


@pytest.fixture
def float32_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pack GEMMs as float32, as on a CPU whose oneDNN has no bfloat16 GEMM, so few rows run on half weights."""
    monkeypatch.setattr(source, "cpu_gemm_dtype", lambda dtype, device, prepack, deterministic=False: torch.float32)


def _same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[expected.dtype]
    return got.dtype == expected.dtype and torch.equal(got.view(as_int), expected.view(as_int))


def _engine(model_dir: Path, **options: Any) -> Engine:
    """The model's engine, in bfloat16 on the CPU; not ``--deterministic`` unless ``options`` say so."""
    return Engine(
        EngineOptions(model=str(model_dir), dtype="bfloat16", device="cpu", **{"deterministic": False, **options})
    )


@pytest.fixture(params=["half-weights", "half-weights-deterministic", "brgemm"])
def layers_setup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The engine options of a setup whose decode rounds run as one call, the rows checked, and whether gate/up
    projections take their SiLU in the same pass: the half-precision weights (GEMMs run in float32, as
    :func:`float32_gemms`), with ``--deterministic`` or not (rows past the kernel's 8 of stream tiles, which take
    brgemm), or ``--deterministic``'s brgemm-packed layers (past their dot tiles' groups of 6 and 24)."""
    if request.param.startswith("half-weights"):
        monkeypatch.setattr(source, "cpu_gemm_dtype", lambda dtype, device, prepack, deterministic=False: torch.float32)
        return {"options": {"deterministic": request.param.endswith("deterministic")}, "rows": 10, "fuses": False}
    if not cpu_kernels.brgemm_bf16_supported():
        pytest.skip("needs PyTorch's brgemm with bfloat16 (AMX or AVX512-BF16), which this CPU lacks")
    return {"options": {"deterministic": True}, "rows": 27, "fuses": True}


def _decode_round(engine: Engine, rows: int) -> tuple[ForwardBatch, list[Req]]:
    """``rows`` requests with prompts of 5, 12, 19, ... tokens, prefilled, and the DECODE round that follows (the
    caller gives the requests' rows and slots back with ``OneBatchRunner.release``)."""
    runner = OneBatchRunner(engine, seed=rows)
    reqs = runner.make_reqs(rows, 5 + 7 * (rows - 1), 4)
    for i, req in enumerate(reqs):
        req.prompt_ids = req.prompt_ids[: 5 + 7 * i]
    _, _, first = runner.prefill(reqs)
    for req, token in zip(reqs, first.next_token_ids.tolist()):
        req.output_ids.append(token)
    worker = ScheduleBatch(ForwardMode.DECODE, reqs, [1] * rows, rows).prepare(
        engine.kv_cache, engine.vocab_size, engine.device
    )
    return ForwardBatch.init_new(worker, engine.runner), reqs


@pytest.mark.parametrize(
    ("arch", "overrides", "num_biases"),
    [
        ("llama", {}, 0),
        ("llama", {"attention_bias": True, "num_hidden_layers": 3}, 6),
        ("qwen2", {}, 2),
        ("llama", {"intermediate_size": 96}, 0),
    ],
    ids=["llama", "qkv-and-o-biases-3-layers", "qwen2-qkv-biases", "gate-up-halves-not-whole-brgemm-blocks"],
)
def test_the_call_gives_the_python_layers_bits(
    arch: str, overrides: dict[str, Any], num_biases: int, tmp_path: Path, layers_setup: dict[str, Any]
) -> None:
    """Each row count the setup serves: the hidden states, and the new tokens' K/V in every layer of the pool
    (set to NaN between the two runs, so the call must write them itself). On brgemm, gate/up halves of whole
    column blocks run with SiLU-and-multiply as one op in both, others as two."""
    most = layers_setup["rows"]
    model_dir = build_random_model(tmp_path / "m", arch, **overrides)
    engine = _engine(model_dir, max_running_requests=most, **layers_setup["options"])
    runner = engine.runner
    one_call = runner.one_call_decode
    assert one_call is not None and one_call.max_rows == most
    fused = [layer.mlp.gate_up_silu is not None for layer in runner.model.model.layers]
    whole_blocks = overrides.get("intermediate_size", 128) % COLUMN_BLOCK == 0
    assert fused == [whole_blocks and layers_setup["fuses"]] * len(fused)
    assert one_call.gate_up_silu == fused  # the call fuses where the model does, told rather than guessing
    biases = [m.bias for m in runner.model.modules() if isinstance(m, PackedLinear) and m.bias is not None]
    assert len(biases) == num_biases
    gen = torch.Generator().manual_seed(3)
    for bias in biases:  # transformers initialises biases to zero, which would hide a lost one
        bias.copy_(torch.randn(bias.shape, generator=gen))
    pool = runner.token_to_kv_pool
    for rows in range(1, most + 1):
        fb, reqs = _decode_round(engine, rows)
        assert one_call.can_run(fb)
        with torch.inference_mode():
            runner.attn_backend.init_forward_metadata(fb)
            plain = runner.model(fb.input_ids, fb.positions, fb)
            k_plain, v_plain = (
                pool.k_buffer[:, :, fb.out_cache_loc].clone(),
                pool.v_buffer[:, :, fb.out_cache_loc].clone(),
            )
            pool.k_buffer[:, :, fb.out_cache_loc] = float("nan")
            pool.v_buffer[:, :, fb.out_cache_loc] = float("nan")
            got = one_call(fb)
        assert _same_bits(got, plain), f"{rows} rows"
        assert _same_bits(pool.k_buffer[:, :, fb.out_cache_loc], k_plain), f"{rows} rows: K"
        assert _same_bits(pool.v_buffer[:, :, fb.out_cache_loc], v_plain), f"{rows} rows: V"
        OneBatchRunner(engine).release(reqs)


def test_a_layer_the_model_leaves_unfused_runs_unfused_in_the_call(tmp_path: Path) -> None:
    """Shapes that could fuse, one layer left unfused by the model: the call follows the model's flags (and gives
    its bits) rather than the shapes; a flag list of the wrong length is refused."""
    if not cpu_kernels.brgemm_bf16_supported():
        pytest.skip("needs PyTorch's brgemm with bfloat16 (AMX or AVX512-BF16), which this CPU lacks")
    engine = _engine(build_random_model(tmp_path / "m", "llama"), max_running_requests=3, deterministic=True)
    runner = engine.runner
    runner.model.model.layers[1].mlp.gate_up_silu = None
    one_call = OneCallDecode.from_model(runner.model, runner.attn_backend, 3)
    assert one_call is not None and one_call.gate_up_silu == [True, False]
    fb, reqs = _decode_round(engine, 3)
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        plain = runner.model(fb.input_ids, fb.positions, fb)
        got = one_call(fb)
        assert _same_bits(got, plain)
        one_call.gate_up_silu = [True]
        with pytest.raises(RuntimeError, match="gate_up_silu must be empty or hold one flag for each of 2 layers"):
            one_call(fb)
    OneBatchRunner(engine).release(reqs)


def test_the_runner_sends_its_decode_rounds_through_it(tmp_path: Path, float32_gemms: None) -> None:
    """``ModelRunner.forward`` on a round of 3 decode rows: the one call (and no Python attention) gives the
    logits the Python layers give on the same round."""
    engine = _engine(build_random_model(tmp_path / "m", "llama"))
    runner = engine.runner
    one_call = runner.one_call_decode
    assert one_call is not None
    fb, reqs = _decode_round(engine, 3)
    with timing_attention(engine) as clock:  # the Python backend's calls are timed apart from the call's own
        assert one_call.attention_seconds is not None
        got = runner.forward(fb).next_token_logits.clone()
        in_call = float(one_call.attention_seconds)
    assert in_call > 0 and clock.seconds == in_call
    runner.one_call_decode = None
    expected = runner.forward(fb).next_token_logits
    assert _same_bits(got, expected)
    OneBatchRunner(engine).release(reqs)


def test_it_serves_only_the_decode_rounds_of_its_setup(tmp_path: Path, float32_gemms: None) -> None:
    """Every DECODE round up to the engine's most running requests (the half-weight GEMMs take any row count);
    no EXTEND round."""
    engine = _engine(build_random_model(tmp_path / "m", "llama"), max_running_requests=5)
    one_call = engine.runner.one_call_decode
    assert one_call is not None and one_call.max_rows == 5
    fb, reqs = _decode_round(engine, 5)
    assert one_call.can_run(fb)
    runner = OneBatchRunner(engine, seed=0)
    runner.release(reqs)
    reqs = runner.make_reqs(2, 6, 4)
    worker = ScheduleBatch(ForwardMode.EXTEND, reqs, [6, 6]).prepare(engine.kv_cache, engine.vocab_size, engine.device)
    assert not one_call.can_run(ForwardBatch.init_new(worker, engine.runner))


@pytest.mark.parametrize(
    ("arch", "env", "options"),
    [
        ("qwen3", {}, {}),  # q/k norms run in torch between the projection and RoPE
        ("llama", {"BATCHGEN_CPU_FLOAT32_CARRIER": "0"}, {}),  # each GEMM's output rounded in Python
        ("llama", {"BATCHGEN_CPU_HALF_WEIGHT_LINEAR": "0"}, {}),
        ("llama", {"BATCHGEN_CPU_ATTENTION_KERNEL": "0"}, {}),
    ],
    ids=["qwen3-qk-norm", "no-carrier", "no-half-weights", "no-attention-kernel"],
)
def test_other_setups_keep_the_python_layers(
    arch: str,
    env: dict[str, str],
    options: dict[str, Any],
    tmp_path: Path,
    float32_gemms: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine = _engine(build_random_model(tmp_path / "m", arch), **options)
    assert engine.runner.one_call_decode is None


def test_a_float32_model_keeps_the_python_layers(tmp_path: Path) -> None:
    engine = Engine(
        EngineOptions(model=str(build_random_model(tmp_path / "m", "llama")), dtype="float32", device="cpu")
    )
    assert engine.runner.one_call_decode is None
    assert OneCallDecode.from_model(engine.runner.model, engine.runner.attn_backend, 8) is None
