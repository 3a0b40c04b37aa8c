"""``n > 1``: samples fork after one shared prefill, share the prompt's KV, and each equals a seeded ``n = 1`` row."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.io.writer import read_results
from batchgen.loop.engine import Engine
from batchgen.loop.forward_batch import ForwardBatch
from batchgen.loop.options import EngineOptions
from tests.helpers.cli import run_args, run_cli, write_jsonl
from tests.helpers.engine import enqueue_rows

SEED = 1234


def sample_seed(seed: int, index: int) -> int:
    """The documented derivation: sample i > 0 of a row with seed s uses BLAKE2b-64("s:i") >> 1."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little") >> 1


def run_rows(tmp_path: Path, model: Path, rows: list[dict[str, Any]], *extra: str) -> list[dict[str, Any]]:
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.arrow"
    code, output = run_cli(run_args(dataset, out, model, *extra))
    assert code == 0, output
    return read_results(out).to_pylist()


def by_sample(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    keyed = {(r["id"], r["sample_index"]): r for r in rows}
    assert len(keyed) == len(rows), "every (id, sample_index) appears once"
    return keyed


ROW = {"prompt": "Once upon a time", "max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "top_logprobs": 2}


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("--max-running-requests", "6", "--max-total-tokens", "48"),
        ("--max-running-requests", "2"),
        ("--max-running-requests", "2", "--no-prefix-cache"),
    ],
)
def test_each_sample_equals_a_seeded_single_row(
    extra: tuple[str, ...], random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Sample i of an n = 5 row gives the tokens and logprobs of the same row with n = 1 and sample i's seed,
    also with a pool so small that forked samples are retracted and recomputed alone, and with fewer requests
    running at once than the row has samples (they run as groups of 2, 2 and 1, as vLLM runs n as requests of their
    own; found by a vLLM user: a row error before)."""
    model = random_models["llama"]
    forked = by_sample(run_rows(tmp_path, model, [{**ROW, "id": "r", "n": 5, "seed": SEED}], *extra))
    assert sorted(forked) == [("r", i) for i in range(5)]
    singles = [{**ROW, "id": str(i), "seed": sample_seed(SEED, i)} for i in range(5)]
    alone = by_sample(run_rows(tmp_path, model, singles))
    for i in range(5):
        got, want = forked[("r", i)], alone[(str(i), 0)]
        assert got["output_token_ids"] == want["output_token_ids"]
        assert got["output_logprobs"] == pytest.approx(want["output_logprobs"], abs=1e-5)
        assert [[t["id"] for t in step] for step in got["top_logprobs"]] == [
            [t["id"] for t in step] for step in want["top_logprobs"]
        ]
        assert got["text"] == want["text"] and got["prompt_tokens"] == want["prompt_tokens"]
    # Different seeds: the samples are not copies of one another.
    assert len({tuple(r["output_token_ids"]) for r in forked.values()}) > 1


def test_greedy_samples_agree_and_rows_mix(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [
        {"id": "g", "prompt": "the cat", "n": 3, "temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        {"id": "one", "prompt": "a dog", "max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"id": "z", "prompt": "zero", "n": 2, "max_new_tokens": 0},
    ]
    out = by_sample(run_rows(tmp_path, random_models["qwen3"], rows, "--n", "2"))
    assert sorted(out) == [("g", 0), ("g", 1), ("g", 2), ("one", 0), ("one", 1), ("z", 0), ("z", 1)]
    assert len({tuple(out[("g", i)]["output_token_ids"]) for i in range(3)}) == 1
    assert out[("one", 0)]["output_token_ids"] == out[("one", 1)]["output_token_ids"]
    assert [out[("z", i)]["completion_tokens"] for i in range(2)] == [0, 0]
    assert out[("z", 1)]["finish_reason"] == "length" and out[("z", 1)]["text"] == ""


def test_penalties_grammar_and_prompt_logprobs_per_sample(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Each sample keeps its own penalty counts and grammar state; prompt logprobs are repeated per sample."""
    jsonschema = pytest.importorskip("jsonschema", reason='jsonschema checks the outputs (pip install -e ".[dev]")')
    pytest.importorskip("xgrammar", reason='grammars need xgrammar (pip install -e ".[structured]")')
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    base = {"prompt": "hello there", "temperature": 0.9, "max_new_tokens": 24, "prompt_logprobs": 1}
    variants = {
        "pen": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4},
        "json": {"json_schema": schema, "max_new_tokens": 60},
    }
    model = random_models["llama"]
    forked = by_sample(
        run_rows(tmp_path, model, [{**base, **v, "id": k, "n": 3, "seed": SEED} for k, v in variants.items()])
    )
    singles = [
        {**base, **v, "id": f"{k}{i}", "seed": sample_seed(SEED, i)} for k, v in variants.items() for i in range(3)
    ]
    alone = by_sample(run_rows(tmp_path, model, singles))
    for kind in variants:
        for i in range(3):
            got, want = forked[(kind, i)], alone[(f"{kind}{i}", 0)]
            assert got["output_token_ids"] == want["output_token_ids"]
            assert got["prompt_logprobs"] == pytest.approx(want["prompt_logprobs"], abs=1e-5)
            assert len(got["prompt_top_logprobs"]) == got["prompt_tokens"] - 1
    for i in range(3):
        row = forked[("json", i)]
        if row["finish_reason"] == "stop":
            jsonschema.validate(json.loads(row["text"]), schema)


def test_prompt_is_prefilled_once_and_every_slot_is_freed(random_models: dict[str, Path], tmp_path: Path) -> None:
    engine = Engine(
        EngineOptions(
            model=str(random_models["llama"]),
            dtype="float32",
            device="cpu",
            max_total_tokens=400,
            max_running_requests=8,
        )
    )
    rng = random.Random(5)
    prompts = [[0] + [rng.randrange(2, 300) for _ in range(30)] for _ in range(3)]
    rows = [
        {"id": str(k), "prompt_token_ids": p, "n": 3, "max_new_tokens": 10, "ignore_eos": True, "seed": k}
        for k, p in enumerate(prompts)
    ]
    enqueue_rows(engine, rows, tmp_path / "p.jsonl")
    finished = []
    peak_shared = prefill_tokens = 0
    while engine.has_work():
        batch = engine.scheduler.next_batch()
        assert batch is not None
        # Prompt tokens computed, or given by the prefix cache (the prompts share their first token).
        prefill_tokens += sum(batch.extend_lens) - batch.num_decode_rows + batch.cached_tokens
        assert len(engine.scheduler.running) + sum(len(r.fork_rows) for r in engine.scheduler.running) <= 8
        worker = batch.prepare(engine.kv_cache, engine.vocab_size, engine.device)
        logits = engine.runner.forward(ForwardBatch.init_new(worker, engine.runner))
        finished += engine.scheduler.process_result(batch, engine.runner.sample(logits, worker.sampling_info))
        table = engine.runner.req_to_token_pool.req_to_token
        running = engine.scheduler.running
        # Samples of one prompt point at the same slots for the whole prompt.
        for req in running:
            for other in running:
                if other is not req and other.rid == req.rid and req.kv_len and other.kv_len:
                    n = len(req.prompt_ids)
                    assert req.req_pool_idx is not None and other.req_pool_idx is not None
                    assert torch.equal(table[req.req_pool_idx, :n], table[other.req_pool_idx, :n])
                    peak_shared += 1
    assert peak_shared > 0
    assert sorted((r.rid, r.sample_index) for r in finished) == [(str(k), i) for k in range(3) for i in range(3)]
    assert engine.scheduler.num_retracted == 0
    assert prefill_tokens == sum(len(p) for p in prompts)  # each prompt once, not n times
    assert engine.kv_cache.available() == 400
    assert engine.runner.req_to_token_pool.available() == 8


def test_n_out_of_range_is_a_row_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "n": 0}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.jsonl", random_models["llama"]))
    assert code == 3 and "field 'n': must be in [1, 1024], got 0" in output


@pytest.mark.parametrize(
    ("prompts", "chunk"),
    [([list(range(2, 11)), list(range(20, 26))], "16"), ([list(range(30, 36))], "3")],
)
def test_last_prefill_chunk_of_one_token_forks_samples(
    prompts: list[list[int]], chunk: str, random_models: dict[str, Path], tmp_path: Path
) -> None:
    """A prompt whose last chunk is one token (the rest of a shared prefill budget, or k·chunk + 1 tokens) is
    still prefilling in that round, not decoding: its samples fork there (found by a reviewer: it crashed)."""
    rows = [
        {"id": str(i), "prompt_token_ids": [0, *p], "n": 1 + i % 2 + (len(prompts) == 1), "ignore_eos": True}
        for i, p in enumerate(prompts)
    ]
    out = by_sample(
        run_rows(tmp_path, random_models["llama"], rows, "--max-new-tokens", "4", "--chunked-prefill-size", chunk)
    )
    assert sorted(out) == sorted((r["id"], i) for r in rows for i in range(r["n"]))
    assert all(r["completion_tokens"] == 4 for r in out.values())
