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
from batchgen.loop.kv_pool import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from batchgen.loop.options import EngineOptions
from tests.helpers.engine import UNMATCHED_STOP, enqueue_rows


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


def test_a_request_table_too_large_to_allocate_is_one_line_naming_its_flag() -> None:
    # (2**40 + 1) rows x 64 positions x 8 bytes: just over 2**49 bytes, 512 TiB.
    with pytest.raises(BatchgenError) as info:
        ReqToTokenPool(2**40, 64, torch.device("cpu"))
    assert str(info.value).startswith(
        f"cannot allocate the table of {2**40} running requests of up to 64 tokens (524288.0 GiB on cpu); ask for "
        "fewer: a lower --max-running-requests"
    )


def test_forward_mode_predicates() -> None:
    assert ForwardMode.EXTEND.is_extend() and ForwardMode.MIXED.is_extend() and ForwardMode.DRAFT_EXTEND.is_extend()
    assert not ForwardMode.DECODE.is_extend() and ForwardMode.DECODE.is_decode()
    assert ForwardMode.TARGET_VERIFY.is_target_verify() and not ForwardMode.DECODE.is_target_verify()


def _engine_with_requests(
    model_dir: Path, tmp_path: Path, stops: bool, shared: int, **options: object
) -> tuple[Engine, int]:
    engine = Engine(EngineOptions(model=str(model_dir), dtype="float32", device="cpu", **options))  # type: ignore[arg-type]
    rng = random.Random(3)
    head = [0] + [rng.randrange(2, 300) for _ in range(shared)]
    rows = [
        {
            "id": str(i),
            "prompt_token_ids": head + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 60 - shared))],
            "max_new_tokens": rng.randrange(1, 20),
            "temperature": 0,
            "ignore_eos": True,
        }
        | ({"stop": [UNMATCHED_STOP]} if stops else {})
        for i in range(24)
    ]
    enqueue_rows(engine, rows, tmp_path / "p.jsonl")
    return engine, len(rows)


@pytest.mark.parametrize(
    ("stops", "shared"),
    [(True, 0), (False, 0), (False, 40)],
    ids=["may-stop-early", "runs-to-length", "runs-to-length-shared-prefix"],
)
def test_every_kv_slot_is_free_after_a_run_in_a_tight_pool(
    stops: bool, shared: int, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """24 rows through a 120-slot pool. Rows with a stop string may end early as far as the scheduler knows: it
    keeps room for part of their growth only (``new_token_ratio``), so it admits more than the pool later holds
    and retracts. Rows that nothing can stop early grow by exactly their remaining tokens: admitted only where
    that growth fits (less what the ones that finish first give back), they are never retracted, also where they
    share a 41-token prefix. Either way every row gets all its tokens and every slot and request row is free at the
    end."""
    engine, num_rows = _engine_with_requests(
        random_models["llama"],
        tmp_path,
        stops,
        shared,
        max_total_tokens=120,
        chunked_prefill_size=16,
        max_running_requests=8,
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
    assert (engine.scheduler.num_retracted > 0) == stops
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


def _simulated_peak(requests: list[tuple[int, int]]) -> int:
    """Round by round: a request that has taken its ``a`` slots finishes and gives back ``freed``; every other
    takes one more slot. The most slots taken beyond the start, at the end of any round."""
    grown = [0] * len(requests)
    done = [False] * len(requests)
    extra = peak = 0
    while not all(done):
        for i, (a, freed) in enumerate(requests):
            if not done[i] and grown[i] == a:
                done[i] = True
                extra -= freed
        for i in range(len(requests)):
            if not done[i]:
                grown[i] += 1
                extra += 1
        peak = max(peak, extra)
    return peak


def test_peak_growth_is_the_most_slots_taken_in_any_round() -> None:
    from batchgen.loop.prefill_adder import peak_growth

    # By hand: two rows of 3 tokens left that free nothing: 6. One row ending after 1 token frees 51, more than
    # the other's 10 tokens ever take: the peak is the first round's 2. Rows that keep what they took: their sum.
    assert peak_growth([(3, 0), (3, 0)]) == 6
    assert peak_growth([(1, 51), (10, 10)]) == 2
    assert peak_growth([(2, 12), (5, 15)]) == 4
    assert peak_growth([(2, 0), (5, 0)]) == 7
    assert peak_growth([]) == 0
    rng = random.Random(0)
    for _ in range(300):
        requests = []
        for _ in range(rng.randrange(1, 9)):
            a = rng.randrange(0, 12)
            requests.append((a, rng.choice([0, a + rng.randrange(0, 30)])))
        assert peak_growth(requests) == _simulated_peak(requests), requests


def test_rows_of_a_known_length_sharing_prefixes_are_never_retracted() -> None:
    """The scheduler alone (every sampled token 7, no model) over 150 small jobs of rows that always run to their
    length, most sharing a prompt prefix, each in a pool barely larger than its longest row. A row whose cached
    prompt later rows matched keeps those slots held when it ends; counting them as given back (a case a reviewer
    found) admits rows into room that is not there, and one is retracted."""
    from batchgen.loop.kv_cache import KVCache
    from batchgen.loop.kv_pool import ReqToTokenPool
    from batchgen.loop.radix_cache import RadixCache
    from batchgen.loop.req import Req
    from batchgen.loop.scheduler import Scheduler, SchedulerOptions
    from batchgen.sampling.sampler import SampleOutput
    from batchgen.sampling.sampling_params import SamplingParams

    rng = random.Random(0)
    for _ in range(150):
        shared = [rng.randrange(10, 300) for _ in range(rng.randrange(1, 40))]
        rows = [
            (shared + [rng.randrange(10, 300) for _ in range(rng.randrange(1, 12))], rng.randrange(1, 30))
            for _ in range(rng.randrange(2, 10))
        ]
        pool = max(len(prompt) + new for prompt, new in rows) + rng.randrange(0, 80)
        allocator = KVSlotAllocator(pool)
        kv_cache = KVCache(ReqToTokenPool(8, 512, torch.device("cpu")), allocator, RadixCache(allocator))
        scheduler = Scheduler(SchedulerOptions(8, 10**6, 16), kv_cache, None)
        for i, (prompt, new) in enumerate(rows):
            params = SamplingParams(max_new_tokens=new, ignore_eos=True, logprobs=False)
            scheduler.add(Req(str(i), prompt, params, 0, frozenset(), 512))
        finished = 0
        while scheduler.has_work():
            batch = scheduler.next_batch()
            assert batch is not None, scheduler.stuck_message()
            batch.prepare(kv_cache, 400, torch.device("cpu"))
            tokens = torch.full((len(batch.sampled),), 7, dtype=torch.int64)
            finished += len(scheduler.process_result(batch, SampleOutput(tokens, None, None, None)))
        assert finished == len(rows)
        assert scheduler.num_retracted == 0, (pool, [(len(p), n) for p, n in rows])
        assert kv_cache.available() == pool


def test_a_rows_samples_as_groups_keep_their_indices_and_seeds() -> None:
    """n = 5 with 2 requests running at once: sample 0 forks sample 1, a request for sample 2 forks 3, and one for
    sample 4 runs alone; each sample's seed is the documented BLAKE2b-64("seed:i") >> 1 of the row's seed."""
    import hashlib

    from batchgen.loop.req import Req
    from batchgen.sampling.sampling_params import SamplingParams

    def seed_of(index: int) -> int:
        digest = hashlib.blake2b(f"77:{index}".encode(), digest_size=8).digest()
        return 77 if index == 0 else int.from_bytes(digest, "little") >> 1

    req = Req("r", [1, 2, 3], SamplingParams(n=5), 77, frozenset(), 64, unforked_samples=4)
    groups = req.sample_groups(2)
    assert [(g.sample_index, g.unforked_samples, g.seed) for g in groups] == [
        (0, 1, seed_of(0)),
        (2, 1, seed_of(2)),
        (4, 0, seed_of(4)),
    ]
    assert [g.fork(g.sample_index + 1, None).seed for g in groups[:2]] == [seed_of(1), seed_of(3)]
    assert req.sample_groups(8) == [req]  # fits: as it was
