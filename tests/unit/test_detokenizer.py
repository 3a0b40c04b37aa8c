"""Incremental detokenization equals the full decode; stop strings are found across and inside tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from batchgen.loop.detokenizer import IncrementalDetokenizer, continuation_text, find_stop
from tests.helpers.models import STORIES, build_tokenizer, byte_fallback_tokenizer, needs_shared


def _full_continuation(tokenizer: object, prompt: list[int], output: list[int]) -> str:
    full = tokenizer.decode(prompt + output, skip_special_tokens=True)  # type: ignore[attr-defined]
    before = tokenizer.decode(prompt, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert full.startswith(before)
    return full[len(before) :]


def _check_random_sequences(tokenizer: object, vocab: int, prompt: list[int], streamed_exact: bool) -> None:
    """Final text = the full decode's continuation; streamed text never shows a U+FFFD the full decode lacks.

    ``streamed_exact``: the streamed text is also a prefix of the final text. Not so for byte-fallback decoders,
    which turn a valid byte into U+FFFD once a later invalid byte joins its run.
    """
    rng = random.Random(0)
    for _ in range(30):
        output = [rng.randrange(0, vocab) for _ in range(rng.randrange(1, 40))]
        expected = _full_continuation(tokenizer, prompt, output)
        assert continuation_text(tokenizer, prompt, output, skip_special=True) == expected
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special=True)
        for token in output:
            new = detok.update([token])
            assert "\ufffd" not in new or "\ufffd" in expected
            assert detok.text == new if not detok.text else detok.text.endswith(new)
        if streamed_exact:
            assert expected.startswith(detok.text)


def test_byte_level_tokenizer(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path)
    _check_random_sequences(tokenizer, len(tokenizer), tokenizer("Once upon a time")["input_ids"], streamed_exact=True)


@needs_shared
def test_sentencepiece_byte_fallback_tokenizer() -> None:
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    _check_random_sequences(tokenizer, 512, [1, 403, 407, 261, 378], streamed_exact=False)


@needs_shared
def test_split_character_appears_whole() -> None:
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    detok = IncrementalDetokenizer(tokenizer, [1, 403], skip_special=True)
    # U+1F642 is the bytes F0 9F 99 82, i.e. byte tokens 3 + byte value.
    pieces = [detok.update([3 + b]) for b in "🙂".encode()]
    assert pieces == ["", "", "", "🙂"]


@pytest.mark.parametrize("source", ["byte_fallback", pytest.param("stories260k", marks=needs_shared)])
@pytest.mark.parametrize(("prompt", "output"), [("Look: 😀😀", "😃😃 ok"), ("好😀", "世界你好 and more")])
def test_a_prompt_ending_in_a_run_of_byte_tokens_streams_the_text_the_full_decode_gives(
    source: str, prompt: str, output: str
) -> None:
    """Found by a tester: with a prompt ending in more byte tokens than the window's context (two emoji on a
    byte-fallback tokenizer), the window began inside a character, the decoder wrote the run (the output's bytes
    too) as U+FFFD, and no stop string in that output was seen. Each token's streamed text now grows towards HF's
    full decode, ``decode(prompt + output) - decode(prompt)``, and ends at it."""
    tokenizer = byte_fallback_tokenizer() if source == "byte_fallback" else AutoTokenizer.from_pretrained(STORIES)
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(prompt + output)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and len(prompt_ids) > 7  # the prompt's last 6 are inside bytes
    output_ids = ids[len(prompt_ids) :]
    expected = _full_continuation(tokenizer, prompt_ids, output_ids)
    assert expected == output
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special=True)
    for token in output_ids:
        detok.update([token])
        assert expected.startswith(detok.text)
    assert detok.text == expected


@pytest.mark.parametrize(
    ("text", "new_len", "stops", "expected"),
    [
        (", there was a little girl nam", 4, ["nam"], (26, "nam")),  # inside the last token
        ("abc", 1, ["b"], None),  # the match lies in older text only
        ("abcd", 2, ["bc", "cd"], (1, "bc")),  # the earliest match wins
        ("xyz", 3, ["q"], None),
    ],
)
def test_find_stop(text: str, new_len: int, stops: list[str], expected: tuple[int, str] | None) -> None:
    assert find_stop(text, new_len, stops) == expected
