"""vLLM's ``truncate_prompt_tokens``: a row runs only its prompt's last N tokens (-1: the last that fit the context).
The reference is HF transformers' float32 greedy ``generate`` on those last tokens, cut by the test itself."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from tests.helpers.cli import generate, read_rows, run_args, run_cli, write_jsonl
from tests.helpers.hf_greedy import hf_model

CONTEXT = 256  # the random models' max_position_embeddings (tests/helpers/models.py)
PROMPT = "Once upon a time there was a little girl who lived in a village near the forest."


def _hf_greedy(model_dir: Path, ids: list[int], new: int) -> list[int]:
    out = hf_model(model_dir).generate(
        torch.tensor([ids]),
        max_new_tokens=new,
        do_sample=False,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    return out[0, len(ids) :].tolist()


def test_a_row_runs_its_prompts_last_tokens(random_models: dict[str, Path], tmp_path: Path) -> None:
    model = random_models["llama"]
    ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    long_ids = [ids[0], *([7, 11, 13] * 100)]  # 301 tokens: past the context
    rows = [
        {"id": "cut", "prompt": PROMPT, "truncate_prompt_tokens": 6, "prompt_logprobs": True},
        {"id": "whole", "prompt": PROMPT, "truncate_prompt_tokens": len(ids) + 5},
        {"id": "fit", "prompt_token_ids": long_ids, "truncate_prompt_tokens": -1, "max_new_tokens": 1},
        {"id": "long", "prompt_token_ids": long_ids, "max_new_tokens": 1},
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    greedy = ("--max-new-tokens", "6", "--temperature", "0")
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", model, *greedy, "--on-error", "skip"))
    assert code == 0, output
    out = read_rows(tmp_path / "o.arrow")
    assert out["cut"]["prompt_tokens"] == 6 and len(out["cut"]["prompt_logprobs"]) == 5  # the first has none
    assert out["cut"]["output_token_ids"] == _hf_greedy(model, ids[-6:], 6)
    assert out["whole"]["prompt_tokens"] == len(ids) and out["whole"]["output_token_ids"] == _hf_greedy(model, ids, 6)
    assert out["fit"]["prompt_tokens"] == CONTEXT - 1
    assert out["fit"]["output_token_ids"] == _hf_greedy(model, long_ids[-(CONTEXT - 1) :], 1)
    assert out["long"]["error"].endswith(
        "field 'prompt_token_ids': prompt has 301 tokens, >= context length 256 (truncate_prompt_tokens -1 keeps the "
        "last that fit)"
    )
    # The run's default, as a flag; a row's own value wins.
    flagged = generate(dataset, tmp_path / "f.arrow", model, *greedy, "--truncate-prompt-tokens", "4")
    assert [flagged[key]["prompt_tokens"] for key in ("cut", "whole", "fit", "long")] == [6, len(ids), CONTEXT - 1, 4]


def test_a_bad_value_or_a_scored_continuation_is_a_row_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    rows = [
        {"id": "zero", "prompt": "x", "truncate_prompt_tokens": 0},
        {"id": "text", "prompt": "x", "truncate_prompt_tokens": "5"},
        {"id": "scored", "prompt": "Once upon", "continuation": " a time", "truncate_prompt_tokens": 2},
        {"id": "ok", "prompt": "x", "max_new_tokens": 1},
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", random_models["llama"], "--on-error", "skip"))
    assert code == 0, output
    errors = {key: row["error"] for key, row in read_rows(tmp_path / "o.arrow").items()}
    assert errors["zero"].endswith(":1: field 'truncate_prompt_tokens': must be >= 1 or -1, got 0")
    assert errors["text"].endswith(":2: field 'truncate_prompt_tokens': must be an integer or null, got \"5\"")
    assert errors["scored"].endswith(
        ":3: field 'truncate_prompt_tokens': a row that scores a continuation cannot truncate its prompt"
    )
    assert errors["ok"] is None
    # The run's default leaves a scored row whole (a helper: --truncate-prompt-tokens failed every such row).
    rows = [rows[2] | {"truncate_prompt_tokens": None}, rows[3]]
    dataset = write_jsonl(tmp_path / "q.jsonl", rows)
    flag = ("--truncate-prompt-tokens", "1")
    out = generate(dataset, tmp_path / "q.arrow", random_models["llama"], *flag)
    assert out["scored"]["error"] is None and out["scored"]["prompt_tokens"] > 2
    assert out["ok"]["prompt_tokens"] == 1
