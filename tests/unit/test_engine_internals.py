"""KV accounting, the slot allocator, ForwardMode predicates and the scheduler's round building."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchgen.errors import BatchgenError
from batchgen.loop.engine import Engine
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.forward_mode import ForwardMode
from batchgen.loop.kv_pool import KVSlotAllocator, TokenToKVPool
from batchgen.loop.options import EngineOptions
from tests.helpers.engine import enqueue_rows


def test_freed_slots_are_copied_not_aliased() -> None:
    allocator = KVSlotAllocator(8)
    slots = allocator.alloc(3)
    table = torch.zeros(5, dtype=torch.int64)
    table[:3] = slots
    allocator.free(table[:3])
    table[:3] = 99  # the request row is reused right away
    assert sorted(allocator.alloc(8).tolist()) == list(range(1, 9))


def test_allocator_never_hands_out_slot_zero_and_refuses_overdraft() -> None:
    allocator = KVSlotAllocator(4)
    assert 0 not in allocator.alloc(4).tolist()
    assert allocator.available() == 0
    try:
        allocator.alloc(1)
    except RuntimeError as e:
        assert "exhausted" in str(e)
    else:
        raise AssertionError("allocating from an empty pool must fail")


def test_a_kv_cache_too_large_to_allocate_is_one_line_naming_its_size() -> None:
    # 2**40 tokens x 1 layer x 1 head x 64 float32 x (K + V) = 2**49 bytes = 512 TiB: no machine allocates it.
    with pytest.raises(BatchgenError) as info:
        TokenToKVPool(2**40 - 1, 1, 1, 64, torch.float32, torch.device("cpu"))
    assert str(info.value).startswith(
        f"cannot allocate a KV cache of {2**40 - 1} tokens (524288.0 GiB on cpu); ask for fewer tokens"
    )


def test_forward_mode_predicates() -> None:
    assert ForwardMode.EXTEND.is_extend() and ForwardMode.MIXED.is_extend() and ForwardMode.DRAFT_EXTEND.is_extend()
    assert not ForwardMode.DECODE.is_extend() and ForwardMode.DECODE.is_decode()
    assert ForwardMode.TARGET_VERIFY.is_target_verify() and not ForwardMode.DECODE.is_target_verify()


def _engine_with_requests(model_dir: Path, tmp_path: Path, **options: object) -> tuple[Engine, int]:
    engine = Engine(EngineOptions(model=str(model_dir), dtype="float32", device="cpu", **options))  # type: ignore[arg-type]
    rng = random.Random(3)
    rows = [
        {
            "id": str(i),
            "prompt_token_ids": [0] + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 60))],
            "max_new_tokens": rng.randrange(1, 20),
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(24)
    ]
    enqueue_rows(engine, rows, tmp_path / "p.jsonl")
    return engine, len(rows)


def test_every_kv_slot_is_free_after_a_run_with_preemption(random_models: dict[str, Path], tmp_path: Path) -> None:
    engine, num_rows = _engine_with_requests(
        random_models["llama"], tmp_path, max_total_tokens=120, chunked_prefill_size=16, max_running_requests=8
    )
    modes: set[ForwardMode] = set()
    finished = []
    while engine.has_work():
        batch = engine.scheduler.next_batch()
        assert batch is not None
        modes.add(batch.forward_mode)
        # The scheduler never plans a round the pool cannot hold.
        assert sum(batch.extend_lens) <= engine.kv_cache.available()
        worker = batch.prepare(engine.kv_cache, engine.vocab_size, engine.device)
        logits = engine.runner.forward(ForwardBatch.init_new(worker, engine.runner))
        finished += engine.scheduler.process_result(batch, engine.runner.sample(logits, worker.sampling_info))
    assert len(finished) == num_rows
    assert engine.scheduler.num_retracted > 0
    assert {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED} <= modes
    assert engine.kv_cache.available() == 120
    assert engine.runner.req_to_token_pool.available() == 8
    for req in finished:
        assert len(req.output_ids) == req.params.max_new_tokens


@pytest.mark.parametrize("mixed", [True, False])
def test_tiny_pool_with_small_chunks_always_makes_progress(
    mixed: bool, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """A retracted request re-prefilled in small chunks must not be split by the room left and retracted again
    forever while the decode that blocks it never runs (found by a reviewer with --disable-mixed-chunk)."""
    engine = Engine(
        EngineOptions(
            model=str(random_models["llama"]),
            dtype="float32",
            device="cpu",
            max_total_tokens=90,
            chunked_prefill_size=4,
            enable_mixed_chunk=mixed,
            max_running_requests=8,
        )
    )
    rng = random.Random(11)
    rows = [
        {
            "id": str(i),
            "prompt_token_ids": [0] + [rng.randrange(2, 300) for _ in range(24)],
            "max_new_tokens": 40,
            "ignore_eos": True,
            "temperature": 0.7,
            "seed": i,
        }
        for i in range(5)
    ]
    enqueue_rows(engine, rows, tmp_path / "p.jsonl")
    finished = []
    for _ in range(2000):
        if not engine.has_work():
            break
        finished += engine.step()
    assert len(finished) == 5, "the scheduler stopped making progress"
    assert all(len(r.output_ids) == 40 for r in finished)
    assert engine.kv_cache.available() == 90
