"""vLLM's ``bad_words``: which ids a row may not pick next, by hand-worked cases of vLLM's rule (a sequence's last
token is banned where the output ends with its other tokens; a one-token word always), and the sequences a word
gives with a Llama (SentencePiece) tokenizer, whose word-initial pieces carry the space as ``▁``."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from batchgen.sampling.bad_words import bad_word_bans, bad_word_sequences
from tests.helpers.models import STORIES, build_tokenizer, needs_shared


@pytest.mark.parametrize(
    ("output", "banned"),
    [
        ([], [9]),  # only the one-token word: (4, 5, 6) needs two tokens of output, (7, 8) one
        ([1, 2, 7], [8, 9]),
        ([4, 5], [6, 9]),
        ([5, 4, 5], [6, 9]),
        ([4, 5, 1], [9]),
        ([5], [9]),  # (4, 5, 6) needs 4 before the 5
    ],
)
def test_the_next_token_of_a_begun_word_is_banned(output: list[int], banned: list[int]) -> None:
    assert bad_word_bans([(4, 5, 6), (7, 8), (9,)], output) == banned
    for cut in range(len(output) + 1):  # a verify round's drafts after the output so far: the same tokens
        assert bad_word_bans([(4, 5, 6), (7, 8), (9,)], [1, 1, *output[:cut]], output[cut:]) == banned
    assert bad_word_bans([], output) == []


def test_a_word_gives_its_sequence_alone_and_after_a_space(tmp_path: Path) -> None:
    """With a GPT-2 style byte-level BPE (a word's leading space is its first piece's ``Ġ``), the word alone and
    after a space, as the tokenizer itself splits them, whatever their lengths; a word with leading spaces is the
    same word; a word of only whitespace has no tokens."""
    tokenizer = build_tokenizer(tmp_path)
    for word in ("fox", "the lazy dog", "  quick"):
        alone, spaced = word.strip(), " " + word.strip()
        want = [tuple(tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))) for text in (alone, spaced)]
        assert want[0] != want[1] and tokenizer.tokenize(spaced)[0].startswith("Ġ")
        assert list(bad_word_sequences(tokenizer, [word])) == want
    with pytest.raises(ValueError, match="encodes to no tokens"):
        bad_word_sequences(tokenizer, ["  "])


@needs_shared
def test_a_llama_word_is_one_sequence(tmp_path: Path) -> None:
    """SentencePiece with a dummy prefix: ``Lily`` and `` Lily`` are both ``▁Lily``, one sequence."""
    tokenizer = AutoTokenizer.from_pretrained(Path(STORIES))
    assert bad_word_sequences(tokenizer, ["Lily"]) == (tuple(tokenizer.convert_tokens_to_ids(["▁Lily"])),)
