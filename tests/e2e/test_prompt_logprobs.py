"""Prompt logprobs equal HF teacher-forced log_softmax, chunk by chunk, also after preemption."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.cli import read_rows, run_args, run_cli, write_jsonl


def test_prompt_logprobs_equal_hf(random_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = random_models["qwen3"]
    rng = random.Random(5)
    rows = []
    for i, n in enumerate([2, 7, 16, 17, 33, 60]):
        rows.append(
            {
                "id": f"p{i}",
                "prompt_token_ids": [0] + [rng.randrange(2, 300) for _ in range(n - 1)],
                "prompt_logprobs": 3 if i % 2 else True,
                "max_new_tokens": 6,
                "temperature": 0,
            }
        )
    # Rows that share p4's prompt: with the prefix cache, prompt logprobs are computed at every position anyway.
    shared = rows[4]["prompt_token_ids"]
    rows.append(rows[4] | {"id": "p6", "prompt_token_ids": shared + [rng.randrange(2, 300) for _ in range(9)]})
    rows.append(rows[3] | {"id": "p7", "prompt_token_ids": shared[:20]})
    rows.append({"id": "plain", "prompt": "no prompt logprobs here", "max_new_tokens": 3})
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Small pools retract requests, which then recompute what they reported; whether a given size retracts depends
    # on the order of admission (the prefix cache's, or first come, first served without it), so a few are run.
    preempted = {True: 0, False: 0}
    for flags in (
        ["--chunked-prefill-size", "16"],
        *(["--chunked-prefill-size", "16", "--max-total-tokens", str(pool)] for pool in (72, 75, 80)),
        ["--chunked-prefill-size", "16", "--max-total-tokens", "90", "--no-prefix-cache"],
    ):
        code, output = run_cli(
            run_args(
                dataset, tmp_path / "o.arrow", model_dir, "--dtype", "float32", "--overwrite", "--no-progress", *flags
            )
        )
        assert code == 0, output
        if "--max-total-tokens" in flags:
            preempted["--no-prefix-cache" not in flags] += " 0 preemptions" not in output
        out = read_rows(tmp_path / "o.arrow")
        assert out["plain"]["prompt_logprobs"] is None and out["plain"]["prompt_top_logprobs"] is None
        for i, row in enumerate(rows[:-1]):
            ids = row["prompt_token_ids"]
            with torch.no_grad():
                reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            got = out[row["id"]]
            expected = [reference[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
            assert len(got["prompt_logprobs"]) == len(ids) - 1
            assert max(abs(a - b) for a, b in zip(got["prompt_logprobs"], expected)) < 1e-4, row["id"]
            if i % 2:
                for p, top in enumerate(got["prompt_top_logprobs"]):
                    values, top_ids = reference[p].topk(3)
                    assert [t["id"] for t in top] == top_ids.tolist()
                    assert max(abs(t["logprob"] - v) for t, v in zip(top, values.tolist())) < 1e-4
            else:
                assert got["prompt_top_logprobs"] is None
    assert preempted[True] and preempted[False], preempted  # the small pools really retracted, cache on and off
