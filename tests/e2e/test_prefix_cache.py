"""The prefix cache changes no output: greedy float32 rows equal HF's and the cache-off run's on workloads where
every kind of hit occurs, and sampled, n > 1, structured, prompt-logprob and speculative rows equal the cache-off
run's."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import generate, read_rows, run_args, run_cli, write_jsonl
from tests.helpers.engine import enqueue_rows
from tests.helpers.hf_greedy import MAX_NEW, check_against_hf

CHUNK = 16
rng = random.Random(11)
P1 = [0] + [rng.randrange(2, 300) for _ in range(2 * CHUNK - 1)]  # a prefix of exactly two chunks
P2 = [0] + [rng.randrange(2, 300) for _ in range(40)]


def _tail(n: int) -> list[int]:
    return [rng.randrange(2, 300) for _ in range(n)]


def _greedy(rid: str, ids: list[int]) -> dict[str, Any]:
    return {"id": rid, "prompt_token_ids": ids, "max_new_tokens": MAX_NEW, "temperature": 0, "top_logprobs": 3}


Q1, Q2, Q3, Q4 = _tail(5), _tail(7), _tail(3), _tail(9)
# Phase 1: partial matches (a2 after a1, b2 after b1), a full match of a prompt (dup = a1), a prompt ending inside
# a cached prefix (inside), a prompt that is a prefix of a whole number of chunks (exact).
PHASE1 = [
    _greedy("a1", P1 + Q1),
    _greedy("b1", P2 + Q3),
    _greedy("a2", P1 + Q2),
    _greedy("dup", P1 + Q1),
    _greedy("inside", P1[:20]),
    _greedy("exact", P1),
    _greedy("b2", P2 + Q4),
]


def _engine(model_dir: Path, **options: Any) -> Any:
    from batchgen.loop.engine import Engine
    from batchgen.loop.options import EngineOptions

    return Engine(
        EngineOptions(model=str(model_dir), dtype="float32", device="cpu", chunked_prefill_size=CHUNK, **options)
    )


def _drain(engine: Any, rows: list[dict[str, Any]], path: Path) -> dict[str, dict[str, Any]]:
    from batchgen.job.result_rows import result_row

    enqueue_rows(engine, rows, path)
    done: dict[str, dict[str, Any]] = {}
    while engine.has_work():
        for req in engine.step():
            row = result_row(req, {})
            if row["top_logprobs"] is not None:  # as the output file spells them
                row["top_logprobs"] = [[{"id": i, "logprob": lp} for i, lp in step] for step in row["top_logprobs"]]
            done[req.rid] = row
    return done


def _same(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    """Same tokens; logprobs (and prompt logprobs) within 1e-5."""
    assert got.keys() == want.keys()
    for rid, row in want.items():
        assert got[rid]["output_token_ids"] == row["output_token_ids"], rid
        for key in ("output_logprobs", "prompt_logprobs"):
            if row[key] is not None:
                assert got[rid][key] == pytest.approx(row[key], abs=1e-5), (rid, key)


def test_every_kind_of_hit_equals_hf_and_the_cache_off_run(random_models: dict[str, Path], tmp_path: Path) -> None:
    model = random_models["llama"]
    engine = _engine(model)
    first = _drain(engine, PHASE1, tmp_path / "p1.jsonl")
    # Phase 2, on the same engine: a prompt continuing a1's output, and a row asking for prompt logprobs over a
    # cached prefix (it must compute every position it reports).
    cont = P1 + Q1 + first["a1"]["output_token_ids"][:6] + _tail(4)
    logprob_row = _greedy("logprobs", P2 + Q3 + _tail(2)) | {"prompt_logprobs": 2}
    before = engine.stats.cached_tokens
    second = _drain(engine, [_greedy("cont", cont), logprob_row], tmp_path / "p2.jsonl")
    # cont's hit reaches into a1's output; logprobs hits nothing.
    assert engine.stats.cached_tokens - before == len(P1 + Q1) + 6
    assert engine.stats.cached_tokens >= 2 * len(P1) + len(P2)
    rows = PHASE1 + [_greedy("cont", cont), logprob_row]
    check_against_hf(model, rows, first | second)
    cold = _engine(model, prefix_cache=False)
    reference = _drain(cold, PHASE1, tmp_path / "c1.jsonl") | _drain(
        cold, [_greedy("cont", cont), logprob_row], tmp_path / "c2.jsonl"
    )
    assert cold.stats.cached_tokens == 0
    _same(first | second, reference)
    assert len(second["logprobs"]["prompt_logprobs"]) == len(logprob_row["prompt_token_ids"]) - 1


def test_hits_after_eviction_and_preemption_in_a_tight_pool(
    random_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool of 90 tokens: room for about one prefix group at a time, so prefixes are evicted and recomputed, and
    requests are retracted and then admitted again with a hit on what they had computed; outputs equal HF's and,
    logprobs within 1e-5, the cache-off run's."""
    from batchgen.loop.kv_cache import KVCache
    from batchgen.loop.radix_cache import RadixCache
    from batchgen.loop.scheduler import Scheduler

    events: list[tuple[str, Any, int]] = []  # ("evict", None, freed), ("retract", rid, 0), ("hit", tokens, length)
    evict, match, retract = RadixCache.evict, KVCache.match, Scheduler._retract

    def spy_evict(self: RadixCache, num_tokens: int) -> int:
        events.append(("evict", None, evict(self, num_tokens)))
        return events[-1][2]

    def spy_match(self: KVCache, row: int, tokens: Any) -> int:
        events.append(("hit", list(tokens), match(self, row, tokens)))
        return events[-1][2]

    def spy_retract(self: Scheduler, req: Any) -> None:
        events.append(("retract", req.prompt_ids, len(req.output_ids)))
        retract(self, req)

    monkeypatch.setattr(RadixCache, "evict", spy_evict)
    monkeypatch.setattr(KVCache, "match", spy_match)
    monkeypatch.setattr(Scheduler, "_retract", spy_retract)
    model = random_models["llama"]
    rows = [_greedy(f"r{i}", (P1, P2)[i % 2] + _tail(3 + i % 5)) for i in range(12)]
    engine = _engine(model, max_total_tokens=90, max_running_requests=8)
    got = _drain(engine, rows, tmp_path / "p.jsonl")
    first_eviction = next((i for i, e in enumerate(events) if e[0] == "evict" and e[2] > 0), None)
    assert first_eviction is not None, "the pool was meant to be small enough to evict cached prefixes"
    assert any(kind == "hit" and n > 0 for kind, _, n in events[first_eviction:])
    retracted = [(i, prompt) for i, (kind, prompt, _) in enumerate(events) if kind == "retract"]
    assert retracted, "the pool was meant to be small enough to force preemption"
    # Some retracted request comes back with a hit on its own prompt.
    assert any(
        kind == "hit" and tokens[: len(prompt)] == prompt and n > 0
        for i, prompt in retracted
        for kind, tokens, n in events[i + 1 :]
    )
    assert engine.kv_cache.available() == engine.kv_cache.size  # everything released, the cache all evictable
    check_against_hf(model, rows, got)
    monkeypatch.undo()
    _same(
        got,
        _drain(
            _engine(model, max_total_tokens=90, max_running_requests=8, prefix_cache=False), rows, tmp_path / "c.jsonl"
        ),
    )


def _rows_of_every_kind() -> list[dict[str, Any]]:
    """Sampled (seeded), n > 1 and regex-constrained rows sharing prefixes, as in an evaluation file. The sampled
    rows ignore EOS: the draft-model run's accept lengths are bounded for rows that run to max_new_tokens, and a
    seed's draws (and so an early EOS) differ between CPUs."""
    rows: list[dict[str, Any]] = []
    for i in range(8):
        prefix = (P1, P2)[i % 2]
        rows.append({"id": f"s{i}", "prompt_token_ids": prefix + _tail(4), "seed": i, "max_new_tokens": 12})
    rows.append({"id": "n", "prompt_token_ids": P1 + _tail(3), "n": 3, "seed": 5, "max_new_tokens": 8})
    rows.append({"id": "n2", "prompt_token_ids": P1 + _tail(2), "n": 2, "seed": 6, "max_new_tokens": 8})
    for row in rows:
        row["ignore_eos"] = True
    rows.append({"id": "re", "prompt": "Code:", "regex": r"[a-c]{2,4}-\d{3}", "seed": 3, "max_new_tokens": 24})
    rows.append({"id": "re2", "prompt": "Code: x", "regex": r"[a-c]{2,4}-\d{3}", "seed": 4, "max_new_tokens": 24})
    return rows


def _by_sample(rows: dict[str, dict[str, Any]]) -> dict[tuple[str, int], list[int]]:
    return {(r["id"], r["sample_index"]): r["output_token_ids"] for r in rows.values()}


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--speculative-algorithm", "ngram", "--cuda-graph-max-bs", "8"],
        [
            "--speculative-algorithm",
            "draft",
            "--speculative-draft-model",
            "TARGET",
            "--speculative-acceptance",
            "coupled",
        ],
    ],
    ids=["plain", "ngram-graph-runner", "draft-model"],
)
@pytest.mark.usefixtures("every_draft_verified")
def test_sampled_n_and_structured_rows_are_unchanged(
    extra: list[str], random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Seeded sampled rows, n > 1 samples and regex rows give the same tokens with the cache on and off, also
    under speculative decoding, where verify rounds replayed through the graph runner take the prefix lengths.
    The draft model keeps no cache of its own: it catches up on a cached prefix in its DRAFT_EXTEND round. With
    the target as its own draft every draft is accepted only if the draft K/V of that prefix is right."""
    model = random_models["llama"]
    extra = [str(model) if arg == "TARGET" else arg for arg in extra]
    dataset = write_jsonl(tmp_path / "rows.jsonl", _rows_of_every_kind())
    results = {}
    for cache in ("--prefix-cache", "--no-prefix-cache"):
        out = tmp_path / f"{cache}.arrow"
        args = run_args(dataset, out, model, "--dtype", "float32", "--chunked-prefill-size", str(CHUNK), cache, *extra)
        code, output = run_cli(args)
        assert code == 0, output
        assert ("prefix cache" in output) == (cache == "--prefix-cache"), output
        rows = _all_rows(out)
        results[cache] = {(r["id"], r["sample_index"]): r["output_token_ids"] for r in rows}
        if str(model) in extra and cache == "--prefix-cache":
            # Every draft accepted: 5 tokens (K = 4 drafts + 1) a verify round, but fewer near max_new_tokens;
            # 3.5 is the least that leaves for these lengths (7 tokens after the first in rounds of 5 and 2).
            accepted = [r["spec_accept_length"] for r in rows if r["id"][0] in "sn"]
            assert None not in accepted and min(accepted) >= 3.5, accepted
    assert results["--prefix-cache"] == results["--no-prefix-cache"]
    assert len(results["--prefix-cache"]) == 8 + 3 + 2 + 2


def _all_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.ipc as ipc

    with ipc.open_file(path) as f:
        return f.read_all().to_pylist()


def test_pool_too_small_for_a_prompt_and_its_cached_prefix_finishes(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    """Each prompt fills most of a 64-token pool, its cached prefix the rest: eviction, then preemption, never a
    hang."""
    rows = [_greedy(f"r{i}", P2 + _tail(12 - i)) for i in range(6)]
    got = generate(
        write_jsonl(tmp_path / "p.jsonl", rows),
        tmp_path / "o.arrow",
        random_models["llama"],
        "--max-total-tokens",
        "64",
        "--chunked-prefill-size",
        str(CHUNK),
    )
    check_against_hf(random_models["llama"], rows, got)


def test_summary_reports_the_cached_share(random_models: dict[str, Path], tmp_path: Path) -> None:
    """One request at a time: "a" computes its 42 prompt tokens; "b" (44 tokens) then finds "a"'s prompt and as
    much of "a"'s output as it continues in the cache, and computes the rest."""
    rows = [_greedy("a", P2 + [7]), _greedy("b", P2 + [7, 8, 9])]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    args = run_args(dataset, tmp_path / "o.arrow", random_models["llama"], "--max-running-requests", "1")
    code, output = run_cli(args)
    assert code == 0, output
    a_output = read_rows(tmp_path / "o.arrow")["a"]["output_token_ids"]
    hit = 42 + (a_output[:1] == [8]) * (1 + (a_output[1:2] == [9]))
    hit = min(hit, 43)  # b's last token is always computed
    assert f"prefix cache {100 * hit / (42 + 44):.0f} % of prompt tokens" in output
