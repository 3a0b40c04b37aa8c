"""Top logprobs in a fixed order (by value, equal values by token id), so that a greedy row's chosen token, the
lowest id among equal maxima as ``torch.argmax`` picks it, heads its own top list even on exact ties (common in
bfloat16)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from batchgen.sampling.top_logprobs import top_k_by_value_then_id
from tests.helpers.cli import generate, write_jsonl


def _by_hand(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


@pytest.mark.parametrize("vocab", [1, 5, 16, 40])
def test_equal_values_come_in_id_order(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    # Few distinct values, so that most rows have ties, some longer than the 8-candidate window.
    values = torch.randint(0, 3, (30, vocab), generator=gen).float()
    values[0] = 1.0  # one long run of equal values
    for k in sorted({1, 2, min(3, vocab), vocab}):
        top, ids = top_k_by_value_then_id(values, k)
        for r in range(values.shape[0]):
            expected = _by_hand(values[r].tolist(), k)
            assert ids[r].tolist() == expected, (r, k)
            assert top[r].tolist() == values[r, expected].tolist()


def test_greedy_token_heads_its_top_logprobs_in_bfloat16(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [
        {
            "id": f"r{n}",
            "prompt_token_ids": [0] + [(7 * n + 5 * j) % 300 + 2 for j in range(n)],
            "max_new_tokens": 24,
            "temperature": 0,
            "top_logprobs": 3,
            "ignore_eos": True,
        }
        for n in (3, 17, 40)
    ]
    out = generate(
        write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "o.arrow", random_models["llama"], "--dtype", "bfloat16"
    )
    for row in out.values():
        for token, logprob, top in zip(row["output_token_ids"], row["output_logprobs"], row["top_logprobs"]):
            assert top[0]["id"] == token and top[0]["logprob"] == logprob


def test_processed_top_logprobs_leave_out_impossible_tokens(random_models: dict[str, Path], tmp_path: Path) -> None:
    """Under ``--logprobs-mode processed`` with top_k 2, only two tokens have a nonzero probability at a step: the
    top list holds those two (their processed logprobs sum to probability 1), not four with -inf fillers, which
    the JSONL output could not carry (JSON has no infinity)."""
    rows = [
        {"id": "k2", "prompt_token_ids": [0, 5, 9, 14], "max_new_tokens": 6, "temperature": 1.0, "top_k": 2},
        {"id": "k9", "prompt_token_ids": [0, 5, 9, 14], "max_new_tokens": 6, "temperature": 1.0, "top_k": 9},
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", [r | {"top_logprobs": 4, "seed": 1} for r in rows])
    out_path = tmp_path / "o.jsonl"
    generate(dataset, out_path, random_models["llama"], "--logprobs-mode", "processed")

    def no_constants(name: str) -> None:
        raise AssertionError(f"not JSON: {name}")

    lines = [json.loads(line, parse_constant=no_constants) for line in out_path.read_text().splitlines()]
    out = {row["id"]: row for row in lines}
    for top in out["k2"]["top_logprobs"]:
        assert len(top) == 2
        assert math.isclose(sum(math.exp(t["logprob"]) for t in top), 1.0, rel_tol=1e-5)
    assert all(len(top) == 4 for top in out["k9"]["top_logprobs"])
