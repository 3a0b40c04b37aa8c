"""lm-eval requests as batchgen rows (batchgen.eval.requests): HF's truncation rules, worked by hand."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]'; '.[dev]' has it too)")

from batchgen.eval.requests import generation_row, scoring_row  # noqa: E402


def test_a_request_that_fits_is_scored_whole() -> None:
    row = scoring_row([1, 2, 3], [4, 5], max_length=8, name="r")
    assert row == {"prompt_token_ids": [1, 2, 3, 4, 5], "prompt_logprobs_from": 3, "max_new_tokens": 0}


def test_a_long_context_loses_its_first_tokens() -> None:
    # HF keeps the last max_length + 1 = 5 tokens: the model reads 4, the fifth is only a target.
    row = scoring_row([1, 2, 3, 4, 5, 6], [7, 8], max_length=4, name="r")
    assert row["prompt_token_ids"] == [4, 5, 6, 7, 8]
    assert row["prompt_logprobs_from"] == 3


def test_a_continuation_longer_than_max_length_has_its_last_tokens_scored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        row = scoring_row([1, 2], [3, 4, 5, 6, 7, 8], max_length=4, name="doc 7")
    assert row["prompt_token_ids"] == [4, 5, 6, 7, 8]
    assert row["prompt_logprobs_from"] == 1  # all 4 tokens the window can score
    assert "doc 7: continuation of 6 tokens > max_length 4: only its last 4 tokens are scored" in caplog.text


def test_greedy_generation_with_until_and_eos() -> None:
    kwargs = {"until": ["\n\n", "Q:"], "do_sample": False, "temperature": 0.8, "max_gen_toks": 5}
    row, until = generation_row([1, 2, 3], kwargs, "</s>", max_length=16, max_gen_toks=256, name="r")
    assert until == ["\n\n", "Q:", "</s>"]
    assert row == {
        "prompt_token_ids": [1, 2, 3],
        "max_new_tokens": 5,
        "stop": ["\n\n", "Q:", "</s>"],
        "logprobs": False,
        "temperature": 0.0,  # do_sample false wins over a temperature, as lm-eval normalizes it
    }


def test_sampling_arguments_pass_through() -> None:
    kwargs = {"until": "\n", "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3}
    row, until = generation_row([1], kwargs, "</s>", max_length=16, max_gen_toks=256, name="r")
    assert until == ["\n", "</s>"]
    assert (row["temperature"], row["top_p"], row["top_k"], row["max_new_tokens"]) == (0.7, 0.9, 20, 3)


def test_no_max_gen_toks_takes_the_default_and_empty_stops_are_dropped() -> None:
    row, until = generation_row([1], {"until": [""]}, "", max_length=300, max_gen_toks=256, name="r")
    assert row["max_new_tokens"] == 256
    assert row["temperature"] == 0.0  # no do_sample, no temperature: greedy
    assert row["stop"] == [] and until == [""]


def test_unknown_generation_arguments_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        row, _ = generation_row([1], {"num_beams": 4, "until": []}, "</s>", 16, 8, "r")
    assert "num_beams" not in row
    assert "generation arguments num_beams are no batchgen sampling fields: ignored" in caplog.text


def test_the_context_is_cut_to_leave_room_for_the_generation() -> None:
    row, _ = generation_row(list(range(10)), {"max_gen_toks": 4}, "</s>", max_length=8, max_gen_toks=256, name="r")
    assert row["prompt_token_ids"] == [6, 7, 8, 9]
    assert row["max_new_tokens"] == 4


def test_no_room_for_the_context_shrinks_the_generation(caplog: pytest.LogCaptureFixture) -> None:
    # HF asserts max_gen_toks < max_length; lm-eval's maybe_truncate(shrink_gen_toks=True) keeps a context that
    # fits and generates into the rest.
    with caplog.at_level(logging.WARNING):
        row, _ = generation_row([1, 2, 3], {"max_gen_toks": 8}, "</s>", max_length=8, max_gen_toks=256, name="doc 2")
    assert (row["prompt_token_ids"], row["max_new_tokens"]) == ([1, 2, 3], 5)
    assert "doc 2: max_gen_toks 8 >= max_length 8: shrunk to fit" in caplog.text
    row, _ = generation_row(list(range(12)), {"max_gen_toks": 9}, "</s>", max_length=8, max_gen_toks=256, name="r")
    assert (row["prompt_token_ids"], row["max_new_tokens"]) == (list(range(5, 12)), 1)  # max_length - 1 kept
