"""The decode graph runner in eager-padded mode (CPU): padding must change nothing but the dummy slot."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchgen.loop.cuda_graph_runner import capture_batch_sizes
from batchgen.loop.engine import Engine
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.options import EngineOptions
from batchgen.loop.req import Req
from batchgen.loop.schedule_batch import ScheduleBatch
from batchgen.sampling.sampling_params import SamplingParams
from batchgen.speculative import make_drafter
from tests.helpers.cli import generate, write_jsonl
from tests.helpers.engine import spy_graph_runs


@pytest.mark.parametrize(
    ("max_bs", "sizes"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (33, [1, 2, 4, 8, 16, 24, 32, 33]),
        (40, [1, 2, 4, 8, 16, 24, 32, 40]),
    ],
)
def test_capture_batch_sizes(max_bs: int, sizes: list[int]) -> None:
    assert capture_batch_sizes(max_bs) == sizes


def test_every_batch_size_up_to_33_decodes_as_unpadded(
    random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """33 rows finishing one step apart walk the decode batch through every size 32 … 1; through the padded
    runner the tokens are identical to plain eager decoding (fp32), and so are the logprobs up to GEMM
    rounding: CPU BLAS multiplies a 5-row and an 8-row batch with different kernels, which can differ in the
    last bit (test_padded_rows_touch_only_the_dummy_slot shows padding itself changes nothing)."""
    rng = random.Random(11)
    rows = [
        {
            "id": str(i),
            "prompt_token_ids": [0] + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 40))],
            "max_new_tokens": i + 1,
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "top_logprobs": 3,
        }
        for i in range(33)
    ]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    model = random_models["qwen2"]
    common = ("--max-running-requests", "33", "--chunked-prefill-size", "4096")
    eager = generate(dataset, tmp_path / "eager.jsonl", model, *common, "--disable-cuda-graph")

    served = spy_graph_runs(monkeypatch)
    padded = generate(dataset, tmp_path / "padded.jsonl", model, *common, "--cuda-graph-max-bs", "33")
    seen = [(bs, size) for _, bs, size in served]
    assert {bs for bs, _ in seen} == set(range(1, 33))  # 33 rows decode from their 2nd token: 32 … 1 rows
    assert any(size > bs for bs, size in seen)
    for rid, want in eager.items():
        got = padded[rid]
        assert got["output_token_ids"] == want["output_token_ids"]
        assert got["output_logprobs"] == pytest.approx(want["output_logprobs"], abs=1e-5, rel=0)
        assert [[t["id"] for t in step] for step in got["top_logprobs"]] == [
            [t["id"] for t in step] for step in want["top_logprobs"]
        ]


@pytest.mark.parametrize("batch_size", [4, 5])
def test_padded_rows_touch_only_the_dummy_slot(batch_size: int, random_models: dict[str, Path]) -> None:
    """A decode round through the runner writes only its own slots and slot 0; at a captured size (4, no
    padding rows) it is bit-identical to the plain forward, and padded (5 → 8) equal up to GEMM rounding."""
    engine = Engine(
        EngineOptions(
            model=str(random_models["llama"]),
            dtype="float32",
            device="cpu",
            max_total_tokens=600,
            max_running_requests=16,
            cuda_graph_max_bs=16,
        )
    )
    runner, pool = engine.runner, engine.runner.token_to_kv_pool
    assert runner.graph_runner is not None and not runner.graph_runner.use_cuda_graphs
    rng = random.Random(2)
    reqs = []
    for i in range(batch_size):
        prompt = [0] + [rng.randrange(2, 300) for _ in range(rng.randrange(3, 30))]
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        req = Req(str(i), prompt, params, seed=i, stop_token_ids=frozenset(), max_total_len=64)
        req.req_pool_idx = engine.kv_cache.allocate_rows(1)[0]
        reqs.append(req)
    # Prefill eagerly, then sample each request's first token.
    prefill = ScheduleBatch(ForwardMode.EXTEND, reqs, [len(r.prompt_ids) for r in reqs])
    worker = prefill.prepare(engine.kv_cache, engine.vocab_size, engine.device)
    out = runner.forward(ForwardBatch.init_new(worker, runner))
    for req, token in zip(reqs, runner.sample(out, worker.sampling_info).next_token_ids.tolist()):
        req.output_ids.append(token)

    decode = ScheduleBatch(ForwardMode.DECODE, reqs, [1] * batch_size, batch_size)
    worker = decode.prepare(engine.kv_cache, engine.vocab_size, engine.device)
    forward_batch = ForwardBatch.init_new(worker, runner)
    k_before, v_before = pool.k_buffer.clone(), pool.v_buffer.clone()
    padded_logits = runner.forward(forward_batch).next_token_logits
    assert runner.graph_runner.padded_size(batch_size) == {4: 4, 5: 8}[batch_size]
    assert padded_logits.shape[0] == batch_size

    # Bit patterns, not values: never-written slots may hold NaNs, which compare unequal to themselves.
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int32)

    changed = ((bits(pool.k_buffer) != bits(k_before)) | (bits(pool.v_buffer) != bits(v_before))).any(dim=(0, 1, 3))
    written = set(worker.out_cache_loc.tolist()) | {0}
    assert set(torch.nonzero(changed).flatten().tolist()) <= written
    assert set(worker.out_cache_loc.tolist()) <= set(torch.nonzero(changed).flatten().tolist())

    # The same round unpadded writes the same K/V and gives the same logits.
    k_padded, v_padded = pool.k_buffer.clone(), pool.v_buffer.clone()
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(forward_batch)
        eager_logits = runner.forward_model(forward_batch).next_token_logits
    real = worker.out_cache_loc
    pairs = [
        (pool.k_buffer[:, :, real], k_padded[:, :, real]),
        (pool.v_buffer[:, :, real], v_padded[:, :, real]),
        (eager_logits, padded_logits),
    ]
    for eager_value, padded_value in pairs:
        if batch_size == 4:
            assert torch.equal(eager_value, padded_value)
        else:
            torch.testing.assert_close(eager_value, padded_value, atol=1e-5, rtol=0)
    assert torch.equal(eager_logits.argmax(-1), padded_logits.argmax(-1))


def test_capture_batches_have_the_captured_shape(random_models: dict[str, Path]) -> None:
    """What ``_capture_all`` would capture for each (mode, size): ``size`` padding rows of 1 (DECODE) or K + 1
    (TARGET_VERIFY) tokens at positions 0, 1, … in request row 0 and slot 0, and a forward over it gives one
    logits row per token; a context shorter than K + 2 turns verify graphs off."""
    engine = Engine(
        EngineOptions(
            model=str(random_models["llama"]),
            dtype="float32",
            device="cpu",
            max_running_requests=8,
            cuda_graph_max_bs=6,
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=3,
        ),
        make_drafter,
    )
    runner = engine.runner
    graphs = runner.graph_runner
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 6] and graphs.verify_tokens == 4
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        per_row = graphs.tokens_per_request(mode)
        for size in graphs.batch_sizes:
            with torch.inference_mode():  # the runner's buffers are inference tensors, as in ModelRunner
                batch = graphs._padding_batch(mode, size)
            assert batch.batch_size == size and batch.input_ids.numel() == size * per_row
            assert batch.positions.tolist() == list(range(per_row)) * size
            assert batch.req_pool_indices.tolist() == [0] * size and batch.seq_lens.tolist() == [per_row] * size
            assert set(batch.out_cache_loc.tolist()) == {0}
            if per_row > 1:
                assert batch.extend_seq_lens_cpu == [per_row] * size and batch.extend_prefix_lens_cpu == [0] * size
            with torch.inference_mode():
                runner.attn_backend.init_forward_metadata(batch)
                assert runner.forward_model(batch).next_token_logits.shape[0] == size * per_row
    short = Engine(
        EngineOptions(
            model=str(random_models["llama"]),
            dtype="float32",
            device="cpu",
            context_length=4,
            cuda_graph_max_bs=2,
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=6,
        ),
        make_drafter,
    )
    assert short.runner.graph_runner is not None and short.runner.graph_runner.verify_tokens == 0
