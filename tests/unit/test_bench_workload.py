"""The benchmark's generated shared-prefix workload and its prefix-cache figure (no model needed)."""

from __future__ import annotations

import random

import pytest

from batchgen.bench.offline import ThroughputResult
from batchgen.bench.workload import random_workload, shared_prefix_workload


def test_prompt_i_is_prefix_i_mod_n_and_a_question_of_a_length_in_range() -> None:
    workload = shared_prefix_workload(10, 3, 7, 2, 5, 4, vocab_size=50, seed=1)
    assert len(workload.prompts) == 10 and workload.output_len == 4
    prefixes = [workload.prompts[g][:7] for g in range(3)]
    assert len({tuple(p) for p in prefixes}) == 3  # three different prefixes (7 random ids of 50 each)
    for i, prompt in enumerate(workload.prompts):
        assert prompt[:7] == prefixes[i % 3], i
        assert 2 <= len(prompt) - 7 <= 5, i
        assert all(0 <= t < 50 for t in prompt)
    assert workload.input_tokens == sum(len(p) for p in workload.prompts)
    lengths = {len(p) - 7 for p in shared_prefix_workload(200, 3, 7, 2, 5, 4, vocab_size=50, seed=1).prompts}
    assert lengths == {2, 3, 4, 5}  # uniform over the whole range, both ends included


def test_the_documented_draw_order_by_hand() -> None:
    """Seed 3, 2 prefixes of 4 tokens, questions of 1-3 tokens, vocabulary 10: Python's ``random.Random(3)``
    draws the 8 prefix ids first, then per prompt a length and that many ids (the generator's docstring)."""
    rng = random.Random(3)
    prefix_ids = [rng.randrange(10) for _ in range(8)]
    expected = []
    for i in range(5):
        length = rng.randint(1, 3)
        expected.append(prefix_ids[4 * (i % 2) : 4 * (i % 2) + 4] + [rng.randrange(10) for _ in range(length)])
    assert shared_prefix_workload(5, 2, 4, 1, 3, 8, vocab_size=10, seed=3).prompts == expected
    # Same seed, same prompts; another seed, others.
    assert shared_prefix_workload(5, 2, 4, 1, 3, 8, vocab_size=10, seed=3).prompts == expected
    assert shared_prefix_workload(5, 2, 4, 1, 3, 8, vocab_size=10, seed=4).prompts != expected


def test_random_workload_kept_its_draws() -> None:
    """The random workload's prompts did not change with the shared helper: seed 0, lengths 2-4, vocabulary 7,
    per prompt ``randint`` then the ids (a plain workload) or the motif length and the motif (a repetitive one)."""
    rng = random.Random(0)
    plain = []
    for _ in range(4):
        length = rng.randint(2, 4)
        plain.append([rng.randrange(7) for _ in range(length)])
    assert random_workload(4, 2, 4, 1, vocab_size=7, seed=0).prompts == plain
    rng = random.Random(0)
    repetitive = []
    for _ in range(4):
        length = rng.randint(20, 30)
        motif = [rng.randrange(7) for _ in range(rng.randint(4, 16))]
        repetitive.append((motif * 30)[:length])
    assert random_workload(4, 20, 30, 1, vocab_size=7, seed=0, repetitive=True).prompts == repetitive


@pytest.mark.parametrize(("share", "suffix"), [(0.914, " | prefix cache 91 % of prompt tokens"), (None, "")])
def test_the_result_line_and_record_carry_the_prefix_cache_share(share: float | None, suffix: str) -> None:
    result = ThroughputResult("batchgen", 4, 100, 8, 2.0, share)
    assert result.line() == (
        "        batchgen:    2.00 req/s | input     50.0 tok/s | output      4.0 tok/s | total     54.0 tok/s | "
        "   2.00 s" + suffix
    )
    assert result.as_dict()["prefix_cache_share"] == share
