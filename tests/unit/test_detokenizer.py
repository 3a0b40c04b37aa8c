"""Incremental detokenization equals the full decode; stop strings are found across and inside tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from batchgen.loop.detokenizer import IncrementalDetokenizer, continuation_text, find_stop
from tests.helpers.models import STORIES, build_tokenizer, needs_shared


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
