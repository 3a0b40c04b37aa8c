"""Tight pools where the cache-on run must finish wherever the cache-off run of the same rows and pool does, and
what the summary's cached share counts (found by a hostile review of issue 20).

A request can compute tokens the tree already holds (side by side with another request, or as a row asking for
prompt logprobs, which takes no match). ``KVCache.cache`` then switches the row to the tree's slots and frees its
own copies; had it kept both, the pool would hold those tokens twice until the request ends, the locked copy
neither usable nor evictable, and a request that fits the pool alone (the context length is capped at the pool)
would no longer fit.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.engine import UNMATCHED_STOP, enqueue_rows

rng = random.Random(1)
P6 = [0] + [rng.randrange(2, 390) for _ in range(5)]
TAIL9 = [rng.randrange(2, 390) for _ in range(9)]
P24 = [0] + [rng.randrange(2, 390) for _ in range(23)]
TAIL11 = [rng.randrange(2, 390) for _ in range(11)]
# Generous for these few short rows: a run that has not finished by then makes no progress.
MAX_STEPS = 500


def _engine(model_dir: Path, **options: Any) -> Any:
    from batchgen.loop.engine import Engine
    from batchgen.loop.options import EngineOptions

    return Engine(EngineOptions(model=str(model_dir), dtype="float32", device="cpu", **options))


def _run(engine: Any, rows: list[dict[str, Any]], path: Path) -> dict[str, list[int]]:
    """Every row's output tokens; fails if the engine still has work after ``MAX_STEPS`` rounds (a hang)."""
    enqueue_rows(engine, rows, path)
    done: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            return done
        done |= {req.rid: req.output_ids for req in engine.step()}
    pytest.fail(f"no progress after {MAX_STEPS} rounds: finished {sorted(done)} of {len(rows)} rows")


def _greedy(rid: str, ids: list[int], max_new_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "prompt_token_ids": ids, "max_new_tokens": max_new_tokens, "temperature": 0} | fields


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
def test_short_shared_prefix_computed_side_by_side_then_alone_in_a_tight_pool(
    cache: bool, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Rows a and b share 6 prompt tokens (under the 32 that make one wait for the other), so both are admitted in
    one round and compute them side by side. "b" needs 15 + 13 = 28 of the 29 slots. After "a" finishes, "b" runs
    alone, yet the tree keeps "a"'s copy of the 6 tokens locked on "b"'s path while "b" reads its own copy: 6 slots
    would be lost and the cache-on run would die with "KV pool exhausted" (the cache-off run finishes)."""
    rows = [
        _greedy("a", P6, 2, ignore_eos=True),
        _greedy("b", P6 + TAIL9, 13, ignore_eos=True),
    ]
    engine = _engine(random_models["llama"], max_total_tokens=29, prefix_cache=cache)
    done = _run(engine, rows, tmp_path / "rows.jsonl")
    assert {rid: len(ids) for rid, ids in done.items()} == {"a": 2, "b": 13}


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
def test_prompt_logprobs_row_over_a_cached_prefix_in_a_tight_pool(
    cache: bool, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Row x leaves its 24-token prompt in the tree. "y" starts with the same 24 tokens but asks for prompt
    logprobs, so it takes no match and prefills all 35 prompt tokens itself, in chunks of 8. After each chunk
    ``KVCache.cache`` locks the tree's copy of what it computed: after three chunks the pool (56) holds the 24
    tokens twice (48 slots) unless "y" switches to the tree's copy: its last 11 prompt tokens would not fit in the 8
    left, nothing would be evictable or retractable, and no round could be made. "y" alone needs 35 + 15 = 50
    slots; the cache-off run finishes."""
    rows = [
        _greedy("x", P24, 1),
        _greedy("y", P24 + TAIL11, 15, ignore_eos=True, prompt_logprobs=1),
    ]
    engine = _engine(
        random_models["llama"], max_total_tokens=56, chunked_prefill_size=8, max_running_requests=1, prefix_cache=cache
    )
    done = _run(engine, rows, tmp_path / "rows.jsonl")
    assert {rid: len(ids) for rid, ids in done.items()} == {"x": 1, "y": 15}


def test_a_request_running_alone_can_use_every_slot_it_does_not_hold(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    """The invariant behind both tests above, in a roomy pool: once "a" has finished, "b" is the only request, so
    every slot but the ``kv_len`` it holds is free or evictable (``KVCache.available``); a tree copy of the 6
    shared tokens locked for "b" while it read its own would leave it 6 slots short."""
    engine = _engine(random_models["llama"], max_total_tokens=512)
    enqueue_rows(
        engine,
        [_greedy("a", P6, 2, ignore_eos=True), _greedy("b", P6 + TAIL9, 13, ignore_eos=True)],
        tmp_path / "r.jsonl",
    )
    checked = 0
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        engine.step()
        running = engine.scheduler.running
        if len(running) == 1 and running[0].rid == "b" and running[0].kv_len:
            assert engine.kv_cache.available() == engine.kv_cache.size - running[0].kv_len
            checked += 1
    assert checked > 0


def test_summary_share_counts_no_recomputed_outputs_as_prompt_tokens(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    """16 prompts that share no token (each starts with its own id) cannot give each other a single prompt token,
    so "prefix cache N % of prompt tokens" must say 0 %. A 200-token pool retracts requests that have 60 outputs
    to grow (their stop string makes the scheduler estimate that growth); each comes back with a hit on its own
    prompt and outputs, which the share must not count: it is of the prompt tokens of requests admitted for the
    first time.
    """
    from tests.helpers.cli import run_args, run_cli, write_jsonl

    local = random.Random(4)
    rows = [
        _greedy(
            f"r{i}", [10 + i, *[local.randrange(2, 390) for _ in range(7)]], 60, ignore_eos=True, stop=[UNMATCHED_STOP]
        )
        for i in range(16)
    ]
    dataset = write_jsonl(tmp_path / "rows.jsonl", rows)
    args = run_args(dataset, tmp_path / "out.arrow", random_models["llama"], "--max-total-tokens", "200")
    code, output = run_cli(args)
    assert code == 0, output
    assert " preemptions" in output and " 0 preemptions" not in output, output  # the pool did retract
    assert "prefix cache 0 % of prompt tokens" in output, output
