"""Greedy tokens and raw logprobs equal HF transformers (fp32, each prompt alone) for every architecture,
with chunked prefill, a KV pool small enough to force preemption, and one request at a time."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import generate, run_args, write_jsonl
from tests.helpers.hf_greedy import check_against_hf, greedy_prompts


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3"])
def test_greedy_equals_hf_with_chunking_and_preemption(
    arch: str, random_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = random_models[arch]
    rows = greedy_prompts(vocab=300)
    dataset = write_jsonl(tmp_path / "prompts.jsonl", rows)
    from tests.helpers.cli import run_cli

    code, output = run_cli(
        run_args(
            dataset,
            tmp_path / "a.arrow",
            model_dir,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--no-progress",
            "--chunked-prefill-size",
            "16",
            "--max-total-tokens",
            "150",
            "--max-running-requests",
            "16",
            # In arrival order this pool forces a preemption; tests/e2e/test_prefix_cache.py preempts with the cache.
            "--no-prefix-cache",
        )
    )
    assert code == 0, output
    preemptions = int(re.search(r"(\d+) preemptions?\b", output).group(1))  # type: ignore[union-attr]
    assert preemptions > 0, "the KV pool was meant to be small enough to force preemption"
    from tests.helpers.cli import read_rows

    check_against_hf(model_dir, rows, read_rows(tmp_path / "a.arrow"))
    one_at_a_time = generate(dataset, tmp_path / "b.arrow", model_dir, "--max-running-requests", "1")
    check_against_hf(model_dir, rows, one_at_a_time)


def test_seeded_sampling_is_independent_of_batching_and_preemption(
    random_models: dict[str, Path], tmp_path: Path
) -> None:
    rows = [
        {
            "id": f"r{i}",
            "prompt_token_ids": [0] + list(range(2 + i, 2 + i + 3 * i + 1)),
            "max_new_tokens": 12,
            "temperature": 1.0,
            "top_p": 0.9,
            "seed": i,
            "ignore_eos": True,
        }
        for i in range(12)
    ]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    model = random_models["qwen2"]
    alone = generate(dataset, tmp_path / "a.arrow", model, "--max-running-requests", "1")
    squeezed = generate(dataset, tmp_path / "b.arrow", model, "--max-total-tokens", "60", "--chunked-prefill-size", "8")
    for row in rows:
        assert alone[row["id"]]["output_token_ids"] == squeezed[row["id"]]["output_token_ids"]
        assert len(alone[row["id"]]["output_token_ids"]) == 12
    # Different seeds really give different samples (the test would be vacuous otherwise).
    assert len({tuple(r["output_token_ids"]) for r in alone.values()}) > 6


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        # YaRN's frequencies and its attention factor on cos and sin (here all 256 positions fit in 4 x 16).
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        # transformers changes dynamic's table only past max_position_embeddings, where batchgen's context stops.
        {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
        {"tie_word_embeddings": True},
        # Only SmolLM3's modules read it (found by a review: batchgen left RoPE out of a Llama's second layer).
        {"no_rope_layers": [1, 0]},
    ],
    ids=["llama3-rope", "linear-rope", "yarn-rope", "dynamic-rope", "tied-embeddings", "foreign-no-rope-layers"],
)
def test_llama_variants_equal_hf(overrides: dict[str, Any], tmp_path: Path) -> None:
    from tests.helpers.models import build_random_model

    model_dir = build_random_model(tmp_path / "model", "llama", seed=1, **overrides)
    rows = greedy_prompts(vocab=300)[::3]
    dataset = write_jsonl(tmp_path / "prompts.jsonl", rows)
    check_against_hf(
        model_dir, rows, generate(dataset, tmp_path / "out.arrow", model_dir, "--chunked-prefill-size", "16")
    )


def test_unsupported_architecture_is_one_line_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    import json
    import shutil

    from tests.helpers.cli import run_cli

    model_dir = tmp_path / "model"
    shutil.copytree(random_models["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", model_dir))
    assert code == 2
    assert (
        "unsupported model architecture ['GPT2LMHeadModel']; supported: LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, SmolLM3ForCausalLM" in output
    )
    assert "Traceback" not in output


def test_another_rope_type_is_one_line_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    message = (
        "unsupported rope_scaling type 'proportional'; supported: default, linear, llama3, yarn, dynamic, longrope"
    )
    _check_refused(random_models, {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, message, tmp_path)


def test_a_config_transformers_refuses_is_one_line_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    # transformers' Phi3Config takes only longrope scaling; its check's error wraps the reason (found by a helper:
    # a traceback).
    message = (
        "cannot load the config or tokenizer: `rope_parameters`'s type field must be one of ['longrope'], got dynamic"
    )
    _check_refused(random_models, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, message, tmp_path, "phi3")


def test_a_short_no_rope_layers_list_is_one_line_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    # transformers fails at the first layer the list lacks; batchgen failed at the first round (found by a review).
    _check_refused(
        random_models, {"no_rope_layers": [1]}, "no_rope_layers has 1 entries for 2 layers", tmp_path, "smollm3"
    )


def test_rope_on_part_of_each_head_is_one_line_error(random_models: dict[str, Path], tmp_path: Path) -> None:
    # Phi-4-mini's RoPE turns the first 3/4 of each head only (transformers' rotate_half on cos.shape[-1] dims).
    config = {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.75}}
    _check_refused(random_models, config, "unsupported partial_rotary_factor 0.75: RoPE on part of each head", tmp_path)


def _check_refused(
    random_models: dict[str, Path], changes: dict[str, Any], message: str, tmp_path: Path, arch: str = "llama"
) -> None:
    """The ``arch`` test model with ``changes`` in its config.json: a run exits 2 with ``message``, no traceback."""
    import json
    import shutil

    from tests.helpers.cli import run_cli

    model_dir = tmp_path / "model"
    shutil.copytree(random_models[arch], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    code, output = run_cli(run_args(dataset, tmp_path / "o.arrow", model_dir))
    assert code == 2
    assert message in output
    assert "Traceback" not in output


def test_yarn_reaches_its_original_positions_times_its_factor(tmp_path: Path) -> None:
    """Qwen3's long-context setting keeps max_position_embeddings (40,960) and asks YaRN for 4 x 32,768 (found by a
    helper: batchgen stopped at 40,960). Here 48 positions and 2 x 40: rows of up to 73 tokens equal HF's, and the
    context stops at 80 (vLLM's rule)."""
    from tests.helpers.cli import run_cli
    from tests.helpers.models import build_random_model

    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 40}
    model_dir = build_random_model(tmp_path / "m", "qwen3", seed=1, max_position_embeddings=48, rope_scaling=yarn)
    rows = greedy_prompts(vocab=300)
    dataset = write_jsonl(tmp_path / "prompts.jsonl", rows)
    check_against_hf(model_dir, rows, generate(dataset, tmp_path / "out.arrow", model_dir))
    code, output = run_cli(run_args(dataset, tmp_path / "b.arrow", model_dir, "--context-length", "81"))
    assert code == 2 and "--context-length 81 exceeds the model's 80 positions" in output, output


@pytest.mark.parametrize("arch", ["phi3", "llama"])
def test_longrope_caps_the_context_where_its_short_factors_hold(arch: str, tmp_path: Path) -> None:
    """Phi-3's 128k models: transformers turns a whole batch to longrope's long factors once a position passes
    original_max_position_embeddings, so batchgen's one table (the short factors, the attention factor) holds up to
    there: the context stops at it, with a note, and rows inside it equal HF's (which runs them on the short ones).
    The length given at the config's top level wins over rope_scaling's, as in transformers, for a Llama too (found
    by a review: a Llama's context was not capped, and rows past 80 tokens differed)."""
    from tests.helpers.models import build_random_model

    model_dir = build_random_model(tmp_path / "m", arch, seed=1)
    # As a hub config.json of Phi-3-mini-128k has them: the length at the top level, rope_scaling without it.
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    factors = {"short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [4.0 + i for i in range(8)]}
    config |= {"original_max_position_embeddings": 80, "rope_scaling": {"type": "longrope", **factors}}
    (model_dir / "config.json").write_text(json.dumps(config))
    note, refusal = _capped_at_80(model_dir, tmp_path)
    assert "the model's context length set to 80: its longrope RoPE holds 80 positions" in note
    assert refusal.startswith("batchgen: error: --context-length 100 exceeds the model's 80 positions (its longrope")


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("mistral", {"sliding_window": 80}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 80, "max_window_layers": 1}),
        ("phi3", {"sliding_window": 80}),
    ],
)
def test_a_sliding_window_caps_the_context_where_full_attention_is_the_same(
    arch: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    """batchgen computes full causal attention; transformers masks keys 80 or more positions back. Up to 80 positions
    they agree (greedy rows of up to 73 tokens equal HF's), so the context is capped at the window: a longer prompt
    is a row error, and a longer --context-length is refused in one line."""
    from tests.helpers.models import build_random_model

    note, refusal = _capped_at_80(build_random_model(tmp_path / "m", arch, **overrides), tmp_path)
    assert "sliding window of 80 tokens; context length set to 80" in note
    assert refusal == "batchgen: error: --context-length 100 exceeds the model's sliding window of 80"


def _capped_at_80(model_dir: Path, tmp_path: Path) -> tuple[str, str]:
    """A run of the greedy rows (up to 73 tokens) and one of 86 on ``model_dir``, whose context stops at 80: the
    long row is a row error, the others equal HF's. Returns that run's output (its note) and the one line of a run
    asking for --context-length 100, which exits 2."""
    from tests.helpers.cli import read_rows, run_cli

    rows = greedy_prompts(vocab=300)
    long_row = {"id": "long", "prompt_token_ids": [0] + [5] * 84, "max_new_tokens": 2, "temperature": 0}
    dataset = write_jsonl(tmp_path / "prompts.jsonl", [*rows, long_row])
    code, note = run_cli(run_args(dataset, tmp_path / "a.arrow", model_dir, "--on-error", "skip"))
    assert code == 0, note
    results = read_rows(tmp_path / "a.arrow")
    assert "context" in results.pop("long")["error"]
    check_against_hf(model_dir, rows, results)
    code, refusal = run_cli(run_args(dataset, tmp_path / "b.arrow", model_dir, "--context-length", "100"))
    assert code == 2, refusal
    return note, refusal.strip()
